"""How wide the engine should decode: the same recorded calls at several widths, side by side.

A width W is `model.max_batch_size = W` (live decode rows) with `runner.concurrency = W`
(episodes in flight). Why it matters on a CPU: a decode step reads every Linear weight once
whatever the rows, and bf16 GEMMs at M = 21 rows ran at ~87 GFLOP/s with the weights streamed
from memory against ~147 at M = 64 and ~174 at M = 128 (the model's own 211 Linear layers in
order, one thread; benchmarks/machine.py measures one hot GEMM, which hides this). Wider steps
also merge more arrivals into each prefill forward.

Per workload, in ONE process: the runner records its calls once at the config's width; then per
repeat, alternating, for each width: the runner end to end (episodes/s) and the raw engine
replaying exactly the recorded calls chained (`concurrency` = width episodes at once; generated
tokens/s). Ratios are per repeat, against the first width.

    OMP_NUM_THREADS=1 python benchmarks/decode_width.py --workload searchqa --problems 32 --k 4 --widths 32,64,128
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from replay import Recorder, delta, episodes_of, fresh, generated, replay_chained  # noqa: E402
from workloads import WORKLOADS, load_workload  # noqa: E402
from whale.rollout.runner import RolloutRunner  # noqa: E402


def run_workload(name: str, args) -> dict:
    n_eps = args.problems * args.k
    base, domain, problems, harness, sampling, engine = load_workload(name, args.problems)
    recorder = Recorder(engine)
    runners = {}
    for w in args.widths:
        cfg = base.model_copy(deep=True)
        cfg.runner.concurrency = min(w, n_eps)
        runners[w] = RolloutRunner(recorder, domain, cfg)
        runners[w].run(harness, problems[:2], seed=99)  # warm-up: fork server, grader pool, kernels
    engine.max_batch_size = args.widths[0]
    recorder.requests = []
    runners[args.widths[0]].run(harness, problems, samples=args.k, seed=0)
    episodes = episodes_of(recorder.requests, problems, args.k, 0, base.domain.budget.llm_calls)
    repeats = []
    for rep in range(args.repeat):
        row: dict = {"widths": {}}
        for w in args.widths:
            engine.max_batch_size = w
            fresh(engine)
            t0 = time.perf_counter()
            trajs = runners[w].run(harness, problems, samples=args.k, seed=rep + 1)
            runner_s = time.perf_counter() - t0
            before = fresh(engine)
            seconds, gens = replay_chained(engine, episodes, sampling, min(w, n_eps))
            st = delta(engine.stats, before)
            row["widths"][w] = {
                "runner_eps": len(trajs) / runner_s, "raw_s": seconds, "raw_tok_s": generated(gens) / seconds,
                "prefill_s": st["prefill_seconds"], "decode_s": st["decode_seconds"],
                "prefill_forwards": st["prefill_forwards"], "decode_steps": st["decode_steps"],
                "mean_live_rows": st["decode_tokens"] / max(1, st["decode_steps"]),
                "slab_peak_mib": engine.stats["slab_peak_bytes"] / 2**20,
            }
        first = row["widths"][args.widths[0]]
        for w, v in row["widths"].items():
            v["raw_over_first_width"] = v["raw_tok_s"] / first["raw_tok_s"]
            v["runner_over_first_width"] = v["runner_eps"] / row["widths"][args.widths[0]]["runner_eps"]
        repeats.append(row)
        print(f"[{name} {rep}] " + " | ".join(f"w{w}: runner {v['runner_eps']:.2f} ep/s ({v['runner_over_first_width']:.2f}x), raw "
                                   f"{v['raw_tok_s']:.1f} tok/s ({v['raw_over_first_width']:.2f}x), prefill "
                                   f"{v['prefill_s']:.1f} s in {v['prefill_forwards']} forwards, decode {v['decode_s']:.1f} s "
                                   f"at {v['mean_live_rows']:.1f} rows" for w, v in row["widths"].items()), flush=True)
    for r in runners.values():
        r.close()
    engine.close()
    summary = {w: {"runner_over_first_width": statistics.fmean(r["widths"][w]["runner_over_first_width"] for r in repeats),
                   "raw_over_first_width": statistics.fmean(r["widths"][w]["raw_over_first_width"] for r in repeats),
                   "slab_peak_mib": repeats[0]["widths"][w]["slab_peak_mib"]} for w in args.widths}
    return {"workload": name, "repeats": repeats, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="searchqa", choices=[*WORKLOADS, "all"])
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--k", type=int, default=4, help="samples per problem")
    ap.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write all numbers here")
    args = ap.parse_args()
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}", flush=True)
    results = [run_workload(n, args) for n in names]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS {peak:.0f} MiB, load now {os.getloadavg()[0]:.1f}")
    for r in results:
        for w, s in r["summary"].items():
            print(f"{r['workload']:9s} width {w:4d}: runner {s['runner_over_first_width']:.2f}x width "
                  f"{args.widths[0]} | raw engine {s['raw_over_first_width']:.2f}x | "
                  f"slab peak {s['slab_peak_mib']:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_rss_mib": peak, "results": results}, indent=1))


if __name__ == "__main__":
    main()
