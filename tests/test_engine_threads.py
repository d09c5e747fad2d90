"""The hf engine's intra-op threads on CPU (`model.cpu_threads`): the usable cores but one unless
told, and the engine thread's forwards really run on that count, whatever the calling thread has."""

import threading

import pytest
import torch

from whale.config import ConfigError, load_config
from whale.engine import hf
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine, engine_cpu_threads


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


@pytest.mark.parametrize("threads", [1, 2])
def test_the_engine_threads_forwards_run_on_its_count(tiny_model_dir, threads):
    """OpenMP's thread count is per thread: setting it in the caller would not reach the engine's
    own thread, so the engine sets it there; a forward hook sees what the model ran on."""
    seen: list[tuple[str, int]] = []
    main_threads = torch.get_num_threads()
    engine = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=64, cpu_threads=threads)
    hook = engine.model.register_forward_hook(
        lambda *_: seen.append((threading.current_thread().name, torch.get_num_threads())))
    other = 3 if threads != 3 else 2
    torch.set_num_threads(other)  # the caller's count, which must not leak into the engine thread
    try:
        out = engine.generate([GenerationRequest([{"role": "user", "content": "hi"}], max_tokens=4, seed=1)],
                              SamplingParams(temperature=1.0, max_tokens=4))
        assert out[0][0].completion_tokens > 0
        assert seen and all(name == "whale-hf-scheduler" and n == threads for name, n in seen), seen
        engine.cpu_threads = other  # read at every step
        engine.generate([GenerationRequest([{"role": "user", "content": "ho"}], max_tokens=4, seed=2)],
                        SamplingParams(temperature=1.0, max_tokens=4))
        assert seen[-1] == ("whale-hf-scheduler", other)
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
