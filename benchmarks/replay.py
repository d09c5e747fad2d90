"""Recording a runner's calls and replaying them on an engine, for benchmarks/workloads.py and
benchmarks/decode_width.py: the raw replay (each episode's calls in order, `concurrency` episodes
at once) and the waves replay (every episode's i-th call in one `generate`)."""

from __future__ import annotations

import queue
import threading
import time

from whale.engine.base import GenerationRequest
from whale.rollout.runner import derive_seed


class Recorder:
    """The engine, recording every submitted request (the runner's exact calls)."""

    def __init__(self, engine):
        self.engine = engine
        self.returns_ids, self.weight_sync = engine.returns_ids, engine.weight_sync
        self.requests: list[GenerationRequest] = []

    @property
    def weights_version(self):
        return self.engine.weights_version

    def submit(self, request, sampling):
        self.requests.append(request)
        return self.engine.submit(request, sampling)

    def generate(self, requests, sampling):
        return self.engine.generate(requests, sampling)

    def count_tokens(self, messages):
        return self.engine.count_tokens(messages)

    def lockstep(self, clients, hold_s=1.0):
        gate = self.engine.lockstep(clients, hold_s)
        return None if gate is None else _RecordedGate(gate, self.requests)

    def load_weights(self, path, version):
        self.engine.load_weights(path, version)

    def close(self):
        pass


class _RecordedGate:
    def __init__(self, gate, requests):
        self.gate, self.requests = gate, requests

    def submit(self, client, order, request, sampling):
        self.requests.append(request)
        return self.gate.submit(client, order, request, sampling)

    def leave(self, client):
        self.gate.leave(client)

    def close(self):
        self.gate.close()

    @property
    def breaks(self):
        return self.gate.breaks


def episodes_of(requests, problems, samples, seed, max_calls):
    """The recorded requests grouped per episode, in call order (by their derived seeds)."""
    where = {derive_seed(seed, p.id, s, c): (i * samples + s, c)
             for i, p in enumerate(problems) for s in range(samples) for c in range(max_calls)}
    episodes: list[dict[int, GenerationRequest]] = [{} for _ in range(len(problems) * samples)]
    for r in requests:
        e, c = where[r.seed]
        episodes[e][c] = r
    return [[ep[c] for c in sorted(ep)] for ep in episodes]


def replay_chained(engine, episodes, sampling, concurrency):
    """Each episode's calls in order, `concurrency` episodes at once; returns (seconds, generations).

    Submissions go through a dispatcher thread (as the runner's event loop does), never from the
    engine's own thread, so tokenising the next call does not steal the model thread's time."""
    todo: queue.Queue = queue.Queue()
    results: list[list] = [[] for _ in episodes]
    finished = threading.Event()
    state = {"next": 0, "left": len(episodes)}

    def done(e, c, future):
        results[e].append(future.result())
        todo.put((e, c + 1) if c + 1 < len(episodes[e]) else ("end", e))

    def start_next():
        if state["next"] < len(episodes):
            todo.put((state["next"], 0))
            state["next"] += 1

    def dispatch():
        while True:
            e, c = todo.get()
            if e == "stop":
                return
            if e == "end":
                state["left"] -= 1
                if state["left"] == 0:
                    finished.set()
                start_next()
                continue
            engine.submit(episodes[e][c], sampling).add_done_callback(lambda f, e=e, c=c: done(e, c, f))

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(episodes))):
        start_next()
    thread = threading.Thread(target=dispatch, daemon=True)
    thread.start()
    finished.wait()
    seconds = time.perf_counter() - t0
    todo.put(("stop", 0))
    thread.join()
    return seconds, [g for ep in results for g in ep]


def timed(fn, *args):
    """(wall seconds, process CPU seconds, result) of fn(*args); CPU time is steadier on a shared machine."""
    c0 = time.process_time()
    seconds, out = fn(*args)
    return seconds, time.process_time() - c0, out


def replay_waves(engine, episodes, sampling):
    """All episodes' i-th calls in one generate, wave after wave; returns (seconds, generations)."""
    out = []
    t0 = time.perf_counter()
    for c in range(max(len(ep) for ep in episodes)):
        out += engine.generate([ep[c] for ep in episodes if len(ep) > c], sampling)
    return time.perf_counter() - t0, out


def generated(gens) -> int:
    return sum(g.completion_tokens for gs in gens for g in gs)


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def fresh(engine) -> dict:
    """Clear the prefix cache (a weight push with the same version does) and snapshot the stats."""
    engine.load_weights(None, engine.weights_version)
    return dict(engine.stats)
