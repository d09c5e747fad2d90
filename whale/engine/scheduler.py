"""The hf engine's scheduler: one thread owns the model and batches continuously.

Requests arrive as jobs from any thread (`enqueue`); each iteration of the thread
1. admits waiting sequences into free rows of the KV slab (at most `max_batch_size` decode rows)
   and prefills them, sampling each one's first token;
2. scores every waiting `choices` request together, across episodes;
3. runs one decode step of every live row. A row that finishes leaves at once (the last row moves
   into its place) and its request's future resolves when its last sample is done.
So an episode's next call joins the running batch at the next step instead of waiting for a whole
static batch to drain.

Prefix sharing. A sequence's prompt is compared with every live row and every prefix-cache entry
(finished sequences: prompt + completion, so an episode's next call, which extends the previous
prompt and completion, finds them). The longest shared prefix, up to all but the last prompt token
(whose logits are needed), is copied instead of computed. When a sequence shares at least
`MIN_SHARED` tokens more with another one admitted in the same wave than with anything stored
(the k samples of one problem, `n > 1`), it waits one prefill round and copies from that row (not
for a few tokens: two questions that begin alike are computed together); a sequence left with
only its last prompt token to feed is a decode row already and joins the next decode step without
a forward of its own. Prefill forwards group sequences of similar length (a small DP over padding
plus a per-forward cost), so one long prompt does not pad thirty short ones. Any weight change
clears the prefix cache:
`paused()` (load_weights, serve_model) clears it, and a stamp of the parameters' version counters,
checked before each prefill, catches an in-place optimizer step nobody announced.

Choices (docs/design.md 4.1, sequence level). One row holds the prompt and then all of a request's choices
side by side: each choice token attends to the prompt and to its own earlier tokens only (a 4D
"tree" mask), with rotary positions counted from the end of the prompt, so log p(choice | prompt)
is exactly what a forward of prompt + choice alone gives, for all choices in one forward and for
many requests in the same forward. Requests with the same prompt and choices are scored once.

The forwards themselves (inputs over the slab, the model call, sampling, the stats) are
engine/forwards.py: this module decides what runs, that one runs it.

Decode attention (CPU): whale/engine/attention.py, torch's sdpa kernel called with grouped-query
heads over the columns the live rows use (a view of the slab, no copy).

Why samples stay exact: a sequence draws one uniform per step from its own generator seeded with
its request's seed (`seed + i` for sample i), consumed in step order whatever the batch; the token
is the inverse CDF of that uniform under its own logits. Its logits depend only on its own tokens
(the mask hides everything else), so neither batch-mates nor the step at which it joined change
what it samples, up to floating-point rounding of different batch shapes, as before.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch

from whale.engine.base import Generation, draw_choices
from whale.engine.forwards import Forwards, ModelHost
from whale.engine.jobs import (ChoiceRow, Job, Seq, choice_rows, fail_job, resolve_job,
                               shared_with_live, start_job, weights_stamp)
from whale.engine.kv import KVSlab, PrefixCache, common_prefix
from whale.engine.lockstep import Lockstep, hold_left, is_due, next_busy_step
from whale.engine.prefill import plan_chunks, prompt_cols, suffix_len, tree_len
from whale.sysmem import release_free_memory

MIN_SHARED = 16  # a prefix shorter than this is recomputed rather than waited for
PREFILL_TOKENS = 4096  # padded query tokens per prefill forward
FORWARD_TOKENS = 32  # a forward's fixed cost (weights read, Python) in tokens of compute, on a CPU
CHOICE_ROW_TOKENS = 1024  # choice tokens per row of a scoring forward (more choices: more rows)
CHOICE_LOGITS_BYTES = 1 << 28  # cap on the fp32 logits of one scoring forward (256 MiB)
IDLE_EXIT_S = 30.0  # the engine thread ends after this long without work; the next submit restarts it


def _slab_cols(tokens: int) -> int:
    """The slab columns `tokens` take: the slab grows in whole 64s (engine/kv.py)."""
    return -(-(tokens + 1) // 64) * 64


class SchedulerHost(ModelHost, Protocol):
    """What the scheduler needs of the engine that owns it (engine/hf.py's HFEngine), beyond its
    forwards' `ModelHost`: the batch's width, the vocabulary (a scoring forward's logits), the
    engine thread's OpenMP count, and how a finished sample or a drawn choice becomes the
    `Generation` its caller gets (the tokenizer is the engine's)."""

    max_batch_size: int
    kv_token_bytes: int  # the KV one token takes over all layers
    vocab_size: int
    cpu_threads: int | None

    def finish_generation(self, s: Seq) -> Generation: ...

    def choice_generation(self, job: Job, pick: int) -> Generation: ...


def _new_stats() -> dict[str, float]:
    return {"prefill_tokens_requested": 0, "prefill_tokens_computed": 0, "prefill_tokens_padded": 0,
            "choice_tokens": 0, "decode_tokens": 0, "decode_steps": 0, "prefill_forwards": 0,
            "prefill_seconds": 0.0, "decode_seconds": 0.0, "step_seconds": 0.0, "prefix_hits": 0, "cache_clears": 0,
            "max_live_rows": 0, "slab_peak_bytes": 0, "slab_storage_peak_bytes": 0, "prefix_peak_bytes": 0,
            "slab_fresh_bytes": 0, "slab_fresh_seconds": 0.0}


class Scheduler:
    """Continuous batching over `host.model`; see the module docstring."""

    def __init__(self, host: SchedulerHost, prefix_cache_bytes: int, kv_cache_bytes: int | None = None):
        self.host = host
        self.kv_cache_bytes = kv_cache_bytes  # None: rows are bounded by max_batch_size alone
        self.slab = KVSlab(host.model.config.get_text_config().num_hidden_layers, host.device,
                           max_bytes=kv_cache_bytes)
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.rows: list[Seq] = []  # live sequences; rows[i] is in slab row i
        self.waiting: list[Seq] = []
        self.waiting_choices: list[Job] = []
        self.cond = threading.Condition()
        self.busy = False
        self.pauses = 0
        self.stopping = False
        self.stamp: tuple[int, int] | None = None
        self.thread: threading.Thread | None = None
        self.gates: list[Lockstep] = []  # open locksteps (engine/lockstep.py)
        self.step_no = 0  # the engine's clock under a lockstep: one per step, jumps over idle steps
        self.stats = _new_stats()
        self.forwards = Forwards(host, self.slab, self.stats)  # runs the model; see engine/forwards.py

    # ------------------------------------------------------------------ other threads

    def enqueue(self, jobs: list[Job], blocked: tuple[Lockstep, int] | None = None) -> None:
        """Queue jobs; `blocked`: the lockstep client now waiting on them (in the same critical section)."""
        with self.cond:
            if blocked is not None:
                blocked[0].block(blocked[1])
            if self.stopping:
                for job in jobs:
                    fail_job(job, "error: the engine is closed")
                return
            for job in jobs:
                if job.kind == "sample":
                    job.results = [None] * len(job.seeds)
                    job.remaining = len(job.seeds)
                    self.waiting.extend(self._seqs(job))
                else:
                    self.waiting_choices.append(job)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="whale-hf-scheduler", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def _seqs(self, job: Job) -> list[Seq]:
        window = max((len(x) for x in job.stop), default=0) + 4
        prompt_np = np.asarray(job.prompt, dtype=np.int64)
        out = []
        for i, seed in enumerate(job.seeds):
            # one uniform per step from the sample's own generator: the stream depends only on
            # (seed, max_new), never on the batch
            gen = torch.Generator().manual_seed(seed % (1 << 63))
            uniforms = (1.0 - torch.rand(job.max_new, generator=gen)).tolist()  # in (0, 1]
            out.append(Seq(job, i, job.prompt, prompt_np, uniforms, window))
        return out

    def open_gate(self, gate: Lockstep) -> None:
        """A lockstep opens: its clients' calls are admitted by its clock from now on (under `cond`)."""
        with self.cond:
            self.gates.append(gate)

    def close_gate(self, gate: Lockstep) -> None:
        with self.cond:
            if gate in self.gates:
                self.gates.remove(gate)

    @contextmanager
    def paused(self):
        """Hold the scheduler idle (live sequences finish first, none start); clear the prefix cache."""
        if threading.current_thread() is self.thread:
            raise RuntimeError("weights cannot change from inside the engine thread (a future callback)")
        with self.cond:
            self.pauses += 1
            while self.busy:
                self.cond.wait()
        try:
            yield
        finally:
            with self.cond:
                self.pauses -= 1
                self._clear_prefix()
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=60)
        if self.thread is None:  # ended for idleness before: nobody frees the kept KV storage but us
            self.slab.release()

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        with torch.no_grad():
            # no_grad rather than inference_mode: the trainer fine-tunes this same model in place,
            # and inference tensors cached inside modules would break its backward pass.
            while True:
                with self.cond:
                    held_since: float | None = None
                    while not self.stopping and not (self._advance_clock() and not self._held()):
                        if self.busy and not self._has_work() and not self.gates:
                            # idle: free the KV memory (training may follow). Not inside a lockstep
                            # batch: whether a step finds the engine idle depends on timing, and the
                            # slab's width after a clear decides the decode attention's shapes
                            self.busy = False
                            self.slab.clear()
                            release_free_memory()  # the batch's freed tensors, back to the OS
                            self.cond.notify_all()
                        timeout = IDLE_EXIT_S
                        if self._has_work():  # held by a lockstep client whose call is due
                            held_since = held_since or time.monotonic()
                            timeout = hold_left(self.gates, self.step_no, held_since)
                            if timeout == 0.0:
                                continue  # it let the late clients go
                        if (not self.cond.wait(timeout) and not self._has_work() and not self.gates
                                and not self.stopping):
                            self.thread = None  # idle for long: end, so a dropped engine can be freed
                            return
                    if self.stopping:
                        break
                    self.busy = True
                    admitted, choice_jobs = self._admit()
                t0 = time.perf_counter()
                try:
                    self._step(admitted, choice_jobs)
                except Exception as exc:  # noqa: BLE001 - fail what was in flight; the engine goes on
                    self._fail_in_flight(f"error: engine failure: {type(exc).__name__}: {exc}", admitted,
                                         choice_jobs)
                self.stats["step_seconds"] += time.perf_counter() - t0  # forwards and their bookkeeping
                with self.cond:
                    self.step_no += 1
        with self.cond:
            for seq in self.waiting:
                fail_job(seq.job, "error: the engine is closed")
            for job in self.waiting_choices:
                fail_job(job, "error: the engine is closed")
            self.waiting, self.waiting_choices = [], []
            self.busy = False
            self.cond.notify_all()
        self._fail_in_flight("error: the engine is closed", [], [])
        self.slab.release()  # the kept storage too (engine/kv.py)

    def _due(self, job: Job) -> bool:
        return is_due(job, self.step_no)

    def _has_work(self) -> bool:
        """Something to compute at this step: live rows, or waiting calls that are due."""
        return bool(self.rows) or (not self.pauses and (any(self._due(s.job) for s in self.waiting)
                                                         or any(self._due(j) for j in self.waiting_choices)))

    def _held(self) -> bool:
        """A lockstep client is still running and its next call may be due at this step."""
        return any(gate.holds(self.step_no) for gate in self.gates)

    def _advance_clock(self) -> bool:
        """`_has_work()`, after jumping the clock over steps at which nothing can happen (lockstep)."""
        if not (self._has_work() or self.pauses or not self.gates or self._held()):
            self.step_no = next_busy_step(self.step_no, [s.job for s in self.waiting] + self.waiting_choices,
                                          self.gates)
        return self._has_work()

    def _admit(self) -> tuple[list[Seq], list[Job]]:
        """Waiting sequences for the free rows (FIFO) and all waiting choice jobs; drops cancelled ones."""
        if self.pauses:
            return [], []
        free = self.host.max_batch_size - len(self.rows)
        if self.gates:  # lockstep: the episodes' order, not their arrival (stable: samples stay in order)
            self.waiting.sort(key=lambda s: -1 if s.job.order is None else s.job.order)
            self.waiting_choices.sort(key=lambda j: -1 if j.order is None else j.order)
        admitted: list[Seq] = []
        later: list[Seq] = []
        # the KV bound: rows x their longest prompt + completion, in the slab's columns (whole 64s; the
        # slab keeps the width it grew to until it is cleared), stay within kv_cache_bytes (one row always runs)
        width = max([self.slab.cols] + [_slab_cols(len(s.prompt) + s.job.max_new) for s in self.rows])
        while self.waiting and free > 0:
            seq = self.waiting.pop(0)
            if not self._due(seq.job):
                later.append(seq)
                continue
            need = max(width, _slab_cols(len(seq.prompt) + seq.job.max_new))
            rows = len(self.rows) + len(admitted) + 1
            if (self.kv_cache_bytes is not None and rows > 1
                    and rows * need * self.host.kv_token_bytes > self.kv_cache_bytes):
                self.waiting.insert(0, seq)  # waits for rows to leave, first in line
                break
            if start_job(seq.job):
                admitted.append(seq)
                free -= 1
                width = need
        self.waiting = later + self.waiting
        choice_jobs = [job for job in self.waiting_choices if self._due(job) and start_job(job)]
        self.waiting_choices = [job for job in self.waiting_choices if not self._due(job) and not job.done]
        return admitted, choice_jobs

    def _step(self, admitted: list[Seq], choice_jobs: list[Job]) -> None:
        threads = self.host.cpu_threads
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # this thread's OpenMP count (it is per thread)
        if admitted or choice_jobs:
            stamp = weights_stamp(self.host.model)
            if stamp != self.stamp:  # weights changed under us: nothing stored is valid any more
                self._clear_prefix()
                self.stamp = stamp
        if admitted:
            self._prefill(admitted, first_row=len(self.rows))
            self.rows.extend(sorted(admitted, key=lambda s: s.row))
            self.stats["max_live_rows"] = max(self.stats["max_live_rows"], len(self.rows))
            self._retire()
        if choice_jobs:
            self._score(choice_jobs)
        if self.rows:
            self.forwards.decode(self.rows)
            self._retire()
        stats = self.stats
        stats["slab_peak_bytes"] = max(stats["slab_peak_bytes"], self.slab.nbytes)
        stats["slab_storage_peak_bytes"] = max(stats["slab_storage_peak_bytes"], self.slab.storage_bytes)
        stats["prefix_peak_bytes"] = max(stats["prefix_peak_bytes"], self.prefix.bytes)
        stats["slab_fresh_bytes"], stats["slab_fresh_seconds"] = self.slab.fresh_bytes, self.slab.fresh_seconds

    def _clear_prefix(self) -> None:
        self.prefix.clear()
        self.stamp = None
        self.stats["cache_clears"] += 1

    def _fail_in_flight(self, message: str, admitted: list[Seq], choice_jobs: list[Job]) -> None:
        for seq in self.rows + admitted:
            fail_job(seq.job, message)
        for job in choice_jobs:
            fail_job(job, message)
        self.rows = []
        self.slab.clear()
        self.prefix.clear()
        self.stamp = None

    # ------------------------------------------------------------------ prefill

    def _best_source(self, item: Seq | ChoiceRow, done: list[Seq | ChoiceRow]) -> tuple[int | None, Any, int]:
        """(slab row, or None with a prefix-cache entry, shared length) of the longest usable prefix."""
        limit = len(item.prompt) - 1  # the last prompt token is always computed: its logits are needed
        best: tuple[int | None, Any, int] = (None, None, 0)
        for seq in self.rows:
            n = min(shared_with_live(item, seq), limit)
            if n > best[2]:
                best = (seq.row, None, n)
        for other in done:
            n = min(common_prefix(item.prompt_np, other.prompt_np), prompt_cols(other), limit)
            if n > best[2]:
                best = (other.row, None, n)
        entry, n = self.prefix.longest(item.prompt_np)
        n = min(n, limit)
        if n > best[2]:
            best = (None, entry, n)
        return best if best[2] >= MIN_SHARED else (None, None, 0)

    def _prefill(self, items: list[Seq] | list[ChoiceRow], first_row: int) -> None:
        """Prefill `items` into slab rows from `first_row` on, in rounds (see the module docstring)."""
        pending, done, row = list(items), [], first_row
        while pending:
            this_round: list[tuple[Any, tuple]] = []
            later = []
            for item in pending:
                source = self._best_source(item, done)
                wave = max((common_prefix(item.prompt_np, o.prompt_np) for o, _ in this_round), default=0)
                if min(wave, len(item.prompt) - 1) - source[2] >= MIN_SHARED:
                    # copy it from that row next round instead of computing it twice; waiting a round
                    # for a few more shared tokens (two questions that begin alike) would cost a forward
                    later.append(item)
                else:
                    this_round.append((item, source))
            this_round.sort(key=lambda x: -suffix_len(x[0], x[1][2]))
            # a sequence left with one prompt token to feed is a decode row already: it joins the
            # next decode step instead of costing a forward of its own (the k samples of a problem)
            ready, rest = [], []
            for x in this_round:
                (ready if isinstance(x[0], Seq) and suffix_len(x[0], x[1][2]) == 1 else rest).append(x)
            chunks = ([ready] if ready else []) + self._chunks(rest)
            for chunk in chunks:
                for item, source in chunk:
                    item.row, row = row, row + 1
                self.slab.reserve(row, max(len(it.prompt) + tree_len(it) + 1 for it, _ in chunk))
                for item, (src_row, entry, n) in chunk:
                    item.start = n
                    if n:
                        self.stats["prefix_hits"] += 1
                        if src_row is None:
                            self.prefix.used(entry)
                            self.slab.load_row(item.row, entry.kv, n)
                        else:
                            self.slab.copy_row(src_row, item.row, n)
                if chunk is ready:
                    for item, _ in chunk:
                        item.kv_len = item.start
                        self.stats["prefill_tokens_requested"] += len(item.prompt)
                        self.stats["prefill_tokens_computed"] += 1
                else:
                    self.forwards.prefill([item for item, _ in chunk])
                done.extend(item for item, _ in chunk)
            pending = later

    def _chunks(self, items: list[tuple[Any, tuple]]) -> list[list[tuple[Any, tuple]]]:
        """Split `items` (sorted longest first) into forwards within the token and logits budgets
        (engine/prefill.py `plan_chunks`)."""
        spans = plan_chunks([suffix_len(item, source[2]) for item, source in items],
                            [tree_len(item) + 1 for item, _ in items], self.host.vocab_size,
                            PREFILL_TOKENS, CHOICE_LOGITS_BYTES, FORWARD_TOKENS)
        return [items[i:j] for i, j in spans]

    # ------------------------------------------------------------------ choices

    def _score(self, jobs: list[Job]) -> None:
        """Score all choice jobs (rows after the live ones, freed afterwards); draw and resolve them.

        Jobs with the same prompt and the same choices (the k samples of one position) are scored
        once: their log-probabilities are the same numbers, only their seeds differ."""
        rows: list[ChoiceRow] = []
        scored: dict[tuple, Job] = {}
        for job in jobs:
            key = (tuple(job.prompt), tuple(map(tuple, job.choice_ids)))
            if key in scored:
                job.scores = scored[key].scores  # filled in place when the first one is scored
                self.stats["prefill_tokens_requested"] += len(job.prompt)
                continue
            scored[key] = job
            job.scores = torch.zeros(len(job.choice_ids))
            rows += choice_rows(job, max(1, min(CHOICE_ROW_TOKENS, CHOICE_LOGITS_BYTES // (4 * self.host.vocab_size) - 1)))
        self._prefill(rows, first_row=len(self.rows))
        remembered = set()
        for row in rows:  # the prompt's KV, for the episode's next call (a chess move loop)
            if id(row.job) not in remembered:
                remembered.add(id(row.job))
                self._remember(row.prompt_np, row.row, len(row.prompt))
        for job in jobs:
            if job.kind == "score":
                job.results = [job.scores.clone()]
            else:
                picks = draw_choices(job.scores.tolist(), job.seeds, job.sampling.temperature)
                job.results = [self.host.choice_generation(job, c) for c in picks]
            resolve_job(job)

    def _retire(self) -> None:
        """Resolve finished sequences, keep their KV in the prefix cache, compact the live rows."""
        if all(s.finish is None for s in self.rows):
            return
        for row, s in enumerate(self.rows):
            if s.finish is not None:
                fed = s.prompt + s.ids[:-1]
                self._remember(np.asarray(fed, dtype=np.int64), row, s.kv_len)
                s.job.results[s.index] = self.host.finish_generation(s)
                s.job.remaining -= 1
                if s.job.remaining == 0:
                    resolve_job(s.job)
        live = sum(1 for s in self.rows if s.finish is None)
        holes = [i for i in range(live) if self.rows[i].finish is not None]
        movers = [i for i in range(live, len(self.rows)) if self.rows[i].finish is None]
        for hole, mover in zip(holes, movers):  # the last rows move into the holes: one row copied each
            self.slab.copy_row(mover, hole, self.rows[mover].kv_len)
            self.rows[hole] = self.rows[mover]
            self.rows[hole].row = hole
        self.rows = self.rows[:live]

    def _remember(self, ids: np.ndarray, row: int, length: int) -> None:
        if length < MIN_SHARED or self.slab.layers is None:
            return
        ids = ids[:length]
        if self.prefix.wants(ids, length * self.slab.column_bytes):
            self.prefix.add(ids, self.slab.read_row(row, length))
