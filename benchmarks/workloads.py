"""Rollout throughput on what users run: search QA h0, math h0, chess with constrained choices.

Per workload, side by side in one process (same problems, same seeds, so the same calls):
  runner  RolloutRunner episodes/s: sandboxes, RPC, tools, grading, the streaming hf engine
  lockstep the same runner with runner.lockstep=all (deterministic batches, engine/lockstep.py)
  raw     the same engine replaying exactly the runner's recorded calls, each episode's calls in
          order (call i+1 submitted when call i returned), `concurrency` episodes at once, no
          sandbox and no tools: the ceiling the runner can reach
  unpacked the raw replay with every Linear on the plain GEMM, as before engine/packed.py (bf16)
  fresh   the raw replay on a KV slab that starts on fresh memory, as every batch did before the slab
          kept its storage (engine/kv.py): the page faults of its growths, and the same ids
  waves   the same engine on the same calls in waves (every episode's i-th call in one generate)
  threads the runner and the raw replay again with the engine's forwards on `--other-threads`
          intra-op threads (default: every usable core) instead of `model.cpu_threads`' default
  switch  the runner again with the GIL switch interval at `--switch-interval` (Python's default 5 ms)
  cold    the runner again with each run launching its fork server as it starts, as before
          whale/rollout/fork_server.py's spare (run right after the runner; the raw replay then gives
          the next repeat's spare its time to start)
The prefix cache is cleared before every measurement, so no run reuses another's work. The warm-up
runs each repeat's calls once (`--no-prime` skips it): a KV slab larger than any before zeroes new
storage (page faults, ~2 s for 750 MiB here), a one-off cost of an engine's first batches of that
size that would land on whichever variant met the size first (the runner, always first, in most
repeats); each variant's line shows the seconds it still spent on new storage.

Reports runner/raw (target >= 0.9), prefill tokens computed vs requested, prefill and decode tokens/s against the
machine's limit (model FLOPs and weight bytes per token, measured matmul GFLOP/s and memory
bandwidth), and peak memory. `--repeat` alternates the variants; ratios are per repeat.

    python benchmarks/workloads.py --workload searchqa --problems 16 --k 4 --repeat 2
    python benchmarks/workloads.py --workload all --problems 8 --k 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine_settings import cold_fork_server, fresh_slab, on_threads, switch_interval, unpacked  # noqa: E402
from machine import machine_limits  # noqa: E402
from replay import (Recorder, delta, episodes_of, fresh, generated, replay_chained, replay_waves,  # noqa: E402
                    timed)
from whale.config import load_config  # noqa: E402
from whale.domains import load_domain  # noqa: E402
from whale.engine import make_engine  # noqa: E402
from whale.engine.hf import engine_cpu_threads, usable_cores  # noqa: E402
from whale.rollout.runner import RolloutRunner, sampling_from_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {  # config, harness (None: the domain's h0), extra overrides
    "searchqa": ("configs/demo.yaml", None, []),
    "math": ("configs/math_cpu.yaml", None, []),
    "chess": ("configs/chess_cpu.yaml", "examples/harnesses/chess_constrained_choice.py", []),
}


class Workload(NamedTuple):
    """What every throughput benchmark builds the same way for a workload: its config (free-running
    batches, the test split cut to `problems`), domain, problems, harness, sampling and hf engine."""

    config: object
    domain: object
    problems: list
    harness: str
    sampling: object
    engine: object


def load_workload(name: str, problems: int, overrides: list[str] = ()) -> Workload:
    config_path, harness_path, extra = WORKLOADS[name]
    cfg = load_config(ROOT / config_path, [*extra, *overrides, f"domain.splits.test={problems}", "runner.lockstep=never"])
    domain = load_domain(cfg)
    harness = (ROOT / harness_path).read_text() if harness_path else domain.base_harness()
    return Workload(cfg, domain, domain.load_splits()["test"][:problems], harness, sampling_from_config(cfg),
                    make_engine(cfg))




VARIANTS = ("runner", "raw", "unpacked", "fresh", "waves", "lockstep", "threads", "switch", "cold")
NEEDS = {"raw": {"runner"}, "unpacked": {"runner", "raw"}, "fresh": {"runner", "raw"},
         "threads": {"runner", "raw"}, "switch": {"runner"}, "cold": {"runner"},
         "waves": {"runner"}, "lockstep": set(), "runner": set()}  # what each variant is compared with


def chosen_variants(names: str) -> set[str]:
    """The variants to run (comma-separated, or "all") and those they are compared with."""
    chosen = set(VARIANTS) if names == "all" else {n.strip() for n in names.split(",") if n.strip()}
    unknown = chosen - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    for name in list(chosen):
        chosen |= NEEDS[name]
    return chosen


def run_workload(name, args, limits) -> dict:
    n_eps = args.problems * args.k
    variants = chosen_variants(args.variants)
    cfg, domain, problems, harness, sampling, engine = load_workload(
        name, args.problems, [*args.overrides, f"runner.concurrency={min(args.concurrency, n_eps)}"])
    cfg_lockstep = cfg.model_copy(deep=True)
    cfg_lockstep.runner.lockstep = "all"
    recorder = Recorder(engine)
    runner = RolloutRunner(recorder, domain, cfg)
    runner_lockstep = RolloutRunner(engine, domain, cfg_lockstep) if "lockstep" in variants else None
    # warm-up at full size: fork server, grader pool, kernels, and the KV slab's kept storage (on CPU
    # a batch's first slab faults in fresh pages; every later batch of a run reuses them, engine/kv.py)
    runner.run(harness, problems, samples=args.k, seed=99)
    if args.prime:  # each repeat's calls once: the slab's kept storage reaches what the measured runs need
        for rep in range(args.repeat):
            runner.run(harness, problems, samples=args.k, seed=rep)
    if runner_lockstep is not None:
        runner_lockstep.run(harness, problems[:2], seed=99)  # its own grader pool and tool threads
    rows = []
    for rep in range(args.repeat):
        row = measure_repeat(rep, args, variants, cfg, problems, harness, sampling, engine, recorder, runner,
                             runner_lockstep)
        rows.append(row)
        print(f"[{name} {rep}] " + describe(row), flush=True)
    runner.close()
    if runner_lockstep is not None:
        runner_lockstep.close()
    kv = {"slab_peak_mib": engine.stats["slab_peak_bytes"] / 2**20,
          "slab_storage_peak_mib": engine.stats["slab_storage_peak_bytes"] / 2**20,
          "prefix_cache_peak_mib": engine.stats["prefix_peak_bytes"] / 2**20}
    engine.close()
    return {"workload": name, "variants": sorted(variants), "repeats": rows, "kv": kv,
            "summary": summarize(rows, limits)}


def measure_repeat(rep, args, variants, cfg, problems, harness, sampling, engine, recorder, runner,
                   runner_lockstep) -> dict:
    """One repeat: the chosen variants in a fixed order on the calls the runner makes with seed `rep`."""
    row: dict = {}
    recorder.requests = []
    before = fresh(engine)
    t0 = time.perf_counter()
    trajs = runner.run(harness, problems, samples=args.k, seed=rep)
    runner_s = time.perf_counter() - t0
    row.update(episodes=len(trajs), errors=sum(1 for t in trajs if t.error),
               mean_reward=statistics.fmean(t.reward for t in trajs), runner_s=runner_s,
               runner_eps=len(trajs) / runner_s, runner_engine=delta(engine.stats, before))
    episodes = episodes_of(recorder.requests, problems, args.k, rep, cfg.domain.budget.llm_calls)
    calls = row["calls"] = sum(len(ep) for ep in episodes)
    concurrency = cfg.runner.concurrency

    def same(a, b) -> str:
        return f"{sum(x[0].completion_ids == y[0].completion_ids for x, y in zip(a, b))}/{calls}"

    if "cold" in variants:
        fresh(engine)
        with cold_fork_server(runner):
            t0 = time.perf_counter()
            runner.run(harness, problems, samples=args.k, seed=rep)
            cold_s = time.perf_counter() - t0
        row.update(runner_over_cold=cold_s / runner_s, cold_eps=len(trajs) / cold_s)

    if "raw" in variants:
        before = fresh(engine)
        raw_s, raw_cpu, raw_gens = timed(replay_chained, engine, episodes, sampling, concurrency)
        raw_tok = generated(raw_gens)
        row.update(raw_s=raw_s, raw_cpu_s=raw_cpu, raw_eps=len(trajs) / raw_s, runner_over_raw=raw_s / runner_s,
                   raw_tok_s=raw_tok / raw_s, raw_engine=delta(engine.stats, before))
        row.update(engine_time("runner", runner_s, row["runner_engine"]), **engine_time("raw", raw_s, row["raw_engine"]))
    def against_raw(name: str, setting) -> dict:
        """The raw replay again under `setting`: raw tok/s over its tok/s (wall, and CPU per token),
        and how many calls drew the same ids; `{name}_engine` holds its engine counters."""
        before = fresh(engine)
        with setting:
            s, cpu, gens = timed(replay_chained, engine, episodes, sampling, concurrency)
        return {name: (raw_tok / raw_s) / (generated(gens) / s), name + "_cpu": (cpu / generated(gens)) / (raw_cpu / raw_tok),
                "same_ids_" + name: same(raw_gens, gens), name + "_s": s, name + "_engine": delta(engine.stats, before)}

    if "unpacked" in variants and engine.packed_linears is not None:
        row.update(against_raw("packed_over_unpacked", unpacked(engine)))
    if "fresh" in variants:
        row.update(against_raw("kept_over_fresh_slab", fresh_slab(engine)))
    if "waves" in variants:
        fresh(engine)
        waves_s, waves_cpu, waves_gens = timed(replay_waves, engine, episodes, sampling)
        row.update(waves_s=waves_s, waves_cpu_s=waves_cpu, waves_tok_s=generated(waves_gens) / waves_s)
        if "raw" in variants:
            row.update(waves_over_raw=row["waves_tok_s"] / (raw_tok / raw_s), same_ids_waves=same(raw_gens, waves_gens))
    if "lockstep" in variants:
        fresh(engine)
        t0 = time.perf_counter()
        lockstep_trajs = runner_lockstep.run(harness, problems, samples=args.k, seed=rep)
        lockstep_s = time.perf_counter() - t0
        row.update(lockstep_eps=len(lockstep_trajs) / lockstep_s, lockstep_over_runner=runner_s / lockstep_s,
                   lockstep_breaks=runner_lockstep.last_lockstep_breaks)
    if "threads" in variants:
        fresh(engine)
        with on_threads(engine, args.other_threads):
            t0 = time.perf_counter()
            runner.run(harness, problems, samples=args.k, seed=rep)
            other_s = time.perf_counter() - t0
        row.update(against_raw("raw_over_threads", on_threads(engine, args.other_threads)),
                   runner_over_threads=other_s / runner_s, threads=(engine.cpu_threads, args.other_threads))
    if "switch" in variants:
        fresh(engine)
        with switch_interval(args.switch_interval):
            t0 = time.perf_counter()
            runner.run(harness, problems, samples=args.k, seed=rep)
            switch_s = time.perf_counter() - t0
        row.update(switch_over_runner=runner_s / switch_s, switch_interval=args.switch_interval)
    return row


def engine_time(name: str, wall: float, stats: dict) -> dict:
    """Where the engine thread's wall time went: forwards (with sampling), the rest of its steps
    (admission, prefix cache, retiring; Python that waits for the GIL too; new slab storage), and
    idle (no call to run). `slab_fresh_s` is the part of the steps that zeroed new slab storage."""
    forwards = stats["prefill_seconds"] + stats["decode_seconds"]
    return {f"{name}_forwards_s": forwards, f"{name}_step_other_s": stats["step_seconds"] - forwards,
            f"{name}_idle_s": wall - stats["step_seconds"], f"{name}_slab_fresh_s": stats["slab_fresh_seconds"]}


AGAINST_RAW = (("packed_over_unpacked", "raw packed/unpacked GEMMs"),
               ("kept_over_fresh_slab", "kept/fresh slab"))  # the raw replay under a setting: key, label


def describe(row: dict) -> str:
    """One repeat's line: whatever of it was measured."""
    parts = [f"runner {row['runner_eps']:.2f} ep/s"]
    if "raw_eps" in row:
        parts.append(f"raw {row['raw_eps']:.2f} ep/s (runner/raw {row['runner_over_raw']:.2f}; engine thread "
                     f"forwards/other/idle s: runner {row['runner_forwards_s']:.2f}/{row['runner_step_other_s']:.2f}/"
                     f"{row['runner_idle_s']:.2f}, raw {row['raw_forwards_s']:.2f}/{row['raw_step_other_s']:.2f}/"
                     f"{row['raw_idle_s']:.2f}; new slab storage s: runner {row['runner_slab_fresh_s']:.2f}, raw "
                     f"{row['raw_slab_fresh_s']:.2f})")
    if "lockstep_eps" in row:
        parts.append(f"lockstep {row['lockstep_eps']:.2f} ep/s (lockstep/runner {row['lockstep_over_runner']:.2f}, "
                     f"breaks {row['lockstep_breaks']})")
    if "waves_over_raw" in row:
        parts.append(f"tok/s raw {row['raw_tok_s']:.1f}, waves {row['waves_tok_s']:.1f} (waves/raw "
                     f"{row['waves_over_raw']:.2f}; same ids {row['same_ids_waves']})")
    for key, label in AGAINST_RAW:
        if key in row:
            parts.append(f"{label} {row[key]:.2f} (CPU {row[key + '_cpu']:.2f}, same ids {row['same_ids_' + key]})")
    if "runner_over_threads" in row:
        mine, other = row["threads"]
        parts.append(f"{mine} vs {other} engine threads: runner {row['runner_over_threads']:.2f}, raw "
                     f"{row['raw_over_threads']:.2f} (CPU {row['raw_over_threads_cpu']:.2f}, same ids "
                     f"{row['same_ids_raw_over_threads']})")
    if "switch_over_runner" in row:
        parts.append(f"runner at GIL switch interval {row['switch_interval'] * 1e3:g} ms / default: "
                     f"{row['switch_over_runner']:.2f}")
    if "runner_over_cold" in row:
        parts.append(f"runner with a spare fork server / cold: {row['runner_over_cold']:.2f} "
                     f"(cold {row['cold_eps']:.2f} ep/s)")
    return "; ".join(parts)


