#!/usr/bin/env python3
"""Resident memory of a real run, with and without giving freed heap pages back (whale/sysmem.py).

Two `whale run`s of the same weight-only config start side by side (same seeds, `runner.lockstep:
all`, so both draw the same tokens, accept the same rollouts and train on the same rows: the same
work), one as shipped and one with `release_free_memory` replaced by a no-op before any whale
module is imported. The parent samples each process's VmRSS every 0.5 s and prints, per weight
step, the resident memory of both and the ratio, then peak, end and wall time:

    python benchmarks/run_memory.py                       # 12 weight steps of the search QA comparison
    python benchmarks/run_memory.py --steps 24 --out /tmp/mem

Both runs share the machine, so wall times are comparable with each other, not with a quiet run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from whale.config import load_config  # noqa: E402

NO_TRIM = ("import sys, whale.sysmem as m; m.release_free_memory = lambda: False; "
           "from whale.cli import app; sys.argv[0] = 'whale'; app()")
SHIPPED = "import sys; from whale.cli import app; sys.argv[0] = 'whale'; app()"


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"event": "weight_step"' in line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/searchqa_compare.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="/tmp/whale-run-memory")
    args = ap.parse_args()
    out = Path(args.out)
    sets = ["schedule.kind=weight_only", "runner.lockstep=all", "eval.splits=[val]", "eval.every_steps=1000",
            "domain.splits.val=8", "domain.splits.test=8"]
    cfg = load_config(ROOT / args.config, sets)
    sets.append(f"schedule.budget_rollouts={args.steps * cfg.weight.problems_per_step * cfg.weight.samples_per_problem}")
    out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, code in (("shipped", SHIPPED), ("no_trim", NO_TRIM)):
        run_out = out / name
        shutil.rmtree(run_out, ignore_errors=True)
        cmd = [sys.executable, "-c", code, "run", args.config, "--out", str(run_out), *[a for s in sets for a in ("--set", s)]]
        with open(out / f"{name}.err", "w") as err:
            procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err), run_out)
    t0 = time.time()
    peak = {n: 0 for n in procs}
    by_step: dict[str, dict[int, int]] = {n: {} for n in procs}
    ends: dict[str, float] = {}
    while len(ends) < len(procs):
        for name, (proc, run_out) in procs.items():
            if name in ends:
                continue
            if proc.poll() is not None:
                ends[name] = time.time() - t0
                continue
            r, done = rss_kb(proc.pid), steps_done(run_out)
            peak[name] = max(peak[name], r)
            by_step[name][done] = max(by_step[name].get(done, 0), r)
        time.sleep(0.5)
    for name, (proc, _) in procs.items():
        if proc.returncode != 0:
            raise SystemExit(f"{name} run failed ({proc.returncode}); see {out / (name + '.err')}")
    print("| weight steps done | shipped RSS GB (max) | no trim RSS GB (max) | shipped / no trim |")
    print("|---|---|---|---|")
    for s in sorted(set(by_step["shipped"]) & set(by_step["no_trim"])):
        a, b = by_step["shipped"][s] / 1e6, by_step["no_trim"][s] / 1e6
        print(f"| {s} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    summary = {"peak_gb": {n: round(peak[n] / 1e6, 3) for n in procs}, "wall_s": {n: round(ends[n], 1) for n in procs},
               "peak_ratio": round(peak["shipped"] / max(1, peak["no_trim"]), 3),
               "wall_ratio": round(ends["shipped"] / ends["no_trim"], 3)}
    accepted = {}
    for n, (_, run_out) in procs.items():
        rows = [json.loads(x) for x in (run_out / "metrics.jsonl").read_text().splitlines()]
        accepted[n] = [r.get("accepted") for r in rows if r.get("event") == "weight_step"]
    summary["same_work"] = accepted["shipped"] == accepted["no_trim"]
    summary["accepted_per_step"] = accepted["shipped"]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
