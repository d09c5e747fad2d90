#!/usr/bin/env python3
"""The method comparison: every method x seed on one config and one budget, then `whale compare`.

    python scripts/compare.py                                  # all methods, seeds 0-4, in the foreground
    python scripts/compare.py --detach                         # the same, detached; log in OUT/compare.log
    python scripts/compare.py --status                         # which runs are done / partial / not started
    python scripts/compare.py --compare-only                   # compare what is finished; run nothing
    python scripts/compare.py --methods whale weight_only --seeds 0 1 --set schedule.budget_rollouts=128
    python scripts/compare.py --config configs/math_compare.yaml --out runs/cmp_math

Each (method, seed) is one `whale run` in OUT/<method>-s<seed>, run one after another (a 2-core
machine runs one well). A finished run is skipped; a run that was killed (its state.json exists
but is not done) continues with `whale run --resume`, so rerunning the same command after a kill,
a reboot or a crash picks up where it stopped and loses at most the unit of work in flight. Seeds
are the outer loop, so the first seeds have every method early (paired comparisons need the same
seed for both methods). After the runs, `whale compare` writes OUT/compare/compare.md: the table
with paired bootstrap intervals against weight-only, harness-only and stagewise, what each side
bought per phase, and the rollouts each method needed to reach weight-only's best.

Records outlive the machine. With `--report DEST`, every finished run's record (config.yaml,
state.json, metrics.jsonl, ledger.jsonl, environment.json: a few tens of kB, everything `whale
compare` reads) is copied to DEST/runs/<method>-s<seed>/ for committing as soon as the run ends.
A later rerun of the same command, on this machine or another, counts a run with a finished record
made with the same config as done (it is not redone) and compares it with the runs it has locally,
so a comparison spread over many machines and days pools all its seeds; a record of another config
is another experiment and is redone, and so, with `--code-since COMMIT`, is a record made by code older
than COMMIT (a fix that changes a method's decisions leaves its config as it was).

The methods differ only in the keys below (schedule.kind and what that kind needs); everything
else, including the rollout budget, comes from the config. Stagewise spends half the budget on a
weight stage, then the rest on one harness stage; harness-only repeats phases of I iterations so
its curve has points (accept + val evaluation after each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from whale.config import ConfigError, load_config  # noqa: E402

METHODS = {
    "whale": [],
    "whale_adaptive": ["schedule.adaptive=true"],
    "gain": ["schedule.kind=gain"],
    "weight_only": ["schedule.kind=weight_only"],
    "harness_only": ["schedule.kind=harness_only", "schedule.repeat_harness_phases=true"],
    "prompt_only": ["schedule.kind=prompt_only"],
    "stagewise": ["schedule.kind=stagewise"],  # + budget_steps and harness_iterations, from the config
}
REFERENCES = ["weight_only", "harness_only", "stagewise"]


def method_overrides(method: str, config: str, extra: list[str]) -> list[str]:
    sets = list(METHODS[method])
    if method == "stagewise":
        cfg = load_config(config, extra)
        if cfg.schedule.budget_rollouts is None:
            raise SystemExit("stagewise needs schedule.budget_rollouts in the config (half goes to the weight stage)")
        step = cfg.weight.problems_per_step * cfg.weight.samples_per_problem
        sets += [f"schedule.budget_steps={max(1, cfg.schedule.budget_rollouts // 2 // step)}",
                 "schedule.harness_iterations=1000"]  # the harness stage runs until the budget ends
    return sets


RECORD_FILES = ("config.yaml", "state.json", "metrics.jsonl", "ledger.jsonl", "environment.json")


def planned_sets(name: str, args) -> list[str]:
    """The overrides this script runs `name` (<method>-s<seed>) with: the method's, --set, seed, name."""
    method, seed = name.rsplit("-s", 1)
    return method_overrides(method, args.config, args.set) + list(args.set) + [f"seed={seed}", f"name={name}"]


