"""Generation with a LoRA adapter: the engine's joined LoRA GEMMs (engine/adapted.py) against peft's
own LoRA forward, and both against the base model, side by side in one process.

The runner records a workload's calls on the base model (one seed per repeat, as
benchmarks/workloads.py does); the engine's model is then wrapped with the trainer's own LoRA
(`whale.weights.trainer.wrap_lora`, the config's `weight.lora`: r = 16 on every Linear by default),
its B drawn small and non-zero as after some training, and each repeat replays its calls (chained,
`concurrency` episodes at once) three ways, in an order that alternates between repeats:
  joined  the adapter in the base layer's GEMM: [x | x A^T] [W | s B]^T
  peft    peft's LoRA Linear forward (base GEMM, float32 rank-r GEMMs, scale, add, cast)
  base    the adapter disabled (peft's `disable_adapter`): the base model's cost
Reports tokens/s ratios per repeat with their geometric mean and 95% interval, and how many calls
drew the same ids joined and peft (not bitwise peft's: rounding differs, engine/adapted.py).

    OMP_NUM_THREADS=1 python benchmarks/lora_generation.py --workload searchqa --problems 16 --k 4 --repeat 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine_settings import setting  # noqa: E402
from replay import Recorder, episodes_of, fresh, generated, replay_chained  # noqa: E402
from workloads import load_workload, ratio_interval  # noqa: E402

from whale.rollout.runner import RolloutRunner  # noqa: E402
from whale.weights.trainer import wrap_lora  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="searchqa")
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--b-std", type=float, default=0.004, help="std of the adapter's B (peft starts it at zero)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    n_eps = args.problems * args.k
    wl = load_workload(args.workload, args.problems, [f"runner.concurrency={min(args.concurrency, n_eps)}"])
    engine, cfg = wl.engine, wl.config
    recorder = Recorder(engine)
    runner = RolloutRunner(recorder, wl.domain, cfg)
    calls = []
    for rep in range(args.repeat):  # each repeat's calls, recorded on the base model
        recorder.requests = []
        runner.run(wl.harness, wl.problems, samples=args.k, seed=rep)
        calls.append(episodes_of(recorder.requests, wl.problems, args.k, rep, cfg.domain.budget.llm_calls))
    runner.close()

    peft_model = wrap_lora(engine.model, cfg.weight.lora, seed=0)  # in place, as the in-process trainer does
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, args.b_std, generator=gen)
    print(f"adapter: r={cfg.weight.lora.r} alpha={cfg.weight.lora.alpha} on {cfg.weight.lora.target_modules}, "
          f"B ~ N(0, {args.b_std}); torch threads {torch.get_num_threads()}, OMP_NUM_THREADS "
          f"{os.environ.get('OMP_NUM_THREADS')}", flush=True)
    ways = {"joined": contextlib.nullcontext, "peft": lambda: setting(engine, "adapted_linears", None),
            "base": peft_model.disable_adapter}
    replay_chained(engine, calls[0], wl.sampling, args.concurrency)  # warm-up: joined weights, packs, slab
    rows = []
    for rep in range(args.repeat):
        order = list(ways) if rep % 2 == 0 else list(reversed(ways))
        row, ids = {}, {}
        for way in order:
            fresh(engine)
            with ways[way]():
                seconds, gens = replay_chained(engine, calls[rep], wl.sampling, args.concurrency)
            row[way + "_s"], row[way + "_tok_s"] = seconds, generated(gens) / seconds
            ids[way] = [g[0].completion_ids for g in gens]
        row["joined_over_peft"] = row["joined_tok_s"] / row["peft_tok_s"]
        row["base_over_joined"] = row["base_tok_s"] / row["joined_tok_s"]
        row["base_over_peft"] = row["base_tok_s"] / row["peft_tok_s"]
        row["same_ids_joined_peft"] = f"{sum(a == b for a, b in zip(ids['joined'], ids['peft']))}/{len(ids['peft'])}"
        rows.append(row)
        print(f"[{rep}] tok/s joined {row['joined_tok_s']:.1f}, peft {row['peft_tok_s']:.1f}, base "
              f"{row['base_tok_s']:.1f}: joined/peft {row['joined_over_peft']:.2f}, base/joined "
              f"{row['base_over_joined']:.2f}, base/peft {row['base_over_peft']:.2f}; same ids joined/peft "
              f"{row['same_ids_joined_peft']}", flush=True)
    summary = {}
    for key in ("joined_over_peft", "base_over_joined", "base_over_peft"):
        ci = ratio_interval([r[key] for r in rows])
        if ci:
            summary[key] = ci
            print(f"{key}: geo-mean {ci[0]:.2f}, 95% CI {ci[1]:.2f}-{ci[2]:.2f}")
    engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "repeats": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
