"""RayExecutor on a local 2-CPU Ray cluster: same trajectories as a local run, spread over actors.

One Ray session for the module (starting Ray costs 5-15 s here); the last test closes the
executor that started it and checks that Ray is down.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ray = pytest.importorskip("ray")

from toy import ScriptedEngine, ToyDomain  # noqa: E402
from whale.config import Config  # noqa: E402
from whale.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from whale.executor import RayExecutor, make_executor  # noqa: E402
from whale.rollout.runner import RolloutRunner  # noqa: E402

# asks "correctly" on even problems only, so rewards are mixed (the scripted engine is then right)
HARNESS = '''
SYSTEM_PROMPT = "You add numbers."
USER_PROMPT = "{question}"

def run(env, llm):
    a = int(env.question.split()[2])
    prompt = ("Answer correctly: " if a % 2 == 0 else "") + USER_PROMPT.format(question=env.question)
    out = llm([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}])
    print("asked", a)
    env.submit(str(out))
'''
N_PROBLEMS, SAMPLES = 6, 2


def make_cfg() -> Config:
    cfg = Config()
    cfg.runner.concurrency = 4
    cfg.runner.grader_processes = 1
    cfg.compute.executor = "ray"
    return cfg


def key(t):
    """Everything about a trajectory except wall-clock timings."""
    return (t.problem_id, t.sample, t.answer, t.reward, t.error, t.weights_version, t.stdout_tail,
            [(c.messages, c.completion, c.prompt_ids, c.completion_ids, c.weights_version) for c in t.calls])


@pytest.fixture(scope="module")
def problems():
    return ToyDomain(N_PROBLEMS).problems


@pytest.fixture(scope="module")
def executor():
    engine = ScriptedEngine()
    ex = RayExecutor(make_cfg(), engine, functools.partial(ToyDomain, N_PROBLEMS), num_cpus=2)
    yield ex
    ex.close()


def test_missing_ray_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'whale-opt\[ray\]'"):
        RayExecutor(make_cfg(), ScriptedEngine(), functools.partial(ToyDomain, 2))


def test_make_executor_local_is_the_runner():
    cfg = make_cfg()
    cfg.compute.executor = "local"
    ex = make_executor(cfg, ScriptedEngine(), ToyDomain(2))
    try:
        assert isinstance(ex, RolloutRunner)
    finally:
        ex.close()


def test_same_trajectories_as_local_run_on_two_actors(executor, problems):
    local = RolloutRunner(ScriptedEngine(), ToyDomain(N_PROBLEMS), make_cfg())
    try:
        expected = local.run(HARNESS, problems, SAMPLES, harness_id="h1", seed=7, purpose="eval")
    finally:
        local.close()
    assert {t.reward for t in expected} == {0.0, 1.0} and all(t.error is None for t in expected)

    journal, seen = [], []
    executor.journal = journal.append
    got = executor.run(HARNESS, problems, SAMPLES, harness_id="h1", seed=7, purpose="eval",
                       on_episode=seen.append)
    executor.journal = None
    assert [key(t) for t in got] == [key(t) for t in expected]  # same order, answers, rewards, ids
    # played in two worker processes, neither of them this one
    assert len(set(executor.last_pids)) == 2 and os.getpid() not in executor.last_pids
    # every llm() call reached the driver's engine through the EngineActor
    assert executor.engine.calls == N_PROBLEMS * SAMPLES
    assert executor.stats["engine_calls"] >= 2 and executor.stats["episodes"] == N_PROBLEMS * SAMPLES
    # finished episodes were streamed to the driver's callbacks
    assert sorted(key(t) for t in journal) == sorted(key(t) for t in got)
    assert sorted(key(t) for t in seen) == sorted(key(t) for t in got)


def test_workers_follow_driver_weights_and_engine_errors(executor, problems):
    executor.engine.load_weights(None, "v2")  # e.g. after an in-place training step on the driver
    got = executor.run(HARNESS, problems[:3], 1, seed=1)
    assert [t.weights_version for t in got] == ["v2"] * 3
    assert all(c.weights_version == "v2" for t in got for c in t.calls)

    def broken(requests, sampling):
        raise RuntimeError("GPU fell over")

    executor.engine.generate = broken  # an engine failure fails the episodes, not the run
    try:
        got = executor.run(HARNESS, problems[:2], 1, seed=1)
    finally:
        del executor.engine.generate
    assert [t.reward for t in got] == [0.0, 0.0], [t.error for t in got]
    assert all("GPU fell over" in (t.error or "") for t in got), [t.error for t in got]


# ---------------------------------------------------------------- direct vLLM clients
class _FakeVLLM(BaseHTTPRequestHandler):
    """The few vLLM endpoints VLLMEngine uses, answering with the scripted engine's rule."""

    def _send(self, obj):
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send({"data": [{"id": "fake-model", "max_model_len": 4096}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
            self._send({"tokens": [ord(c) for c in text]})
        elif self.path == "/v1/completions":
            text = "".join(chr(i) for i in body["prompt"])
            req = GenerationRequest(messages=[{"role": "user", "content": text}])
            answer = ScriptedEngine().generate([req], SamplingParams())[0][0].text
            self.server.models.append(body["model"])
            self._send({"choices": [{"index": 0, "text": answer, "token_ids": [ord(c) for c in answer],
                                     "finish_reason": "stop"}]})
        else:  # /v1/load_lora_adapter, /v1/unload_lora_adapter
            self._send({})

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_vllm():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    server.models = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_vllm_engine_workers_talk_to_the_server_directly(executor, problems, fake_vllm, tmp_path):
    from whale.engine.vllm import VLLMEngine

    driver = VLLMEngine("fake-model", base_url=f"http://127.0.0.1:{fake_vllm.server_address[1]}")
    driver_calls = []
    driver.generate = lambda *a: driver_calls.append(a)  # must not be used: workers have clients
    ex = RayExecutor(make_cfg(), driver, functools.partial(ToyDomain, N_PROBLEMS), num_actors=2)
    try:
        assert ex.client is not None and not ex.owns_ray  # attached to the module's Ray session
        got = ex.run(HARNESS, problems, 1, seed=3)
        assert [t.reward for t in got] == [1.0, 0.0] * (N_PROBLEMS // 2)
        assert fake_vllm.models == ["fake-model"] * N_PROBLEMS and driver_calls == []

        adapter = tmp_path / "adapter"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
        driver.load_weights(str(adapter), "v7")  # loaded on the driver; workers must route to it
        fake_vllm.models.clear()
        got = ex.run(HARNESS, problems[:2], 1, seed=3)
        assert fake_vllm.models == ["v7@1", "v7@1"]
        assert all(t.weights_version == "v7" and t.calls[0].weights_version == "v7" for t in got)
    finally:
        ex.close()
        driver.close()
    assert ray.is_initialized()  # it did not start Ray, so it leaves it running


def test_worker_start_failures_are_clear_errors(executor):
    assert executor.owns_ray  # Ray is up; the executors below attach to it
    with pytest.raises(RuntimeError, match="could not start"):
        RayExecutor(make_cfg(), ScriptedEngine(), functools.partial(ToyDomain, "six"), num_actors=1)
    with pytest.raises(ValueError, match="do not fit"):
        RayExecutor(make_cfg(), ScriptedEngine(), functools.partial(ToyDomain, 2), num_actors=8)
    assert ray.is_initialized()  # attached, so the failed executors left Ray alone


def test_close_shuts_ray_down(executor):
    actors = list(executor.actors)
    assert executor.owns_ray and ray.is_initialized()
    executor.close()
    assert not ray.is_initialized() and executor.actors == [] and len(actors) == 2
    executor.close()  # closing twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        executor.run("", [], 1)
