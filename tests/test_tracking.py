"""Experiment trackers: fed from the metrics rows, read back from their own files, never fatal."""

import json
import os
import warnings
from pathlib import Path

import pytest

from test_run import tiny_config
from whale.config import ConfigError, load_config
from whale.run import run_experiment
from whale.store import RunDir, read_metrics
from whale.tracking import Trackers, tracker_run_id, row_scalars

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="module")
def tracked_run(tiny_model_dir, tmp_path_factory):
    """One short WHALE run (weight steps, harness iterations, evaluations) with TensorBoard and W&B."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(TESTS))
        mp.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        cfg = tiny_config(tiny_model_dir, **{"logging.trackers": "[tensorboard,wandb]"})
        return run_experiment(cfg, out=tmp_path_factory.mktemp("tracked") / "run")


def _tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "trackers" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_are_the_metrics_rows(tracked_run):
    acc = _tensorboard(tracked_run)
    rows = read_metrics(tracked_run)
    steps = [r for r in rows if r.get("event") == "weight_step"]
    evals = [r for r in rows if r.get("event") == "eval" and r["split"] == "test"]
    assert steps and evals and any(r.get("event") == "candidate" or r.get("event") == "rescore" for r in rows)
    accept = acc.Scalars("weight_step/accept_rate")
    assert [e.value for e in accept] == pytest.approx([r["accept_rate"] for r in steps])
    assert [e.step for e in accept] == [r["ledger"]["budget_rollouts"] for r in steps]  # x = rollouts
    by_tokens = acc.Scalars("by_tokens/eval/test/mean_at_k")
    assert [e.step for e in by_tokens] == [r["ledger"]["tokens"] for r in evals]  # x = tokens
    assert [e.value for e in by_tokens] == pytest.approx([r["mean_at_k"] for r in evals])
    source = next(iter(evals[0]["per_source"]))
    assert acc.Scalars(f"eval/test/{source}/mean_at_k")[0].value == pytest.approx(
        evals[0]["per_source"][source]["mean_at_k"])
    assert any(r.get("event") == "iteration_end" for r in rows) and acc.Scalars("iteration_end/best_rate")


def test_tensorboard_has_the_lineage_table(tracked_run):
    acc = _tensorboard(tracked_run)
    tags = acc.Tags()["tensors"]
    assert "lineage/text_summary" in tags
    text = acc.Tensors("lineage/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| id | parent | mechanism |" in text and "| h0 |" in text
    candidates = {r["id"] for r in read_metrics(tracked_run) if r.get("event") == "candidate"}
    assert all(f"| {c} |" in text for c in candidates)


def _wandb_records(path):
    """Records of a W&B offline run file: a 7-byte header, then LevelDB-style log records
    (crc32, length, type) in 32 KiB blocks, each a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4: pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
        elif kind == 0:
            break
    return out


def test_wandb_offline_run_has_the_scalars(tracked_run):
    files = list((tracked_run / "trackers" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    history = []
    for rec in _wandb_records(files[0]):
        if rec.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): item.value_json for item in rec.history.item})
    steps = [r for r in read_metrics(tracked_run) if r.get("event") == "weight_step"]
    logged = [h for h in history if "weight_step/accept_rate" in h]
    assert [float(h["weight_step/accept_rate"]) for h in logged] == pytest.approx([r["accept_rate"] for r in steps])
    assert [float(h["ledger/budget_rollouts"]) for h in logged] == [r["ledger"]["budget_rollouts"] for r in steps]
    assert any(k.startswith("lineage/") for h in history for k in h)  # the table, logged by reference
    tables = sorted(files[0].parent.glob("files/media/table/lineage_*.table.json"), key=lambda p: p.stat().st_mtime)
    table = json.loads(tables[-1].read_text())
    assert table["columns"][:3] == ["id", "parent", "mechanism"] and "h0" in [r[0] for r in table["data"]]


def test_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError, match="logging.trackers"):
        load_config(None, ["logging.trackers=[comet]"])


