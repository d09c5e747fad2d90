"""The hf engine's intra-op threads on CPU: decode steps on `model.cpu_threads` (the usable cores
but one unless told), prefill forwards on `model.prefill_threads` (every usable core unless told),
and the engine thread's forwards really run on those counts, whatever the calling thread has."""

import threading

import pytest
import torch

from whale.config import ConfigError, load_config
from whale.engine import hf
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine, engine_cpu_threads, engine_prefill_threads


@pytest.mark.parametrize("cores,want", [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_default_leaves_a_core_to_the_runner(monkeypatch, cores, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(hf, "usable_cores", lambda: cores)
    assert engine_cpu_threads(None) == want


def test_the_users_choice_wins(monkeypatch):
    monkeypatch.setattr(hf, "usable_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert engine_cpu_threads(None) == 2
    assert engine_cpu_threads(5) == 5  # the config over the environment
    with pytest.raises(ValueError, match="cpu_threads"):
        engine_cpu_threads(0)


def test_config_rejects_zero_threads():
    with pytest.raises(ConfigError, match="cpu_threads"):
        load_config(None, ["model.cpu_threads=0"])


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_prefill_takes_every_core_unless_told(monkeypatch, cores):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(hf, "usable_cores", lambda: cores)
    assert engine_prefill_threads(None) == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert engine_prefill_threads(None) == 3
    assert engine_prefill_threads(2) == 2  # the config over the environment
    with pytest.raises(ValueError, match="prefill_threads"):
        engine_prefill_threads(0)
    with pytest.raises(ConfigError, match="prefill_threads"):
        load_config(None, ["model.prefill_threads=0"])


@pytest.mark.parametrize("decode,prefill", [(1, 2), (2, 1), (1, 1)])
def test_the_engine_threads_forwards_run_on_their_counts(tiny_model_dir, decode, prefill):
    """OpenMP's thread count is per thread: setting it in the caller would not reach the engine's
    own thread, so the engine sets it there, per forward: a prefill (many tokens per row) on
    `prefill_threads`, a decode step (one token per row) on `cpu_threads`. A forward hook sees what
    each forward ran on."""
    seen: list[tuple[str, int, int]] = []  # (thread, tokens per row, OpenMP threads)
    main_threads = torch.get_num_threads()
    engine = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=64, cpu_threads=decode,
                      prefill_threads=prefill)
    hook = engine.model.register_forward_hook(
        lambda _m, _args, kwargs, _out: seen.append(
            (threading.current_thread().name, kwargs["input_ids"].shape[1], torch.get_num_threads())),
        with_kwargs=True)
    other = 3
    torch.set_num_threads(other)  # the caller's count, which must not leak into the engine thread
    try:
        out = engine.generate([GenerationRequest([{"role": "user", "content": "hi"}], max_tokens=4, seed=1)],
                              SamplingParams(temperature=1.0, max_tokens=4))
        assert out[0][0].completion_tokens > 1
        assert {name for name, _, _ in seen} == {"whale-hf-scheduler"}, seen
        prefills = [n for _, width, n in seen if width > 1]
        decodes = [n for _, width, n in seen if width == 1]
        assert prefills and decodes, seen
        assert set(prefills) == {prefill} and set(decodes) == {decode}, seen
        engine.cpu_threads, engine.prefill_threads = other, other + 1  # read at every step
        seen.clear()
        engine.generate([GenerationRequest([{"role": "user", "content": "ho there"}], max_tokens=4, seed=2)],
                        SamplingParams(temperature=1.0, max_tokens=4))
        assert {n for _, width, n in seen if width > 1} == {other + 1}, seen
        assert {n for _, width, n in seen if width == 1} == {other}, seen
    finally:
        hook.remove()
        engine.close()
        torch.set_num_threads(main_threads)


def test_step_seconds_hold_the_forwards(tiny_model_dir):
    """`step_seconds` (what benchmarks/workloads.py splits into forwards, other step work and idle)
    covers every forward's seconds."""
    engine = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=64)
    try:
        before = dict(engine.stats)
        engine.generate([GenerationRequest([{"role": "user", "content": "hi"}], max_tokens=6, seed=s) for s in range(3)],
                        SamplingParams(temperature=1.0, max_tokens=6))
        d = {k: engine.stats[k] - before[k] for k in ("step_seconds", "prefill_seconds", "decode_seconds")}
        forwards = d["prefill_seconds"] + d["decode_seconds"]
        assert 0 < forwards <= d["step_seconds"]
    finally:
        engine.close()
