"""The run directory's resume rules: the keyed ledger, and pruning that never strands state.json."""

import hashlib
import json
from pathlib import Path

import pytest

from whale.config import Config
from whale.run_state import RunState, ValBest
from whale.store import Ledger, RunDir, load_summary


def test_a_batch_counted_again_goes_to_redone(tmp_path):
    led = Ledger(path=tmp_path / "ledger.jsonl")
    assert led.count("w0", "weight", 8, llm_calls=8, prompt_tokens=100) == "weight"
    assert led.count("w0", "weight", 8, llm_calls=8, prompt_tokens=100) == "redone"  # its results were lost
    assert led.rollouts["weight"] == 8 and led.rollouts["redone"] == 8 and led.budget_rollouts == 8
    assert led.llm_calls == 16 and led.prompt_tokens == 200  # spending counts both times


def test_ledger_is_rebuilt_from_its_file_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    led = Ledger(path=path)
    led.count("c0:harness:h1@w1#0", "harness", 4, completion_tokens=12)
    led.add_proposer("c0-h2:proposer", 1.5, 300)
    with open(path, "a") as f:
        f.write('{"key": "w9", "purpose": "wei')  # a kill in the middle of an append
    back = Ledger.load(path, snapshot={"rollouts": {"weight": 999}})  # the file wins over a stale snapshot
    assert back.snapshot() == led.snapshot()
    assert back.count("c0:harness:h1@w1#0", "harness", 4) == "redone"


def test_a_row_appended_after_a_torn_line_is_kept(tmp_path):
    """A kill or a full disk cuts the last line short; what the resumed run appends next starts a line
    of its own, instead of being glued to the torn one (which made readers drop both)."""
    path = tmp_path / "ledger.jsonl"
    Ledger(path=path).count("w0", "weight", 8)
    with open(path, "a") as f:
        f.write('{"key": "w1", "purpose": "wei')  # no space left in the middle of an append
    resumed = Ledger.load(path)
    resumed.count("w1", "weight", 8)
    assert Ledger.load(path).rollouts["weight"] == 16
    run = RunDir(tmp_path)
    run.log({"unit": "w0", "event": "weight_step"})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"unit": "w1", "ev')
    run.log({"unit": "w1", "event": "weight_step"})
    assert [r["unit"] for r in run.metrics()] == ["w0", "w1"]


def test_an_old_run_without_ledger_file_starts_from_its_snapshot(tmp_path):
    led = Ledger.load(tmp_path / "ledger.jsonl", snapshot={"rollouts": {"weight": 32}, "llm_calls": 40})
    assert led.budget_rollouts == 32 and led.llm_calls == 40


def test_counting_clears_the_inflight_journal(tmp_path):
    run = RunDir(tmp_path)

    class T:
        problem_id, sample, calls, prompt_tokens, completion_tokens = "p0", 0, [], 0, 0

    run.journal("w0", T())
    assert run.count_inflight() == 1
    run.count_trajectories("w0", "weight", [T()])
    assert run.count_inflight() == 0  # the ledger holds these episodes now: not "redone" after a kill


def test_prune_never_deletes_what_the_saved_state_names(tmp_path):
    run = RunDir(tmp_path)
    for v in ("w0", "w1", "w2", "w3.tmp"):
        (run.weights_path(v)).mkdir(parents=True)
    run.save_state(RunState(phase="weight", weights_version="w1", val_best=ValBest(
        mean_at_k=0.5, unit="eval-w1-val", tag="w1", harness_id="h0", weights_version="w0")))
    deleted = run.prune_weights({"w2"})  # a caller that forgot the current version and the val-best
    assert sorted(deleted) == ["w3.tmp"] and run.weights_on_disk() == ["w0", "w1", "w2"]


def test_summary_reads_metrics_and_state(tmp_path):
    run = RunDir(tmp_path)
    for tag, split, value in [("initial", "val", 0.2), ("initial", "test", 0.1), ("w2", "val", 0.5),
                              ("w2", "test", 0.3), ("w4", "val", 0.4), ("w4", "test", 0.6)]:
        run.log({"unit": f"eval-{tag}-{split}", "event": "eval", "tag": tag, "split": split, "mean_at_k": value})
    run.save_state(RunState(phase="done", harness_id="h2", weights_version="w3"))
    s = load_summary(tmp_path)
    assert (s["initial"], s["final"], s["best"], s["val_selected"], s["val_selected_tag"]) == (0.1, 0.6, 0.6, 0.3, "w2")
    assert json.loads((tmp_path / "state.json").read_text())["harness_id"] == s["harness_id"] == "h2"


def test_environment_record_names_the_source_commit():
    import subprocess

    from whale.store import environment_record

    root = Path(__file__).resolve().parents[1]
    commit = environment_record(Config())["whale_commit"]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        assert commit is None  # not a git checkout (an installed wheel)
    else:
        assert commit.removesuffix("+dirty") == head.stdout.strip()


def test_version_step_reads_only_w_and_ascii_digits():
    from whale.store import version_step

    assert [version_step(v) for v in ("w0", "w12", "w007")] == [0, 12, 7]
    for other in ("base", "w", "w3.tmp", "v3", "w-1", "w²", "w٣"):  # the old one raised on "w²"
        assert version_step(other) is None, other
    assert sorted(["w10", "w2", "w1"], key=version_step) == ["w1", "w2", "w10"]


def test_atomic_write_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    from whale.store import atomic_write, file_sha256

    path = tmp_path / "deep" / "state.json"
    atomic_write(path, "old")
    atomic_write(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in path.parent.iterdir()) == ["state.json"]
    with pytest.raises(TypeError):
        atomic_write(path, 42)  # not text: the write fails, the old file stays, no temporary is left
    assert path.read_text() == "new" and sorted(p.name for p in path.parent.iterdir()) == ["state.json"]
    assert file_sha256(path) == hashlib.sha256(b"new").hexdigest()
