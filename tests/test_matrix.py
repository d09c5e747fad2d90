"""`whale matrix`: every accepted harness under every kept weights version, on tiny runs."""

import json
import os
import shutil
from pathlib import Path

import pytest

from whale.config import ConfigError
from whale.matrix import Matrix, build_matrix, decompose, read_run
from whale.harness.archive import Archive
from whale.report import write_report
from whale.run import run_experiment
from whale.store import read_metrics
from test_run import tiny_config

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """One WHALE run (W -> H -> W) and one harness-only run of the toy domain, built once."""
    root = tmp_path_factory.mktemp("matrix-runs")
    whale = run_experiment(tiny_config(tiny_model_dir), out=root / "whale")
    ho = run_experiment(tiny_config(tiny_model_dir, **{"schedule.kind": "harness_only",
                                                       "schedule.budget_rollouts": 12}), out=root / "ho")
    return whale, ho


def _copy(run: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(run, dst)
    return dst


def _ledger_eval(run: Path) -> int:
    return json.loads((run / "state.json").read_text())["ledger"]["rollouts"].get("eval", 0)


def test_matrix_covers_every_pair_reuses_the_runs_cells_and_counts_the_rest(runs, tmp_path):
    run = _copy(runs[0], tmp_path, "whale")
    state = json.loads((run / "state.json").read_text())
    before = _ledger_eval(run)
    m = Matrix(run, split="test")
    assert [w.label for w in m.weights][0] == "base" and len(m.weights) >= 2  # base + each phase's end
    assert m.weights[-1].label == state["weights_version"]
    m.compute(progress=False)
    md = m.write()
    assert md.is_file() and (run / "matrix" / "matrix.png").stat().st_size > 0
    assert len(m.cells) == len(m.harnesses) * len(m.weights)
    # the run evaluated (h0, base) at its start: that cell is reused, identical, and costs nothing
    initial = next(r for r in read_metrics(run) if r.get("event") == "eval" and r.get("split") == "test")
    cell = m.cell(initial["harness"], initial["weights_version"])
    assert cell["reused"] and cell["rollouts"] == 0 and cell["per_problem"] == initial["per_problem"]
    computed = [c for c in m.cells.values() if not c["reused"]]
    assert computed, "a W -> H -> W run leaves pairs it never measured"
    assert _ledger_eval(run) == before + sum(c["rollouts"] for c in computed)
    assert all(c["rollouts"] == 4 * 2 for c in computed)  # 4 test problems x k=2
    text = md.read_text()
    for part in ("harness alone", "weights alone", "interaction"):
        assert part in text


def test_matrix_resumes_with_the_cells_it_has(runs, tmp_path, monkeypatch):
    run = _copy(runs[0], tmp_path, "whale")
    build_matrix(run, progress=False)
    ledger = _ledger_eval(run)
    lines = (run / "matrix" / "cells.jsonl").read_text().splitlines()
    # a rerun computes nothing new
    build_matrix(run, progress=False)
    assert (run / "matrix" / "cells.jsonl").read_text().splitlines() == lines
    assert _ledger_eval(run) == ledger
    # a kill before the last cell was stored: that cell alone is redone, and counted once
    last = json.loads(lines[-1])
    (run / "matrix" / "cells.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    build_matrix(run, progress=False)
    redone = [json.loads(x) for x in (run / "matrix" / "cells.jsonl").read_text().splitlines()]
    assert len(redone) == len(lines) and redone[-1]["per_problem"] == last["per_problem"]
    assert _ledger_eval(run) == ledger


def test_a_computed_cell_reproduces_the_runs_own_measurement(runs, tmp_path, monkeypatch):
    """Same seeds and sampling as the run: evaluating a pair the run measured gives its numbers."""
    run = _copy(runs[0], tmp_path, "whale")
    monkeypatch.setattr(Matrix, "_reusable", lambda self, h, w: None)
    m = Matrix(run)
    m.compute(progress=False)
    for r in read_metrics(run):
        if r.get("event") == "eval" and r.get("split") == "test":
            assert m.cell(r["harness"], r["weights_version"])["per_problem"] == r["per_problem"]


def test_with_adds_another_runs_harnesses_and_report_includes_the_matrix(runs, tmp_path):
    run, ho = _copy(runs[0], tmp_path, "whale"), _copy(runs[1], tmp_path, "ho")
    m = Matrix(run, others=[ho])
    labels = [h.label for h in m.harnesses]
    mine, theirs = Archive(run), Archive(ho)
    main_code = {mine.meta(h)["code_hash"] for h in read_run(run).harnesses}
    new_code = [f"ho:{h}" for h in read_run(ho).harnesses if theirs.meta(h)["code_hash"] not in main_code]
    assert labels == read_run(run).harnesses + new_code  # the same h0 code is one row, not two
    assert [w.label for w in m.weights].count("base") == 1  # one base column for the shared model
    m.compute(progress=False)
    m.write()
    report = write_report(run).read_text()
    assert "## Harness x weights matrix" in report and "| h0 |" in report
    page = (run / "report" / "report.html").read_text()  # the page shows it too, heatmap inline
    assert '<section id="matrix">' in page and "<td>h0</td>" in page and 'src="data:image/png;base64,' in page


def test_bad_inputs_get_one_clear_error(runs, tmp_path):
    with pytest.raises(ConfigError, match="no weights kept"):
        Matrix(runs[1])  # harness-only: nothing trained
    other = _copy(runs[0], tmp_path, "other")
    state = json.loads((other / "state.json").read_text())
    state["model_fingerprint"] = {"model.safetensors": "0" * 64}
    (other / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="another base model"):
        Matrix(runs[0], others=[other])
    with pytest.raises(ConfigError, match="not a run directory"):
        Matrix(tmp_path)
    pruned = _copy(runs[0], tmp_path, "pruned")
    shutil.rmtree(pruned / "weights")
    with pytest.raises(ConfigError, match="no weights kept"):
        Matrix(pruned)


def test_decomposition_is_the_difference_of_differences():
    h0_base, hf_base, h0_wf, hf_wf = [0.0, 0.0, 0.5, 0.0], [0.5, 0.0, 0.5, 0.5], [0.5, 0.5, 0.5, 0.0], [1.0, 1.0, 1.0, 0.5]
    d = decompose(h0_base, hf_base, h0_wf, hf_wf)
    assert d["harness alone"]["value"] == pytest.approx(0.25)
    assert d["weights alone"]["value"] == pytest.approx(0.25)
    assert d["total"]["value"] == pytest.approx(0.875 - 0.125)
    assert d["interaction"]["value"] == pytest.approx(0.75 - 0.25 - 0.25)
    lo, hi = d["total"]["ci95"]
    assert lo <= 0.75 <= hi
    with pytest.raises(ValueError):
        decompose([0.0], [0.0, 1.0], [0.0], [0.0])
