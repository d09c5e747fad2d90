"""`whale run` on the vllm backend, against the fake server process (no vLLM needed).

The fake (tests/fake_vllm.py) samples text from the seed, so the length-parity toy domain accepts
about half the episodes; the trainer is the tiny model from a config. What is checked is the
from-disk weight path of a run: the trainer is a copy built for a server engine, every trained
step saves an adapter that the server is asked to load, rollouts carry the version they were
sampled under, and a resumed run loads the current adapter into its new server before it samples.
The real-vLLM version of this run is tests/test_vllm_e2e.py (opt-in).
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
from fake_vllm import read_log

from whale.config import dump_config, load_config
from whale.report import write_report
from whale.run import run_experiment
from whale.store import read_metrics

TESTS = Path(__file__).resolve().parent
FAKE_PATH = os.pathsep.join([str(TESTS / "fixtures" / "fake_vllm_pkg"), str(TESTS)])


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("WHALE_VLLM_PYTHON", sys.executable)


def vllm_config(model_dir, log: Path, **over):
    sets = [
        "model.backend=vllm", f"model.name={model_dir}", "model.max_model_len=64",
        f"model.vllm_env={json.dumps({'PYTHONPATH': FAKE_PATH, 'FAKE_VLLM_LOG': str(log)})}",
        "domain.module=toy:ParityDomain", "domain.splits.weight=8", "domain.splits.harness=4",
        "domain.splits.val=4", "domain.splits.test=4", "domain.budget.seconds=20", "sampling.max_tokens=4",
        "weight.problems_per_step=4", "weight.samples_per_problem=2", "weight.mini_batch_trajectories=4",
        "weight.lora.r=8", "harness.candidates_per_iteration=1", "harness.null_probe_items=4",
        "harness.reject_flagged=false", "eval.k=1", "eval.every_steps=0", "eval.at_phase_ends=false",
        "schedule.weight_epochs=1.0", "schedule.harness_iterations=2", "schedule.budget_epochs=1.5",
        "runner.concurrency=8", "runner.grader_processes=1",
    ] + [f"{k}={v}" for k, v in over.items()]
    return load_config(None, sets)


def trace_versions(run_dir: Path) -> list[str]:
    """The weights version of every recorded call in the run's traces (evaluations, harness archive)."""
    files = sorted((run_dir / "evals").glob("*.jsonl"), key=lambda f: f.stat().st_mtime)
    files += sorted(run_dir.glob("harnesses/*/traces.jsonl"))
    return [c["weights_version"] for f in files for line in f.read_text().splitlines()
            for c in json.loads(line)["calls"]]


def test_weight_steps_push_adapters_to_the_server(tiny_model_dir, tmp_path):
    log = tmp_path / "fake.jsonl"
    run_dir = run_experiment(vllm_config(tiny_model_dir, log), out=tmp_path / "run")
    state = json.loads((run_dir / "state.json").read_text())
    assert state["phase"] == "done"
    steps = [r for r in read_metrics(run_dir) if r.get("event") == "weight_step"]
    trained = [r["weights_version"] for r in steps if r["weights_version"]]
    assert len(steps) == 3 and len(trained) >= 2, "the parity grader accepts about half: most steps train"
    loads = [r["body"] for r in read_log(log) if r["path"] == "/v1/load_lora_adapter"]
    assert [Path(b["lora_path"]).name for b in loads] == trained  # each trained step, pushed once
    assert all(Path(b["lora_path"]).parent == (run_dir / "weights").resolve() for b in loads)
    # Rollouts carry the version they were sampled under, and it moves with the pushes.
    assert trace_versions(run_dir)[0] == "base" and len(set(trace_versions(run_dir))) >= 2
    completions = [r["body"]["model"] for r in read_log(log) if r["path"] == "/v1/completions"]
    assert completions[-1].startswith(state["weights_version"] + "@")  # the final eval used the last push


def start_run(model_dir, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """`whale run` of the fake-server config in a subprocess: (process, run dir, fake server log)."""
    log = tmp_path / "fake.jsonl"
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(dump_config(vllm_config(model_dir, log)))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "whale.cli", "run", str(cfg_path), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    return proc, out, log


def test_resume_loads_the_current_adapter_into_the_new_server(tiny_model_dir, tmp_path):
    proc, out, log = start_run(tiny_model_dir, tmp_path)
    deadline = time.time() + 240
    while not (json.loads((out / "state.json").read_text()) if (out / "state.json").exists() else {}).get(
            "weights_version", "base") != "base":
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "no weights were pushed"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    version = json.loads((out / "state.json").read_text())["weights_version"]
    first_pids = {r["pid"] for r in read_log(log)}
    res = subprocess.run([sys.executable, "-m", "whale.cli", "run", "--resume", str(out)], capture_output=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    resumed = [r for r in read_log(log) if r["pid"] not in first_pids]
    paths = [r["path"] for r in resumed]
    first_load = paths.index("/v1/load_lora_adapter")
    assert resumed[first_load]["body"]["lora_path"] == str((out / "weights" / version).resolve())
    assert "/v1/completions" not in paths[:first_load]  # restored before any rollout
    assert json.loads((out / "state.json").read_text())["phase"] == "done"


def test_a_server_killed_mid_run_is_recovered_and_logged(tiny_model_dir, tmp_path):
    """The server dies after the first push: the run brings it back with the current adapter,
    goes on to the end, and metrics.jsonl names the incident (unit, reason)."""
    proc, out, log = start_run(tiny_model_dir, tmp_path)
    try:
        deadline = time.time() + 240
        while not (log.exists() and any(r["path"] == "/v1/load_lora_adapter" for r in read_log(log))):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "no weights were pushed"
            time.sleep(0.1)
        os.kill(read_log(log)[0]["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert json.loads((out / "state.json").read_text())["phase"] == "done"
    [row] = [r for r in read_metrics(out) if r.get("event") == "engine_recovered"]
    assert row["ok"] and "exited with code 137" in row["reason"] and row["unit"]
    assert len({r["pid"] for r in read_log(log)}) == 2  # one restart, one new server
    write_report(out)
    assert f"engine server recovered in {row['unit']}: exited with code 137" in (out / "report" / "report.md").read_text()


def test_eval_with_weights_loads_the_adapter_into_the_server(tiny_model_dir, tmp_path):
    log = tmp_path / "fake.jsonl"
    folder = tmp_path / "w3"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    env_json = json.dumps({"PYTHONPATH": FAKE_PATH, "FAKE_VLLM_LOG": str(log)})
    res = subprocess.run([sys.executable, "-m", "whale.cli", "eval", "--domain", "parity", "--model", str(tiny_model_dir),
                          "--weights", str(folder), "--k", "1", "--limit", "2", "--json",
                          "--set", "domain.module=toy:ParityDomain", "--set", "model.backend=vllm",
                          "--set", "model.max_model_len=64", "--set", f"model.vllm_env={env_json}",
                          "--set", "weight.lora.r=8"], capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    summary = json.loads(res.stdout.decode().strip().splitlines()[-1])
    assert summary["n"] == 2 and summary["rollouts"] == 2
    records = read_log(log)
    [load] = [r["body"] for r in records if r["path"] == "/v1/load_lora_adapter"]
    assert load["lora_path"] == str(folder.resolve()) and load["lora_name"].startswith("w3@")
    assert {r["body"]["model"] for r in records if r["path"] == "/v1/completions"} == {load["lora_name"]}
