"""The engine settings benchmarks/workloads.py compares a raw replay under (its variants): each a
context manager that changes one thing inside and restores it after, so every variant of a repeat
runs on the same engine, side by side."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def fresh_slab(engine):
    """The hf engine's KV slab without kept storage: fresh memory for every batch (set aside, not
    freed, so the variants after this one find their kept buffers again)."""
    slab = engine.scheduler.slab
    saved = slab.keep_storage, slab.buffers, slab.scratch
    slab.keep_storage, slab.buffers, slab.scratch = False, [], None
    try:
        yield
    finally:
        slab.keep_storage, slab.buffers, slab.scratch = saved


@contextlib.contextmanager
def setting(owner, name: str, value):
    """`owner`'s attribute `name` set to `value` inside, restored after: an hf engine's (its thread
    reads it at every step and forward)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def cold_fork_server(runner):
    """The runner with every run launching its own fork server when it starts, as before
    whale/rollout/fork_server.py's spare: the spare is killed inside, and launched again after (the
    caller gives it time to start before the next run, as a run's caller usually does)."""
    spare = runner.spare_fork_server
    spare.close()
    runner.spare_fork_server = None
    try:
        yield
    finally:
        runner.spare_fork_server = spare
        spare.launch(runner.cfg.runner.sandbox, runner.cfg.runner.concurrency)


def unpacked(engine):
    """Every Linear on the plain GEMM, as before engine/packed.py."""
    return setting(engine, "packed_linears", None)


def on_threads(engine, threads: int):
    """The engine thread's forwards on `threads` intra-op threads (it sets its count at every step)."""
    return setting(engine, "cpu_threads", threads)


@contextlib.contextmanager
def switch_interval(seconds: float):
    """The interpreter's GIL switch interval at `seconds` inside (sys.setswitchinterval)."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
