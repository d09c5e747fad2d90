#!/usr/bin/env python3
"""Wall time, CPU share and peak memory of a whole `whale` command, side by side with another commit.

What a user feels of a run is its wall time, how much of the machine it keeps busy and how much
memory it needs; all three belong to the whole process tree (the engine, the grading processes,
the sandboxes, the fork server). Each repeat runs the command once per variant, in alternating
order, on the same config and seed:

    python benchmarks/footprint.py --repeat 3 --before c898924            # `whale demo`, now vs c898924
    python benchmarks/footprint.py --repeat 2 --before HEAD~1 -- run configs/searchqa_compare.yaml \\
        --set schedule.kind=weight_only --set schedule.budget_rollouts=512   # a longer weight-only run

`--before COMMIT` checks the commit out into a worktree under the temp dir and runs it with the
same installed packages (PYTHONPATH), so only WHALE's code differs. Per run it records the wall
time, the CPU share (user + system seconds of the tree, from the kernel's accounting of the
waited-for children, over wall), the peak of the tree's proportional set size (PSS: a page shared by
a forked sandbox and its parent counts once, split between them) and of its summed RSS (which
counts shared pages in every process), sampled every second, and the run's first and last test
mean@k. Ratios are per repeat (the variants ran side by side), summarised as a geometric mean with
a 95% t-interval. Results go to OUT/footprint.json and a table on standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from workloads import ratio_interval  # noqa: E402

CLI = "import sys; from whale.cli import app; sys.argv[0] = 'whale'; app()"


# tree() and memory_kb() are whale.sysmem's descendants() and process_memory() again, on purpose:
# this script must not import whale, since an editable install of another tree (a `--before`
# worktree's, or the user's) would be imported in its place by the meta-path finder.


def tree(pid: int) -> list[int]:
    """`pid` and every live descendant, from the kernel's per-thread child lists (cheap: no scan of
    /proc, so sampling costs the measured run little)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.scandir(f"/proc/{p}/task"):
                todo.extend(int(c) for c in Path(task.path, "children").read_text().split())
        except OSError:
            continue
    return out


def memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in kB; zeros once it is gone."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


def process_name(pid: int) -> str:
    """What a process of the tree is: a grader (a spawned multiprocessing child), the sandbox (fork
    server and episodes), else its command name."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    if "multiprocessing" in cmd:
        return "grader"
    if "sandbox_worker" in cmd or comm == "bwrap":
        return "sandbox"
    return comm


def test_scores(run_dir: Path) -> tuple[float | None, float | None]:
    """The run's first and last test mean@k, from its metrics rows; an evaluation's (`whale eval
    --out`) mean@k twice, from its summary."""
    summary = run_dir / "summary.json"
    if summary.exists() and not (run_dir / "metrics.jsonl").exists():
        score = json.loads(summary.read_text()).get("mean_at_k")
        return score, score
    scores = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("split") == "test" and "mean_at_k" in row:
            scores.append(row["mean_at_k"])
    return (scores[0], scores[-1]) if scores else (None, None)


def measure(code_root: Path, args: list[str], run_dir: Path, interval: float = 1.0) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(code_root))
    argv = [sys.executable, "-c", CLI, *args, "--out", str(run_dir)]
    # the command's output goes to a file beside its run folder: a pipe nobody reads until the end
    # would stop the command once its progress lines filled the pipe's buffer
    log_path = run_dir.with_name(run_dir.name + ".log")
    log = log_path.open("w")
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=code_root, env=env, stdout=log, stderr=subprocess.STDOUT)
    peak_pss = peak_rss = 0
    at_peak: dict[str, int] = {}
    timeline = []
    while proc.poll() is None:
        pids = tree(proc.pid)
        sizes = [memory_kb(p) for p in pids]
        pss = sum(s[0] for s in sizes)
        timeline.append((round(time.perf_counter() - start, 1), pss // 1024))
        if pss > peak_pss:
            at_peak = {}
            for p, size in zip(pids, sizes):
                name = "main" if p == proc.pid else process_name(p)
                at_peak[name] = at_peak.get(name, 0) + size[0] // 1024
        peak_pss = max(peak_pss, pss)
        peak_rss = max(peak_rss, sum(s[1] for s in sizes))
        time.sleep(interval)
    wall = time.perf_counter() - start
    log.close()
    times = os.times()  # Popen reaped the child: its CPU and its reaped descendants' are in children_*
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed in {code_root} (exit {proc.returncode}): "
                         f"{log_path.read_text(errors='replace')[-2000:]}")
    first, last = test_scores(run_dir)
    return {"wall_s": wall, "children_cpu_s": times.children_user + times.children_system,
            "peak_pss_mib": peak_pss / 1024, "peak_rss_mib": peak_rss / 1024, "test_first": first, "test_last": last,
            "peak_pss_by_process_mib": at_peak, "pss_timeline_mib": timeline}


def checkout(commit: str) -> Path:
    where = Path(tempfile.gettempdir()) / f"whale-footprint-{commit.replace('/', '_')}"
    if not where.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), commit], check=True,
                       stdout=subprocess.DEVNULL)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", help="the commit to compare with (none: measure this tree alone)")
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "whale-footprint"))
    ap.add_argument("command", nargs="*", default=["demo"], help="the whale command (default: demo)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = {"now": ROOT}
    if args.before:
        variants["before"] = checkout(args.before)
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.repeat):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            cpu_before = sum(os.times()[2:4])
            row = measure(variants[name], args.command, out / f"{name}-r{r}")
            row["cpu_s"] = row.pop("children_cpu_s") - cpu_before
            row["cpu_share"] = row["cpu_s"] / row["wall_s"]
            results[name].append(row)
            print(f"repeat {r} {name}: wall {row['wall_s']:.0f} s, CPU {100 * row['cpu_share']:.0f}%, "
                  f"peak tree PSS {row['peak_pss_mib']:.0f} MiB (RSS {row['peak_rss_mib']:.0f}), "
                  f"test {row['test_first']} -> {row['test_last']}", flush=True)
    summary: dict[str, object] = {"command": args.command, "before": args.before, "runs": results,
                                  "cpus": os.cpu_count()}
    if args.before:
        for key in ("wall_s", "cpu_share", "peak_pss_mib", "peak_rss_mib"):
            ratios = [a[key] / b[key] for a, b in zip(results["now"], results["before"])]
            ci = ratio_interval(ratios)
            summary[f"{key}_now_over_before"] = {"ratios": ratios, "interval": ci}
            text = f"{ci[0]:.2f} [{ci[1]:.2f}, {ci[2]:.2f}]" if ci else ", ".join(f"{x:.2f}" for x in ratios)
            print(f"{key} now/before: {text}")
    (out / "footprint.json").write_text(json.dumps(summary, indent=1))
    print(f"written: {out / 'footprint.json'}")


if __name__ == "__main__":
    main()
