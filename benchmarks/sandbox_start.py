"""Starting a sandboxed process from a process as large as the engine's, side by side in one process.

before: subprocess.Popen with `preexec_fn` joining the cgroup (what whale did until 2026-12-06):
        Python must fork() the whole parent, page tables included
now:    Popen of `Cgroup.command(argv)` (/bin/sh joins the cgroup, then execs): Python vforks
Each starts the sandbox worker's one-shot mode on `print(1)` (what math's `env.python` runs) while
the process holds `--hold-gib` GiB of touched memory (the engine's process holds 3.5-5 GiB on the
workloads) and a second thread allocates and touches 4 MiB tensors, as the engine thread does;
prints the Popen call's time, the run's time, and the longest allocation that thread waited.

    python benchmarks/sandbox_start.py --hold-gib 4 --repeat 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time

import torch

from whale.config import SandboxConfig
from whale.rollout.sandbox import Cgroup, _limits, resolve_mode, worker_command


def start(before: bool, mode: str) -> tuple[float, float]:
    """(seconds in Popen, seconds until the snippet's output) for one sandboxed `print(1)`."""
    cfg = SandboxConfig(mode=mode, memory_mb=256, max_processes=8, cpu_seconds=5)
    argv, env, cwd = worker_command(mode, cfg, ["--snippet", json.dumps(_limits(cfg)), "none"])
    cgroup = Cgroup.create(256 * 1024 * 1024, 16)
    t0 = time.perf_counter()
    if cgroup is not None and before:
        def join() -> None:
            for d in cgroup.dirs:
                (d / "cgroup.procs").write_text(str(os.getpid()))
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                start_new_session=True, preexec_fn=join)
    else:
        proc = subprocess.Popen(cgroup.command(argv) if cgroup else argv, env=env, cwd=cwd, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, start_new_session=True)
    t1 = time.perf_counter()
    out, _ = proc.communicate(b"print(1)\n", timeout=30)
    t2 = time.perf_counter()
    if cgroup is not None:
        cgroup.remove()
    assert out.strip() == b"1", out
    return t1 - t0, t2 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hold-gib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    held = torch.ones(int(args.hold_gib * 2**28))  # float32: 4 bytes each, touched
    mode = resolve_mode("auto")
    waits = {"before": [], "now": []}
    current = {"name": "now"}
    stop = threading.Event()

    def allocator() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            torch.ones(2**20)
            waits[current["name"]].append(time.perf_counter() - t)
            time.sleep(0.001)

    thread = threading.Thread(target=allocator, daemon=True)
    thread.start()
    rows = {"before": [], "now": []}
    start(False, mode)  # warm: imports, which(1)
    for _ in range(args.repeat):
        for name in ("before", "now"):
            current["name"] = name
            rows[name].append(start(name == "before", mode))
    stop.set()
    thread.join()
    print(f"held {held.numel() * 4 / 2**30:.1f} GiB, sandbox mode {mode}, cgroups "
          f"{'writable' if Cgroup.create(1 << 20, 4) is not None else 'not writable (both start the same way)'}")
    for name, label in (("before", "preexec_fn (fork)"), ("now", "Cgroup.command (vfork)")):
        popen = statistics.median(r[0] for r in rows[name]) * 1e3
        total = statistics.median(r[1] for r in rows[name]) * 1e3
        print(f"{label:24s} Popen {popen:7.2f} ms, output after {total:6.1f} ms (medians), "
              f"longest 4 MiB allocation beside it {max(waits[name]) * 1e3:5.1f} ms")
    ratio = statistics.median(r[1] for r in rows["before"]) / statistics.median(r[1] for r in rows["now"])
    print(f"before/now, time to output: {ratio:.2f}x")


if __name__ == "__main__":
    main()
