"""The hf engine on CUDA: per-row seeds (batch invariance) and throughput against `model.generate`.

What the CPU suite cannot show: that the engine's own decode loop (KV slab, continuous batching,
prefix sharing, per-row generators) gives on a GPU (1) the same ids for a request whether it runs
alone or among others, in float32 and in bf16, and (2) at least the throughput of transformers'
own batched `model.generate` on the same prompts. The model has SmolLM2-135M's shape (30 layers,
576 hidden, 9 heads / 3 KV heads, 1536 MLP) with random weights and the tests' tiny tokenizer, so
nothing is downloaded; random weights rarely sample EOS, so every row runs to `max_tokens`.

    python scripts/gpu_engine_check.py [--device cuda] [--out results.json]
    python scripts/gpu_engine_check.py --profile 8 64 [--device cuda]   # where a step's time goes

`--profile` runs the engine and `model.generate` on the same prompts under torch.profiler (every
thread: the engine's forwards run in its scheduler thread) and prints each one's top operators by
host time and its CUDA kernel launches per generated token.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 7 times 8?",
             "Who wrote Hamlet?", "What is the largest ocean?", "Give a synonym for happy.",
             "What gas do plants absorb?", "How many legs does a spider have?"]


def smollm2_shaped(folder: Path) -> Path:
    """A random model of SmolLM2-135M's architecture with the tiny test tokenizer."""
    from tiny_model import build_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    build_tiny_model(folder)
    cfg = LlamaConfig.from_pretrained(folder)
    cfg.update(dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                    rope_theta=100000.0))
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def requests(n: int, max_tokens: int, long_prefix: bool = False):
    from whale.engine.base import GenerationRequest

    pre = ("Background: " + " ".join(QUESTIONS) + "\n") * (4 if long_prefix else 0)
    return [GenerationRequest([{"role": "user", "content": pre + QUESTIONS[i % len(QUESTIONS)]}],
                              max_tokens=max_tokens, seed=1000 + i) for i in range(n)]


def invariance(model: Path, device: str, dtype: str) -> dict:
    """Ids of 24 requests run one at a time vs all at once vs staggered (joining a running batch)."""
    from whale.engine.base import SamplingParams
    from whale.engine.hf import HFEngine

    eng = HFEngine(str(model), dtype=dtype, device=device, max_batch_size=64, max_model_len=512,
                   prefix_cache_bytes=0)
    sampling = SamplingParams(temperature=1.0, top_k=20, max_tokens=24)
    reqs = requests(24, 24)
    alone = [eng.generate([r], sampling)[0][0].completion_ids for r in reqs]
    together = [g[0].completion_ids for g in eng.generate(reqs, sampling)]
    futures = []
    for i, r in enumerate(reqs):  # staggered: each joins a batch already decoding
        futures.append(eng.submit(r, sampling))
        if i % 4 == 3:
            time.sleep(0.01)
    staggered = [f.result()[0].completion_ids for f in futures]
    eng.close()
    return {"dtype": dtype, "requests": len(reqs),
            "together_equal_alone": sum(a == b for a, b in zip(alone, together)),
            "staggered_equal_alone": sum(a == b for a, b in zip(alone, staggered))}


def throughput(model: Path, device: str, batches: list[int], max_tokens: int, repeat: int) -> list[dict]:
    """Engine tok/s vs left-padded `model.generate` on the same prompts, alternated, best of `repeat`."""
    from engine_generate import raw_generate
    from whale.engine.base import SamplingParams
    from whale.engine.hf import HFEngine

    eng = HFEngine(str(model), dtype="auto", device=device, max_batch_size=max(batches), max_model_len=1024)
    sampling = SamplingParams(temperature=1.0, top_k=20, max_tokens=max_tokens)
    eng.generate(requests(4, 8), sampling)  # warm-up
    raw_generate(eng, [[1, 2, 3]] * 4, SamplingParams(temperature=1.0, top_k=20, max_tokens=8))
    out = []
    for b in batches:
        for shared in (False, True):
            best, best_raw = 0.0, 0.0
            for _ in range(repeat):
                reqs = requests(b, max_tokens, long_prefix=shared)
                eng.load_weights(None, eng.weights_version)  # empties the prefix cache
                t = time.perf_counter()
                gens = eng.generate(reqs, sampling)
                dt = time.perf_counter() - t
                ntok = sum(g[0].completion_tokens for g in gens)
                best = max(best, ntok / dt)
                t = time.perf_counter()
                raw = raw_generate(eng, [g[0].prompt_ids for g in gens], sampling)
                best_raw = max(best_raw, raw / (time.perf_counter() - t))
            row = {"batch": b, "long_shared_prefix": shared, "prompt_tokens": len(gens[0][0].prompt_ids),
                   "engine_tok_s": round(best, 1), "generate_tok_s": round(best_raw, 1),
                   "engine_over_generate": round(best / best_raw, 2)}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def profile_rows(model: Path, device: str, rows: list[int], max_tokens: int) -> None:
    """Top host-side operators of the engine and of `model.generate` on the same prompts."""
    import torch
    from engine_generate import raw_generate
    from torch.profiler import ProfilerActivity, profile
    from whale.engine.base import SamplingParams
    from whale.engine.hf import HFEngine

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        config = None
    eng = HFEngine(str(model), dtype="auto", device=device, max_batch_size=max(rows), max_model_len=1024)
    sampling = SamplingParams(temperature=1.0, top_k=20, max_tokens=max_tokens)
    eng.generate(requests(4, 8), sampling)
    raw_generate(eng, [[1, 2, 3]] * 4, SamplingParams(temperature=1.0, top_k=20, max_tokens=8))
    for b in rows:
        reqs = requests(b, max_tokens)
        prompts = [g[0].prompt_ids for g in eng.generate(reqs, sampling)]
        for name, run in (("engine", lambda: sum(g[0].completion_tokens for g in eng.generate(reqs, sampling))),
                          ("model.generate", lambda: raw_generate(eng, prompts, sampling))):
            eng.load_weights(None, eng.weights_version)  # empties the prefix cache
            kwargs = {"experimental_config": config} if config is not None else {}
            with profile(activities=activities, **kwargs) as prof:
                t = time.perf_counter()
                ntok = run()
                dt = time.perf_counter() - t
            events = prof.key_averages()
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
            print(f"\n== {name}, {b} rows: {ntok} tokens in {dt:.2f} s under the profiler ({ntok / dt:.0f} tok/s); "
                  f"{launches / max(1, ntok / b):.0f} kernel launches per decode step", flush=True)
            print(events.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, nargs="*", default=None, help="profile at these row counts instead")
    args = ap.parse_args()
    import torch

    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            sys.exit("CUDA is not available here")
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for the invariance check
    model = smollm2_shaped(Path(tempfile.mkdtemp(prefix="whale-gpu-model-")))
    if args.profile:
        profile_rows(model, args.device, args.profile, args.max_tokens)
        return
    result: dict = {"device": args.device, "torch": torch.__version__,
                    "name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"}
    result["invariance"] = []
    for dtype in ("float32", "bfloat16"):
        row = invariance(model, args.device, dtype)
        print(json.dumps(row), flush=True)
        result["invariance"].append(row)
    result["throughput"] = throughput(model, args.device, args.batches, args.max_tokens, args.repeat)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