T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
        15: 2.13, 20: 2.09, 30: 2.04}


def ratio_interval(ratios: list[float]) -> tuple[float, float, float] | None:
    """Geometric mean of per-repeat ratios and its 95% t-interval (on the logs); None under 2 repeats.
    Ratios are per repeat because each repeat measures its variants side by side."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    df = len(logs) - 1
    t = T975[max(k for k in T975 if k <= df)]
    m, half = statistics.fmean(logs), t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


RATIOS = ("runner_over_raw", "waves_over_raw", "lockstep_over_runner", "packed_over_unpacked",
          "packed_over_unpacked_cpu", "kept_over_fresh_slab", "runner_over_threads", "raw_over_threads",
          "switch_over_runner", "runner_over_cold")


def summarize(rows, limits) -> dict:
    out: dict = {"runner_eps": statistics.fmean(r["runner_eps"] for r in rows)}
    for key in RATIOS:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = statistics.fmean(values)
            out[key + "_ci95"] = ratio_interval(values)
    st = rows[-1].get("raw_engine") or rows[-1]["runner_engine"]
    live = st["decode_tokens"] / max(st["decode_steps"], 1)
    out.update({
        "prefill_computed_over_requested": st["prefill_tokens_computed"] / max(st["prefill_tokens_requested"], 1),
        "prefill_tok_s": st["prefill_tokens_computed"] / max(st["prefill_seconds"], 1e-9),
        "prefill_limit_tok_s": limits["prefill_limit_tok_s"],
        "decode_tok_s": st["decode_tokens"] / max(st["decode_seconds"], 1e-9), "mean_live_rows": live,
        "decode_limit_tok_s": limits["decode_limit"](live),
    })
    return out


def summary_line(r: dict) -> str:
    s = r["summary"]

    def ratio(key, label, unit="") -> str | None:
        if key not in s:
            return None
        ci = s.get(key + "_ci95")
        return f"{label} {s[key]:.2f}{unit}" + (f" (geo-mean {ci[0]:.2f}, 95% CI {ci[1]:.2f}-{ci[2]:.2f})" if ci else "")

    parts = [ratio("runner_over_raw", "runner/raw"), ratio("lockstep_over_runner", "lockstep/runner"),
             ratio("packed_over_unpacked", "packed/unpacked GEMMs"), ratio("kept_over_fresh_slab", "kept/fresh slab"),
             ratio("waves_over_raw", "engine tok/s in waves / chained", "x"),
             ratio("runner_over_threads", "runner, default vs other engine threads", "x"),
             ratio("raw_over_threads", "raw, default vs other engine threads", "x"),
             ratio("switch_over_runner", "runner, short GIL switch interval vs default", "x"),
             ratio("runner_over_cold", "runner, spare vs cold fork server", "x")]
    parts += [f"prefill computed/requested {s['prefill_computed_over_requested']:.2f}",
              f"prefill {s['prefill_tok_s']:.0f} tok/s (limit {s['prefill_limit_tok_s']:.0f})",
              f"decode {s['decode_tok_s']:.0f} tok/s at {s['mean_live_rows']:.1f} rows (limit {s['decode_limit_tok_s']:.0f})",
              f"KV peak {r['kv']['slab_peak_mib']:.0f} MiB slab ({r['kv']['slab_storage_peak_mib']:.0f} MiB kept "
              f"storage), {r['kv']['prefix_cache_peak_mib']:.0f} MiB prefix cache"]
    return f"{r['workload']:9s} " + " | ".join(p for p in parts if p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="samples per problem")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--other-threads", type=int, default=usable_cores(),
                    help="the `threads` variant's engine threads (default: every usable core)")
    ap.add_argument("--no-prime", dest="prime", action="store_false",
                    help="skip the warm-up's run of each repeat's calls (then a variant that first needs a "
                         "larger KV slab pays its new storage, a one-off cost, and its ratios lean)")
    ap.add_argument("--switch-interval", type=float, default=0.0002,
                    help="the `switch` variant's GIL switch interval in seconds (Python's default: 0.005)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every workload, e.g. model.dtype=float32 (repeatable)")
    ap.add_argument("--variants", default="all",
                    help=f"comma-separated subset of {', '.join(VARIANTS)} (with what each is compared with), "
                         "e.g. runner,raw for more repeats of runner/raw in the same time")
    args = ap.parse_args()
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    print(f"torch threads {torch.get_num_threads()} (main thread; the engine's own: model.cpu_threads), usable "
          f"cores {usable_cores()}, load {os.getloadavg()[0]:.1f}")
    main_threads = torch.get_num_threads()
    torch.set_num_threads(engine_cpu_threads(None))  # the limits of the engine's cores, not the process's
    limits = machine_limits()
    torch.set_num_threads(main_threads)
    print(f"machine: {limits['summary']}", flush=True)
    results = [run_workload(n, args, limits) for n in names]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS {peak:.0f} MiB (the engine and the runner), load now {os.getloadavg()[0]:.1f}")
    for r in results:
        print(summary_line(r))
    if args.json:
        for r in results:
            r["summary"] = {k: v for k, v in r["summary"].items() if not callable(v)}
        Path(args.json).write_text(json.dumps({"limits": {k: v for k, v in limits.items() if not callable(v)},
                                               "peak_rss_mib": peak, "results": results}, indent=1))


if __name__ == "__main__":
    main()
