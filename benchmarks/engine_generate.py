"""Throughput of HFEngine.generate against raw batched `model.generate` on the same prompts.

Why: the engine runs its own decode loop (per-row generators, finished rows dropped); this checks
that it costs no more than transformers' own batched generation. Tokens/s counts generated tokens
(up to and including EOS) of all rows.

    python benchmarks/engine_generate.py --batch 8 32 --max-tokens 64 [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from whale.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from whale.engine.hf import HFEngine  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is 7 times 8?",
    "Who wrote Hamlet?", "What is the largest ocean?", "Give a synonym for happy.",
    "What gas do plants absorb?", "How many legs does a spider have?",
]


def raw_generate(engine: HFEngine, prompts: list[list[int]], sampling: SamplingParams) -> int:
    """Left-padded `model.generate` of all prompts in one batch; returns generated tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), engine.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device),
            max_new_tokens=sampling.max_tokens, do_sample=sampling.temperature > 0,
            temperature=sampling.temperature or None, top_k=sampling.top_k or None, top_p=sampling.top_p,
            pad_token_id=engine.pad_id, eos_token_id=sorted(engine.eos_ids),
        )
    total = 0
    for row in out[:, width:].tolist():  # count up to and including the first EOS
        n = next((i + 1 for i, t in enumerate(row) if t in engine.eos_ids), len(row))
        total += n
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeat", type=int, default=1, help="measure each case this many times (best kept)")
    ap.add_argument("--no-raw", action="store_true", help="skip the model.generate comparison")
    args = ap.parse_args()

    t0 = time.time()
    engine = HFEngine(args.model, dtype=args.dtype, device=args.device, max_batch_size=max(args.batch))
    print(f"load {time.time() - t0:.1f} s  device={engine.device} dtype={engine.dtype} "
          f"threads={torch.get_num_threads()}")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, max_tokens=args.max_tokens)
    engine.generate([GenerationRequest([{"role": "user", "content": "hi"}], max_tokens=4, seed=0)], sampling)
    for b in args.batch:
        reqs = [GenerationRequest([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], seed=i)
                for i in range(b)]
        best, best_raw = 0.0, 0.0
        for _ in range(args.repeat):  # alternate the two, so machine noise hits both alike
            t = time.time()
            gens = engine.generate(reqs, sampling)
            dt = time.time() - t
            ntok = sum(g[0].completion_tokens for g in gens)
            best = max(best, ntok / dt)
            line = f"batch {b:3d}: engine {ntok} tok in {dt:.2f} s = {ntok / dt:6.1f} tok/s"
            if not args.no_raw:
                t = time.time()
                raw = raw_generate(engine, [g[0].prompt_ids for g in gens], sampling)
                raw_dt = time.time() - t
                best_raw = max(best_raw, raw / raw_dt)
                line += f" | model.generate {raw} tok in {raw_dt:.2f} s = {raw / raw_dt:6.1f} tok/s"
            print(line, flush=True)
        raw_note = "" if args.no_raw else f", model.generate {best_raw:.1f} tok/s"
        print(f"batch {b:3d} best: engine {best:.1f} tok/s{raw_note}")

if __name__ == "__main__":
    main()
