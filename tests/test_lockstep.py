"""Lockstep batching (engine/lockstep.py): the samples follow from the episodes, not from timing.

In bf16 a sequence's tokens depend on its batch-mates' shapes; without lockstep, the same
evaluation drawn twice under jittered harness timing gives different completions (measured here:
19-24 of 48 episodes of this test changed). With it, none may."""

import threading
import time

import pytest

from toy import ToyDomain
from whale.config import Config
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine
from whale.rollout.runner import RolloutRunner

JITTERY = '''
import random, time
def run(env, llm):
    time.sleep(random.random() * 0.02)
    a = llm([{"role": "user", "content": env.question}], max_tokens=12)
    time.sleep(random.random() * 0.02)
    b = llm([{"role": "user", "content": env.question}, {"role": "assistant", "content": str(a)},
             {"role": "user", "content": "again"}], max_tokens=12)
    env.submit(str(b))
'''


@pytest.fixture(scope="module")
def bf16_engine(tiny_model_dir):
    engine = HFEngine(str(tiny_model_dir), dtype="bfloat16")
    yield engine
    engine.close()


def completions(runner, problems):
    trajs = runner.run(JITTERY, problems, samples=2, seed=7, purpose="eval")
    assert all(t.error is None for t in trajs), [t.error for t in trajs if t.error]
    # a loaded machine may starve a harness process past the hold; here the hold is long, so a
    # break would be a bug, not load (the hold itself: test_the_engine_stops_waiting...)
    assert runner.last_lockstep_breaks == 0
    return [[c.completion_ids for c in t.calls] for t in trajs]


def test_lockstep_evaluations_are_bit_identical_under_jittered_timing(bf16_engine):
    cfg = Config()
    cfg.runner.concurrency, cfg.runner.lockstep, cfg.runner.grader_processes = 12, "all", 1
    cfg.runner.lockstep_hold_s = 30.0
    cfg.domain.budget.seconds = 60
    domain = ToyDomain(24)
    runner = RolloutRunner(bf16_engine, domain, cfg)
    try:
        first = completions(runner, domain.problems)
        second = completions(runner, domain.problems)
    finally:
        runner.close()
    assert all(len(calls) == 2 for calls in first)
    changed = sum(a != b for a, b in zip(first, second))
    assert changed == 0, f"{changed} of {len(first)} episodes sampled other tokens the second time"


def test_lockstep_mode_eval_gates_only_evaluations(bf16_engine):
    cfg = Config()
    cfg.runner.lockstep = "eval"
    runner = RolloutRunner(bf16_engine, ToyDomain(2), cfg)
    try:
        assert runner._lockstep("weight", 2) is None
        gate = runner._lockstep("eval", 2)
        assert gate is not None
        gate.close()
        cfg.runner.lockstep = "never"
        assert runner._lockstep("eval", 2) is None
    finally:
        runner.close()


def test_a_step_waits_for_running_clients_and_order_decides_admission(bf16_engine):
    """Client 1 submits late (it is still running): the engine must not step before it arrives, and
    the two calls come out the same whichever client was first."""
    sampling = SamplingParams(temperature=1.0, top_k=0, max_tokens=6)

    def request(i):
        return GenerationRequest([{"role": "user", "content": f"question {i}"}], seed=100 + i)

    def trial(late_client: int):
        gate = bf16_engine.lockstep(2)
        try:
            early = 1 - late_client
            futures = {early: gate.submit(early, early, request(early), sampling)}
            time.sleep(0.3)
            assert not futures[early].done()  # held: client `late_client` is still running
            futures[late_client] = gate.submit(late_client, late_client, request(late_client), sampling)
            out = {c: f.result(timeout=60)[0].completion_ids for c, f in futures.items()}
            gate.leave(0)
            gate.leave(1)
            return out
        finally:
            gate.close()

    assert trial(late_client=1) == trial(late_client=0)


def test_a_bad_request_is_answered_at_once_and_a_leaving_client_releases_the_engine(bf16_engine):
    sampling = SamplingParams(max_tokens=4)
    gate = bf16_engine.lockstep(3)
    try:
        bad = gate.submit(0, 0, GenerationRequest(messages=[]), sampling)
        assert bad.result(timeout=5)[0].finish_reason == "error"
        good = gate.submit(1, 1, GenerationRequest([{"role": "user", "content": "hi"}], seed=1), sampling)
        gate.leave(0)
        time.sleep(0.2)
        assert not good.done()  # client 2 is still running
        threading.Timer(0.1, gate.leave, args=(2,)).start()
        assert good.result(timeout=60)[0].finish_reason in ("stop", "length")
    finally:
        gate.close()
    # after close, plain submits are served as before
    plain = bf16_engine.submit(GenerationRequest([{"role": "user", "content": "hi"}], seed=2), sampling)
    assert plain.result(timeout=60)[0].finish_reason in ("stop", "length")


def test_the_engine_stops_waiting_for_a_stalled_client_and_counts_it(bf16_engine):
    """A harness stuck in a slow tool must not hold the batch forever: after hold_s the engine goes
    on without it, and the break is counted (the batch is then not bit-reproducible)."""
    gate = bf16_engine.lockstep(2, hold_s=0.3)
    try:
        t0 = time.monotonic()
        out = gate.submit(0, 0, GenerationRequest([{"role": "user", "content": "hi"}], seed=3),
                          SamplingParams(max_tokens=4)).result(timeout=60)
        assert out[0].finish_reason in ("stop", "length") and time.monotonic() - t0 >= 0.3
        assert gate.breaks == 1  # client 1 never sent its call
        late = gate.submit(1, 1, GenerationRequest([{"role": "user", "content": "hi"}], seed=4),
                           SamplingParams(max_tokens=4))
        assert late.result(timeout=60)[0].finish_reason in ("stop", "length")  # joins on arrival
    finally:
        gate.close()


def test_engines_that_cannot_lockstep_say_so():
    from whale.engine.null import NullEngine

    engine = NullEngine()
    assert engine.lockstep(4) is None
    runner = RolloutRunner(engine, ToyDomain(2), Config())
    try:
        assert runner._lockstep("eval", 2) is None  # runner.lockstep: eval, an engine without it
        runner.cfg.runner.lockstep = "never"
        assert runner._lockstep("eval", 2) is None
    finally:
        runner.close()
