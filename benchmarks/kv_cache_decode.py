"""transformers' DynamicCache vs the engine's KV slab: one decode step, and one sequence joining.

Both run the same model on the same rows (B sequences of T tokens):
  dynamic  DynamicCache with a 2D mask: each step appends one column by torch.cat (a copy of the
           whole cache per layer); a sequence joins by being prefilled alone, left-padded to the
           batch's width and concatenated into every layer (batch_select_indices drops rows, but
           there is no merge: it is the cat)
  slab     whale.engine.kv.KVSlab with a 4D mask: each step writes one column in place; a
           sequence joins by being prefilled into a free row (nothing else moves)
Times are the best of `--repeat`, alternating the two, in one process.

    python benchmarks/kv_cache_decode.py --rows 16 --context 300
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from whale.engine.hf import HFEngine  # noqa: E402
from whale.engine.kv import KVSlab  # noqa: E402
from machine import best_time  # noqa: E402  (benchmarks/ is the script's folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    engine = HFEngine(args.model)
    model, dev = engine.model, engine.device
    b, t = args.rows, args.context
    layers = model.config.num_hidden_layers
    prompts = torch.randint(100, 1000, (b, t), device=dev)
    newcomer = torch.randint(100, 1000, (1, t // 2), device=dev)

    def forward(cache, **kw):
        return model(use_cache=True, **{engine.cache_kwarg: cache}, **kw).logits

    with torch.no_grad():
        # ---------------------------------------------------------------- dynamic
        def dynamic_prefill():
            cache = DynamicCache(config=model.config)
            forward(cache, input_ids=prompts, attention_mask=torch.ones_like(prompts), logits_to_keep=1)
            return cache

        def dynamic_steps():
            cache = dynamic_prefill()
            mask = torch.ones((b, t), dtype=torch.long, device=dev)
            pos = torch.full((b, 1), t, device=dev)
            tok = prompts[:, -1:]
            start = time.perf_counter()
            for _ in range(args.steps):
                mask = torch.cat([mask, mask.new_ones((b, 1))], dim=-1)
                forward(cache, input_ids=tok, attention_mask=mask, position_ids=pos)
                pos = pos + 1
            return (time.perf_counter() - start) / args.steps

        def dynamic_join():
            cache = dynamic_prefill()
            alone = DynamicCache(config=model.config)
            forward(alone, input_ids=newcomer, logits_to_keep=1)
            start = time.perf_counter()
            for big, small in zip(cache.layers, alone.layers):  # left-pad the newcomer, concatenate
                pad = big.keys.shape[2] - small.keys.shape[2]
                big.keys = torch.cat([big.keys, torch.nn.functional.pad(small.keys, (0, 0, pad, 0))], dim=0)
                big.values = torch.cat([big.values, torch.nn.functional.pad(small.values, (0, 0, pad, 0))], dim=0)
            return time.perf_counter() - start

        # ---------------------------------------------------------------- slab
        def slab_prefill():
            slab = KVSlab(layers, dev)
            slab.reserve(b + 1, t + args.steps + 1)
            cols = torch.arange(t, device=dev).expand(b, t)
            rows = torch.arange(b, device=dev).unsqueeze(-1).expand(b, t)
            mask = (torch.arange(t, device=dev) <= torch.arange(t, device=dev).unsqueeze(-1)).expand(b, 1, t, t)
            forward(slab.view(0, b, rows, cols, t), input_ids=prompts, attention_mask=mask, position_ids=cols,
                    logits_to_keep=1)
            return slab

        def slab_steps():
            slab = slab_prefill()
            kv = torch.full((b, 1), t, device=dev)
            tok = prompts[:, -1:]
            rows = torch.arange(b, device=dev).unsqueeze(-1)
            start = time.perf_counter()
            for _ in range(args.steps):
                width = int(kv.max()) + 1
                mask = (torch.arange(width, device=dev) <= kv).view(b, 1, 1, width)
                forward(slab.view(0, b, rows, kv, width), input_ids=tok, attention_mask=mask, position_ids=kv)
                kv = kv + 1
            return (time.perf_counter() - start) / args.steps

        def slab_join():
            slab = slab_prefill()
            n = newcomer.shape[1]
            cols = torch.arange(n, device=dev).unsqueeze(0)
            mask = (torch.arange(n, device=dev) <= torch.arange(n, device=dev).unsqueeze(-1)).view(1, 1, n, n)
            start = time.perf_counter()
            forward(slab.view(b, 1, torch.full((1, n), b, device=dev), cols, n), input_ids=newcomer,
                    attention_mask=mask, position_ids=cols, logits_to_keep=1)
            return time.perf_counter() - start, slab

        prefill_alone = best_time(lambda: forward(DynamicCache(config=model.config), input_ids=newcomer,
                                                  logits_to_keep=1), args.repeat, warmup=False)
        results = {"dynamic step": [], "slab step": [], "dynamic merge": [], "slab join (prefill)": []}
        for _ in range(args.repeat):  # alternate, so load changes on a shared machine hit both
            results["dynamic step"].append(dynamic_steps())
            results["slab step"].append(slab_steps())
            results["dynamic merge"].append(dynamic_join())
            results["slab join (prefill)"].append(slab_join()[0])
    print(f"model {args.model} ({engine.dtype}), {b} rows x {t} tokens, {torch.get_num_threads()} threads")
    for name, values in results.items():
        print(f"{name:22s} {min(values) * 1000:8.1f} ms")
    print(f"{'prefill newcomer alone':22s} {prefill_alone * 1000:8.1f} ms  "
          "(dynamic join = this + merge; slab join includes its prefill)")
    ratio = min(results["dynamic step"]) / min(results["slab step"])
    print(f"decode step dynamic/slab = {ratio:.2f}")


if __name__ == "__main__":
    main()