def planned_config(name: str, args):
    """The config this script would run `name` with now."""
    return load_config(args.config, planned_sets(name, args))


def record_of(name: str, args, quiet: bool = True) -> Path | None:
    """The committed record of a finished run `name` under --report, if there is one made with the
    config this script would use now (a record of another config is another experiment)."""
    if not args.report:
        return None
    rec = Path(args.report) / "runs" / name
    if run_state(rec) != "done" or not (rec / "metrics.jsonl").exists():
        return None
    try:
        same = load_config(str(rec / "config.yaml"), []).model_dump() == planned_config(name, args).model_dump()
    except ConfigError:
        same = False
    if not same and not quiet:
        print(f"[redo] {name}: its record ({rec}) was made with another config", flush=True)
    if same and getattr(args, "code_since", None) and not made_since(rec, args.code_since):
        same = False
        if not quiet:
            print(f"[redo] {name}: its record ({rec}) was made before {args.code_since}", flush=True)
    return rec if same else None


def made_since(rec: Path, commit: str) -> bool:
    """Was the record made by code that contains `commit` (environment.json's whale_commit has it
    as an ancestor)? Why: a config says what was run, not with which code; a fix to a schedule
    (2026-12-02: rule 1b of kind gain) leaves the config equal while its old runs no longer count.
    A tree with uncommitted changes ("<commit>+dirty") counts as its commit: copying records into
    the checkout (--report) is itself such a change, so every run after the first would otherwise
    be redone."""
    try:
        made = json.loads((rec / "environment.json").read_text()).get("whale_commit")
    except (OSError, json.JSONDecodeError):
        return False
    if not made:
        return False
    made = made.removesuffix("+dirty")
    return subprocess.run(["git", "merge-base", "--is-ancestor", commit, made], cwd=ROOT,
                          capture_output=True).returncode == 0


def keep_records(args) -> list[str]:
    """Copy the record of every finished local run into --report/runs/ (see the module doc)."""
    kept = []
    for run_dir in sorted(Path(args.out).glob("*-s*")):
        if run_state(run_dir) != "done" or not args.report:
            continue
        dest = Path(args.report) / "runs" / run_dir.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in RECORD_FILES:
            if (run_dir / name).exists():
                shutil.copy2(run_dir / name, dest / name)
        kept.append(run_dir.name)
    return kept


def run_state(run_dir: Path) -> str:
    state = run_dir / "state.json"
    if not state.exists():
        return "not started"
    try:
        # `finished`, not phase "done": the run's last evaluation runs after its phase turns "done"
        return "done" if json.loads(state.read_text()).get("finished") else "partial"
    except json.JSONDecodeError:
        return "partial"


def status_line(name: str, args) -> str:
    local = run_state(Path(args.out) / name)
    return "done (record)" if local != "done" and record_of(name, args) is not None else local


def run_one(method: str, seed: int, args) -> bool:
    run_dir = Path(args.out) / f"{method}-s{seed}"
    status = run_state(run_dir)
    if status == "done":
        print(f"[skip] {run_dir}: done", flush=True)
        return True
    record = record_of(run_dir.name, args, quiet=False)
    if record is not None:
        print(f"[skip] {run_dir.name}: done earlier (record in {record})", flush=True)
        return True
    whale = [sys.executable, "-m", "whale.cli", "run"]
    if status == "partial":
        cmd = whale + ["--resume", str(run_dir)]
    else:
        if run_dir.exists():  # created but killed before its state was written: start it again
            shutil.rmtree(run_dir)
        sets = planned_sets(run_dir.name, args)
        cmd = whale + [args.config, "--out", str(run_dir)] + [x for s in sets for x in ("--set", s)]
    print(f"[{time.strftime('%H:%M:%S')}] {'resume' if status == 'partial' else 'start'} {run_dir}", flush=True)
    started = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT)
    print(f"[{time.strftime('%H:%M:%S')}] {'ok' if rc == 0 else f'FAILED (exit {rc})'} {run_dir} "
          f"({time.monotonic() - started:.0f} s)", flush=True)
    if rc == 0:
        keep_records(args)  # now, not after the last run: the machine can go away before that
    return rc == 0