def test_missing_tracker_is_refused_before_the_run_dir_exists(tiny_model_dir, tmp_path, monkeypatch):
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("whale.tracking.importlib.util.find_spec", lambda name: None if name == "mlflow" else real(name))
    cfg = tiny_config(tiny_model_dir, **{"logging.trackers": "[mlflow]"})
    with pytest.raises(ConfigError, match="'mlflow' is not installed.*whale-opt\\[mlflow\\]"):
        run_experiment(cfg, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


class _Broken:
    calls = 0

    def log(self, scalars, rollouts, tokens):
        _Broken.calls += 1
        raise OSError("disk of the tracking server is full")

    def table(self, name, columns, rows):
        raise AssertionError("not reached: switched off after the first failure")

    def close(self):
        raise AssertionError("not reached")


def test_failing_tracker_warns_once_and_metrics_jsonl_keeps_every_row(tmp_path):
    run = RunDir.create(tmp_path / "run", load_config(None, []))
    run.trackers = Trackers({"broken": _Broken()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            run.log({"unit": f"w{step}", "event": "weight_step", "accept_rate": 0.5})
        run.log({"unit": "c0-accept", "event": "harness_accepted"})
        run.close()
    assert _Broken.calls == 1
    assert len([w for w in caught if "broken" in str(w.message)]) == 1
    assert "metrics.jsonl is unaffected" in str(caught[0].message)
    assert [r["accept_rate"] for r in read_metrics(run.path) if r.get("event") == "weight_step"] == [0.5] * 3


def test_eval_rows_give_per_source_scalars_and_ledger_axes():
    row = {"event": "eval", "split": "val", "k": 4, "n": 8, "mean_at_k": 0.25, "pass_at_k": 0.5, "errors": 1,
           "per_source": {"chain_sum": {"n": 4, "mean_at_k": 0.5, "pass_at_k": 1.0}}, "per_problem": [1.0, 0.0],
           "ledger": {"budget_rollouts": 96, "tokens": 5000, "llm_calls": 120}}
    s = row_scalars(row)
    assert s["eval/val/mean_at_k"] == 0.25 and s["eval/val/chain_sum/mean_at_k"] == 0.5
    assert s["ledger/budget_rollouts"] == 96 and s["ledger/tokens"] == 5000
    assert "eval/val/k" not in s and not any("per_problem" in k for k in s)


def test_mlflow_run_has_the_scalars(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = RunDir.create(tmp_path / "run", load_config(None, ["logging.trackers=[mlflow]"]))
    for step, rate in enumerate([0.25, 0.5]):
        run.ledger.rollouts["weight"] += 8
        run.log({"unit": f"w{step}", "event": "weight_step", "accept_rate": rate})
    run.log({"unit": "c0-h1", "event": "candidate", "id": "h1", "parent": "h0", "success_rate": 0.75})
    run.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{(run.path / 'trackers' / 'mlflow.db').resolve()}")
    found = client.search_runs([client.get_experiment_by_name("whale").experiment_id])
    history = client.get_metric_history(found[0].info.run_id, "weight_step/accept_rate")
    assert [(m.step, m.value) for m in history] == [(8, 0.25), (16, 0.5)]
    artifacts = [a.path for a in client.list_artifacts(found[0].info.run_id)]
    assert "lineage.json" in artifacts
    assert (run.path / "trackers" / "mlartifacts").is_dir() and not (Path.cwd() / "mlruns").exists()


def test_trackio_run_has_the_scalars(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    trackio = pytest.importorskip("trackio")
    if Path(trackio.TRACKIO_DIR) != tmp_path / "trackio":
        pytest.skip("trackio was imported earlier with another TRACKIO_DIR")
    from trackio.sqlite_storage import SQLiteStorage

    run = RunDir.create(tmp_path / "run", load_config(None, ["logging.trackers=[trackio]", "name=tr"]))
    for step, rate in enumerate([0.25, 0.5]):
        run.ledger.rollouts["weight"] += 8
        run.log({"unit": f"w{step}", "event": "weight_step", "accept_rate": rate})
    run.log({"unit": "c0-h1", "event": "candidate", "id": "h1", "parent": "h0", "success_rate": 0.75})
    run.close()
    logs = SQLiteStorage.get_logs("whale", f"tr-{tracker_run_id(run.path)}")
    rates = [(r["ledger/budget_rollouts"], r["weight_step/accept_rate"]) for r in logs if "weight_step/accept_rate" in r]
    assert rates == [(8, 0.25), (16, 0.5)]
    tables = [r["lineage"]["_value"] for r in logs if "lineage" in r]
    assert tables and tables[-1][0]["id"] == "h1" and tables[-1][0]["success_rate"] == 0.75
