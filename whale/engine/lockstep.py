"""Lockstep scheduling: batches that are a function of the request stream, not of timing.

Why. Continuous batching puts a sequence beside whatever else is in flight, and low-precision
kernels round differently with batch shape and row position (bf16 on this CPU: a GEMM of 24 rows
gives a few rows other bits than the same rows computed alone; see docs/design.md). Which
sequences share a step depends on when each episode's harness process got round to its next call,
so two evaluations of the same (harness, weights, seed) drew different samples: `whale eval --run`
could not reproduce a run's number in bf16, and a resumed run could not equal an unkilled one.

How. The rollout runner opens a lockstep with one client per episode slot. A client is *running*
(its harness code, a tool, a sandbox spawn or the hand-over to the next episode) or *blocked* (it
has a call in the engine). The engine counts its steps. A client's next call is *due* at the step
after the one that resolved its previous call (its first call: the lockstep's first step): it is
admitted at that step, and the engine does not take that step until the call is there (or the
client has left, or `hold_s` has passed: a counted break). So the step at which a call joins is a
function of the episodes alone. Calls due at the same step are admitted in the order of their
`order` key (the episode's index in the batch), not their arrival. A client becomes blocked in the
critical section that enqueues its call, and running again in the engine thread before that call's
future resolves, so no step can slip between the two. Opening a lockstep clears the prefix cache
(a cached prefix computed in another batch would carry that batch's rounding), and the KV slab is
kept whole until the batch ends (a clear mid-batch would depend on timing). Then the sequence of forwards, their shapes and
every row's place in them follow from the episodes alone, and so do the sampled tokens: on the
same machine, software and thread count a re-evaluation is bit-for-bit the original.

Assumptions, stated: a harness makes one model call at a time (the sandbox RPC is synchronous);
requests submitted outside the lockstep meanwhile are admitted as usual (determinism is then not
promised). A client that stays running for long (a slow tool) holds the engine for that long; the
cost on the shipped harnesses is measured in docs/performance.md.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Callable, Protocol

from whale.engine.base import GenerationRequest, SamplingParams, error_generations
from whale.engine.jobs import Job

# Steps from a call's resolution to its successor's admission. 1: the very next step. More would let
# the engine decode on during a harness's turn-around, but then slots carry different due steps and
# which slot takes the batch's next episode (a race) would decide when that episode's first call
# joins: measured, 2 changed 1-9 of 48 tiny-model episodes between identical runs. Deterministic job
# hand-out to slots would be needed first.
SLACK = 1
HOLD_S = 1.0  # the longest the engine waits for one due call before it goes on without it


class Clock(Protocol):
    """What a lockstep needs of the engine's scheduler (engine/scheduler.py): its lock, its step
    count, a way to wait until nothing is in flight, the queue, and the list of open gates it
    consults at every step (`open_gate`, `close_gate`; called under `cond`)."""

    cond: threading.Condition
    step_no: int

    def paused(self) -> AbstractContextManager[None]: ...

    def enqueue(self, jobs: list[Job], blocked: tuple["Lockstep", int] | None = None) -> None: ...

    def open_gate(self, gate: "Lockstep") -> None: ...

    def close_gate(self, gate: "Lockstep") -> None: ...


class Lockstep:
    """One rollout batch's clients on the hf engine (`HFEngine.lockstep`); see the module docstring.
    `make_job` validates a request into a scheduler job (`HFEngine.make_job`)."""

    def __init__(self, clock: Clock, make_job: Callable[[GenerationRequest, SamplingParams, Future], Job],
                 clients: int, hold_s: float = HOLD_S):
        self.clock = clock
        self.make_job = make_job
        self.hold_s = hold_s
        self.breaks = 0  # clients the engine stopped waiting for: the batch is then not reproducible
        self.cond: threading.Condition = clock.cond
        self.running: set[int] = set(range(clients))
        self.closed = False
        with clock.paused():  # wait for anything in flight; the prefix cache is cleared on exit
            pass
        with self.cond:
            start = clock.step_no
            self.due = {c: start for c in range(clients)}  # the step each client's next call is due at
            clock.open_gate(self)

    def holds(self, step: int) -> bool:
        """True while a running client's next call is due at or before `step` (it is not here yet)."""
        return not self.closed and any(self.due[c] <= step for c in self.running)

    def let_go(self, step: int) -> None:
        """The engine waited `hold_s` for the clients due at `step`: stop waiting for them (their
        calls join when they come). Counted in `breaks`: this batch is no longer bit-reproducible."""
        for c in self.running:
            if self.due[c] <= step:
                self.due[c] = 1 << 62  # never due: admitted on arrival (see submit)
                self.breaks += 1

    def next_due(self) -> int | None:
        """The earliest step a running client's next call can be due at (None: none running)."""
        return min((self.due[c] for c in self.running), default=None) if not self.closed else None

    def submit(self, client: int, order: int, request: GenerationRequest,
               sampling: SamplingParams) -> Future:
        """`Engine.submit` for `client`, admitted in `order` among the calls of the same step."""
        future: Future = Future()
        try:
            job = self.make_job(request, sampling, future)
        except Exception as exc:  # noqa: BLE001 - a bad request is answered at once; the client runs on
            future.set_result(error_generations(f"error: {exc}"))
            return future
        job.order, job.gate, job.client = order, self, client
        with self.cond:  # the due step is read and the call queued in one critical section
            job.due = self.due[client] if self.due[client] < 1 << 62 else None
            self.clock.enqueue([job], blocked=(self, client))
        return future

    def block(self, client: int) -> None:
        """Called by the scheduler under its lock, in the critical section that enqueues the call."""
        self.running.discard(client)

    def wake(self, client: int) -> None:
        """The client's call resolved (engine thread, before its future is set): it runs again."""
        with self.cond:
            if not self.closed:
                self.running.add(client)
                self.due[client] = self.clock.step_no + SLACK

    def leave(self, client: int) -> None:
        """The client has no more episodes to play."""
        with self.cond:
            self.running.discard(client)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.running.clear()
            self.clock.close_gate(self)
            self.cond.notify_all()


# ---------------------------------------------------------------- the scheduler's clock rules

def is_due(job: Job, step: int) -> bool:
    """May `job` be admitted at `step`? (Always outside a lockstep, or once its lockstep closed.)"""
    return job.due is None or job.due <= step or job.gate.closed


def next_busy_step(step: int, waiting: list[Job], gates: list[Lockstep]) -> int:
    """The next step at which something can happen, when nothing can at `step`: the earliest due
    step of a waiting call or of a running client's next call (they come from the episodes alone,
    so jumping there is as deterministic as stepping through the empty steps)."""
    later = [job.due for job in waiting] + [gate.next_due() for gate in gates]
    later = [t for t in later if t is not None and t > step]
    return min(later, default=step)


def hold_left(gates: list[Lockstep], step: int, held_since: float) -> float:
    """Seconds the engine may still wait at `step` for due calls; at 0, the late clients are let go."""
    left = max(0.0, min(g.hold_s for g in gates) - (time.monotonic() - held_since))
    if left == 0.0:
        for gate in gates:  # a slow tool or a hung harness: go on without it (counted as a break)
            if gate.holds(step):
                gate.let_go(step)
    return left