def compare(args) -> Path | None:
    from whale.compare import compare_runs

    keep_records(args)
    dirs = []
    for name in (f"{m}-s{s}" for s in args.seeds for m in args.methods):
        local = Path(args.out) / name
        record = None if run_state(local) == "done" else record_of(name, args)
        if run_state(local) == "done" or ((local / "metrics.jsonl").exists() and record is None):
            dirs.append(local)  # finished here, or partial with no finished record: compare what there is
        elif record is not None:
            dirs.append(record)
    if not dirs:
        return None
    present = {m for m in args.methods if any(d.name.startswith(f"{m}-s") for d in dirs)}
    path = compare_runs(dirs, Path(args.out) / "compare", references=[m for m in REFERENCES if m in present] or None,
                        partial=True)  # a partial run is compared as it stands, marked (unfinished)
    if args.report:
        dest = Path(args.report)
        dest.mkdir(parents=True, exist_ok=True)
        for f in path.parent.iterdir():
            shutil.copy2(f, dest / f.name)
    return path


def detach(argv: list[str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pid_file = out / "compare.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 0)
            raise SystemExit(f"a comparison is already running in {out} (pid {pid_file.read_text().strip()})")
        except (ProcessLookupError, ValueError):
            pass
    log = open(out / "compare.log", "a")
    proc = subprocess.Popen([sys.executable, __file__, *[a for a in argv if a != "--detach"]], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    pid_file.write_text(str(proc.pid))
    print(f"detached: pid {proc.pid}\n  follow: tail -f {out}/compare.log\n  stop:   kill -- -{proc.pid}"
          f"   (rerun the same command to continue)")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/searchqa_compare.yaml")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--out", default="runs/cmp_full")
    ap.add_argument("--set", action="append", default=[], help="override for every run: a.b=c (repeatable)")
    ap.add_argument("--report", default=None, help="also copy compare.md, its plots and the finished runs' records "
                    "here (e.g. docs/results/cmp_h64); "
                    "runs recorded there count as done")
    ap.add_argument("--code-since", default=None, metavar="COMMIT",
                    help="count a record as done only if made by code that contains COMMIT (after a fix that "
                         "changes what a method does, older records are redone)")
    ap.add_argument("--detach", action="store_true", help="run in the background, detached from this shell")
    ap.add_argument("--status", action="store_true", help="print each run's state and exit")
    ap.add_argument("--compare-only", action="store_true",
                    help="run nothing: write the comparison of the finished runs and records (e.g. after "
                         "runs on several machines) and exit")
    args = ap.parse_args(argv)
    out = Path(args.out)
    load_config(args.config, args.set)  # a bad config or override fails here, not in the first run
    if args.code_since and subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.code_since}^{{commit}}"],
                                          cwd=ROOT, capture_output=True).returncode != 0:
        raise SystemExit(f"--code-since {args.code_since}: not a commit of this repository (every record would be redone)")
    if args.status:
        for seed in args.seeds:
            print("  ".join(f"{m}-s{seed}: {status_line(f'{m}-s{seed}', args)}" for m in args.methods))
        return
    if args.compare_only:
        path = compare(args)
        print(f"compare: {path}" if path else "no finished runs to compare")
        return
    if args.detach:
        detach(argv, out)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    failed = [f"{m}-s{s}" for s in args.seeds for m in args.methods if not run_one(m, s, args)]
    path = compare(args)
    print(f"compare: {path}" if path else "no finished runs to compare")
    if failed:
        print(f"failed (rerun to resume): {' '.join(failed)}")
        sys.exit(1)
    (out / "compare.pid").unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1:])
