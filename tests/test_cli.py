"""The `whale` command line: eval reproduces a run's evaluation, the harness contract, the hub policy."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_run import tiny_config
from whale.cli import app, hub_offline
from whale.config import load_config
from whale.run import run_experiment
from whale.store import read_metrics

TESTS = Path(__file__).resolve().parent
BARE_HARNESS = "def run(env, llm):\n    env.submit(str(llm([{'role': 'user', 'content': env.question}])))\n"


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))  # the toy domain of tiny_config
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def whale(*args):
    """Run `whale ARGS --json` in-process; the summary from the last line of stdout."""
    result = CliRunner().invoke(app, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, tmp_path_factory):
    """A WHALE run (weight phase, harness phase, weight phase) with evaluations on val and test."""
    return run_experiment(tiny_config(tiny_model_dir), out=tmp_path_factory.mktemp("cli") / "run")


def eval_rows(run_dir, split):
    return [r for r in read_metrics(run_dir) if r.get("event") == "eval" and r["split"] == split]


def assert_same_numbers(summary, row):
    assert summary["per_problem"] == row["per_problem"]
    assert (summary["mean_at_k"], summary["pass_at_k"], summary["n"], summary["k"], summary["rollouts"]) == \
        (row["mean_at_k"], row["pass_at_k"], row["n"], row["k"], row["rollouts"])


def test_eval_on_a_run_reproduces_its_final_evaluation(tiny_run):
    state = json.loads((tiny_run / "state.json").read_text())
    final = eval_rows(tiny_run, "test")[-1]
    hid, version = final["harness"], final["weights_version"]
    assert (hid, version) == (state["harness_id"], state["weights_version"]) and version.startswith("w")
    assert 0 < sum(final["per_problem"]) < len(final["per_problem"])  # rewards vary: a real comparison
    summary = whale("eval", "--run", tiny_run, "--harness", hid, "--weights", version, "--split", "test")
    assert_same_numbers(summary, final)
    assert (summary["harness_id"], summary["weights_version"]) == (hid, version)
    # the same from explicit paths: the run's config file, harness file and weights folder
    by_path = whale("eval", "--config", tiny_run / "config.yaml", "--harness",
                    tiny_run / "harnesses" / hid / "harness.py", "--weights", tiny_run / "weights" / version)
    assert_same_numbers(by_path, final)


def test_eval_reproduces_a_bf16_run_bit_for_bit(tiny_model_dir, tmp_path):
    """In bf16 a sample depends on its batch-mates' shapes; runner.lockstep (the default) makes the
    batches a function of the episodes, so a re-evaluation draws exactly the run's tokens."""
    run = run_experiment(tiny_config(tiny_model_dir, **{"model.dtype": "bfloat16", "schedule.kind": "weight_only",
                                                        "schedule.budget_epochs": 0.5}), out=tmp_path / "bf16")
    final = eval_rows(run, "test")[-1]
    assert final["weights_version"].startswith("w")
    summary = whale("eval", "--run", run, "--harness", final["harness"], "--weights", final["weights_version"],
                    "--split", "test", "--out", tmp_path / "again")
    assert_same_numbers(summary, final)
    assert summary["lockstep_breaks"] == final["lockstep_breaks"] == 0  # both batches reproducible

    def completions(path):
        trajs = sorted((json.loads(line) for line in path.read_text().splitlines()),
                       key=lambda t: (t["problem_id"], t["sample"]))
        return [[c["completion"] for c in t["calls"]] for t in trajs]

    recorded = completions(run / "evals" / f"{final['unit']}.jsonl")
    assert len(recorded) == summary["rollouts"] and completions(tmp_path / "again" / "traces.jsonl") == recorded


def test_eval_on_a_run_reproduces_its_initial_evaluation(tiny_run):
    initial = next(r for r in eval_rows(tiny_run, "val") if r["tag"] == "initial")
    assert (initial["harness"], initial["weights_version"]) == ("h0", "base")
    assert_same_numbers(whale("eval", "--run", tiny_run, "--split", "val"), initial)


def test_eval_refuses_what_it_cannot_find(tiny_run):
    for args, message in [(["--run", tiny_run, "--weights", "w99"], "weights folder not found: w99"),
                          (["--run", tiny_run, "--harness", "h99"], "harness not found: h99"),
                          (["--run", tiny_run, "--config", tiny_run / "config.yaml"], "drop --config"),
                          (["--run", tiny_run / "harnesses"], "not a run directory")]:
        result = CliRunner().invoke(app, ["eval", *map(str, args)])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_eval_accepts_a_harness_that_defines_only_run(tiny_model_dir, tmp_path):
    path = tmp_path / "bare.py"
    path.write_text(BARE_HARNESS)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("")  # an empty config file: defaults, then --set
    summary = whale("eval", "--config", cfg, "--harness", path, "--k", 1, "--limit", 2,
                    "--set", f"model.name={tiny_model_dir}", "--set", "domain.module=toy:ParityDomain",
                    "--set", "model.max_model_len=480", "--set", "sampling.max_tokens=8")
    assert summary["n"] == 2 and summary["rollouts"] == 2 and summary["errors"] == 0
    assert summary["harness_id"] == "bare"


def test_eval_names_a_setting_the_domain_ignores():
    result = CliRunner().invoke(app, ["eval", "--set", "domain.data_path=data/nq.jsonl"])
    assert result.exit_code == 2
    assert "domain.data_path is read only with domain.source: searchr1" in " ".join(result.output.split())


@pytest.mark.parametrize("sets, offline", [
    ([], True),  # the embedded default: SmolLM2 from a PyPI package, Factbook questions
    (["model.name=SmolLM2-135M-Instruct"], True),
    (["model.name=Qwen/Qwen3.5-2B"], False),  # a hub id must be free to download
    (["model.name=/models/local-folder"], False),
    (["domain.source=searchr1", "domain.data_path=PeterJinGo/nq_hotpotqa_train", "domain.retriever_url=http://x"],
     False),  # an HF dataset id
    (["domain.module=examples.custom_domain:UnitsDomain"], False),  # a user domain may load what it likes
])
def test_hub_is_forced_offline_only_for_the_embedded_default(sets, offline):
    assert hub_offline(load_config(None, sets)) is offline


def test_run_takes_its_config_as_an_argument_or_as_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("harness:\n  confirm_round: 3\n")
    for args in (["run", str(bad)], ["run", "--config", str(bad)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "did you mean 'confirm_rounds'" in " ".join(result.output.split()), result.output
    result = CliRunner().invoke(app, ["run", str(bad), "--config", str(tmp_path / "other.yaml")])
    assert result.exit_code == 2 and "two configs given" in " ".join(result.output.split()), result.output
