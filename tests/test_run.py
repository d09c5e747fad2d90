"""End to end: schedules through `whale run`, reports, compare (resume after SIGKILL: test_resume.py)."""

import json
import os
import shutil
from pathlib import Path

import pytest
from toy import H0

from whale.config import ConfigError, load_config
from whale.compare import compare_runs
from whale.report import write_report
from whale.run import check_proposer, run_experiment
from whale.store import load_summary, read_metrics

TESTS = Path(__file__).resolve().parent


def tiny_config(model_dir, **over):
    sets = [
        # float32: the same run shape (steps, phases, evaluations the kill points of test_resume aim
        # at) on machines with and without bf16 matmuls; bf16 runs are exact too under the default
        # runner.lockstep (test_lockstep.py, test_cli.py's bf16 reproduction)
        f"model.name={model_dir}", "model.dtype=float32", "model.max_model_len=480", "domain.module=toy:ParityDomain",
        "domain.splits.weight=16", "domain.splits.harness=4", "domain.splits.val=4", "domain.splits.test=4",
        "domain.budget.seconds=20", "sampling.max_tokens=8", "weight.problems_per_step=4",
        "weight.samples_per_problem=2", "weight.mini_batch_trajectories=4", "harness.candidates_per_iteration=1",
        "harness.null_probe_items=4", "harness.reject_flagged=false", "eval.k=2", "eval.every_steps=0",
        "schedule.weight_epochs=0.5", "schedule.harness_iterations=2", "schedule.budget_epochs=1.0",
        "runner.concurrency=8", "runner.grader_processes=1",
    ] + [f"{k}={v}" for k, v in over.items()]
    return load_config(None, sets)


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def events(run_dir):
    return [r.get("event") for r in read_metrics(run_dir)]


def test_every_steps_evaluations_continue_in_an_extended_weight_phase(tiny_model_dir, tmp_path):
    """After the first 1-step weight phase the 39-rollout budget has no room for a harness phase,
    so the phase goes on step by step (`weight_more`) to the end of the budget; the evaluations
    every 2 steps must go on with it (they used to stop: docs/results/cmp_h64, `gain`)."""
    cfg = tiny_config(tiny_model_dir, **{"schedule.kind": "whale", "schedule.weight_epochs": 0.25,
                                         "schedule.budget_epochs": "null", "schedule.budget_rollouts": 39,
                                         "eval.every_steps": 2, "eval.intermediate_splits": "[val]"})
    run_dir = run_experiment(cfg, out=tmp_path / "extended")
    rows = read_metrics(run_dir)
    steps = [r for r in rows if r.get("event") == "weight_step"]
    assert len(steps) == 5 and not [r for r in rows if r.get("event") == "harness_accepted"]
    evals = {r.get("tag") for r in rows if r.get("event") == "eval" and r.get("split") == "val"}
    assert {"w2", "w4"} <= evals, evals


def test_whale_schedule_runs_end_to_end(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir)
    run_dir = run_experiment(cfg, out=tmp_path / "whale")
    rows = read_metrics(run_dir)
    phases = []
    for r in rows:
        p = "W" if r.get("event") == "weight_step" else "H" if r.get("event") == "iteration_end" else None
        if p and (not phases or phases[-1] != p):
            phases.append(p)
    assert phases == ["W", "H", "W"]
    state = json.loads((run_dir / "state.json").read_text())
    assert state["phase"] == "done"
    led = state["ledger"]
    steps = [r for r in rows if r.get("event") == "weight_step"]
    assert len(steps) == 4 and led["rollouts"]["weight"] == 4 * 4 * 2
    assert led["rollouts"]["rescore"] == 4  # re-scoring of the incoming harness: 4 harness problems
    assert led["budget_rollouts"] == led["rollouts"]["weight"] + led["rollouts"].get("harness", 0) + 4 + \
        led["rollouts"].get("confirm", 0)  # confirmation re-runs count (harness/acceptance.py)
    trained = [r for r in steps if r["weights_version"]]
    assert trained, "the parity grader accepts about half of the samples, so some steps must train"
    assert state["weights_version"] == trained[-1]["weights_version"]
    assert (run_dir / "weights" / state["weights_version"] / "adapter_config.json").exists()
    evals = [r for r in rows if r.get("event") == "eval"]
    assert evals[0]["tag"] == "initial"
    # the run ends measured: the last evaluation is of the final (harness, weights) pair
    assert (evals[-1]["harness"], evals[-1]["weights_version"]) == (state["harness_id"], state["weights_version"])
    report = write_report(run_dir)
    text = report.read_text()
    assert "val-selected" in text and "| weight |" in text
    assert (run_dir / "report" / "accuracy_vs_rollouts.png").stat().st_size > 1000
    s = load_summary(run_dir)
    assert s["final"] is not None and s["best"] >= s["final"]


def test_weight_only_and_harness_only_and_compare(tiny_model_dir, tmp_path):
    wo = run_experiment(tiny_config(tiny_model_dir, **{"schedule.kind": "weight_only"}), out=tmp_path / "wo")
    assert "iteration_end" not in events(wo) and events(wo).count("weight_step") == 4
    ho = run_experiment(tiny_config(tiny_model_dir, **{"schedule.kind": "harness_only",
                                                       "schedule.harness_iterations": 2}), out=tmp_path / "ho")
    assert "weight_step" not in events(ho) and events(ho).count("iteration_end") == 2
    state = json.loads((ho / "state.json").read_text())
    assert state["weights_version"] == "base"
    md = compare_runs([wo, ho], tmp_path / "cmp").read_text()
    assert "weight_only" in md and "harness_only" in md and "paired bootstrap" in md
    assert "against **harness_only**" in compare_runs([wo, ho], tmp_path / "cmp2", references=["harness_only"]).read_text()
    with pytest.raises(ConfigError, match="names no method of these runs.*weight_only, harness_only"):
        compare_runs([wo, ho], tmp_path / "cmp3", references=["harness-only"])  # a typo is an error, not a missing table
    per_seed = md.split("Per seed")[1].splitlines()
    ho_row = next(line for line in per_seed if line.startswith("| harness_only |"))
    wo_row = next(line for line in per_seed if line.startswith("| weight_only |"))
    assert ", base)" in ho_row and "(h0, w" in wo_row  # what each run ended with: frozen weights / h0 kept

    killed = tmp_path / "wo_killed"  # the same run as if killed before its end
    shutil.copytree(wo, killed)
    state = json.loads((killed / "state.json").read_text())
    (killed / "state.json").write_text(json.dumps({**state, "finished": False}))
    left_out = compare_runs([wo, ho, killed], tmp_path / "cmp4").read_text()
    assert "Unfinished runs, left out" in left_out and "`wo_killed`" in left_out
    assert next(ln for ln in left_out.splitlines() if ln.startswith("| weight_only | ")).split(" | ")[1] == "1"
    included = compare_runs([wo, ho, killed], tmp_path / "cmp5", partial=True).read_text()
    assert next(ln for ln in included.splitlines() if ln.startswith("| weight_only | ")).split(" | ")[1] == "2"
    assert "(unfinished)" in included.split("Per seed")[1]
    with pytest.raises(ConfigError, match="none of the 1 runs has finished"):
        compare_runs([killed], tmp_path / "cmp6")
    assert "**unfinished**" in write_report(killed).read_text()
    assert "unfinished" not in write_report(wo).read_text()


def test_resume_refuses_changed_config(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, **{"schedule.kind": "weight_only", "schedule.budget_epochs": 0.25})
    run_dir = run_experiment(cfg, out=tmp_path / "r")
    changed = tiny_config(tiny_model_dir, **{"schedule.kind": "weight_only", "weight.lr": 0.5})
    with pytest.raises(ConfigError, match="differs"):
        run_experiment(changed, resume=run_dir)
    with pytest.raises(ConfigError, match="already holds a run"):
        run_experiment(cfg, out=run_dir)


def test_run_can_start_from_a_user_harness(tiny_model_dir, tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(H0.replace("You add numbers.", "You add numbers carefully."))
    run_dir = run_experiment(tiny_config(tiny_model_dir, **{"schedule.kind": "weight_only",
                                                            "schedule.budget_epochs": 0.25,
                                                            "harness.initial": str(path)}), out=tmp_path / "u")
    steps = [r for r in read_metrics(run_dir) if r.get("event") == "weight_step"]
    assert steps and all(r["harness"] == "h1" for r in steps)
    meta = json.loads((run_dir / "harnesses" / "h1" / "meta.json").read_text())
    assert meta["parent"] == "h0" and meta["proposer"] == "user"
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy\ndef run(env, llm):\n    pass\n")  # not an allowed import
    with pytest.raises(ConfigError, match="harness.initial"):
        run_experiment(tiny_config(tiny_model_dir, **{"harness.initial": str(bad)}), out=tmp_path / "b")


def test_intermediate_splits_spare_test_between_the_first_and_the_last_evaluation(tiny_model_dir, tmp_path):
    """eval.intermediate_splits=[val]: val at every phase end, test only at the start and at the run's end."""
    cfg = tiny_config(tiny_model_dir, **{"eval.intermediate_splits": "[val]"})
    run_dir = run_experiment(cfg, out=tmp_path / "run")
    evals = [(r["split"], r["tag"]) for r in read_metrics(run_dir) if r.get("event") == "eval"]
    test_tags = [t for s, t in evals if s == "test"]
    val_tags = [t for s, t in evals if s == "val"]
    assert test_tags[0] == "initial" and len(test_tags) == 2, evals
    assert test_tags[-1] == val_tags[-1] != "initial"  # the run's last evaluation measured test too
    assert len(val_tags) >= 3  # initial, after the weight phase, ..., the end


def test_a_proposer_this_machine_cannot_run_fails_the_run_before_anything_starts(tiny_model_dir, tmp_path, monkeypatch):
    """A missing agent CLI is a config error at `whale run`, not a crash at the first harness phase,
    and it leaves no run directory behind (the fixed config starts the run afresh)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no `claude` on PATH
    cfg = tiny_config(tiny_model_dir, **{"harness.proposer": "agent_cli", "harness.agent": "claude_code",
                                         "harness.agent_sandbox": "none"})
    with pytest.raises(ConfigError, match="needs the `claude` CLI on PATH"):
        run_experiment(cfg, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    cfg.schedule.kind = "weight_only"  # never proposes: the same settings do not stop it
    check_proposer(cfg)


def _compare_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_script", TESTS.parent / "scripts" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_script_keeps_records_that_outlive_the_run_dirs(tiny_model_dir, tmp_path, monkeypatch):
    """scripts/compare.py --report copies each finished run's record; a later rerun on a machine
    without the run directory counts the recorded run as done and still compares it."""
    import argparse
    import shutil

    from whale.config import dump_config

    script = _compare_script()
    out, report = tmp_path / "runs", tmp_path / "docs"
    base = tmp_path / "base.yaml"
    base.write_text(dump_config(tiny_config(tiny_model_dir, **{"schedule.budget_epochs": 0.25})))
    args = argparse.Namespace(out=str(out), report=str(report), methods=["weight_only", "gain"], seeds=[0],
                              config=str(base), set=[])
    run_experiment(script.planned_config("weight_only-s0", args), out=out / "weight_only-s0")
    first = script.compare(args).read_text()
    record = report / "runs" / "weight_only-s0"
    assert sorted(p.name for p in record.iterdir()) == sorted(script.RECORD_FILES)
    assert sum(p.stat().st_size for p in record.iterdir()) < 200_000  # small enough to commit
    shutil.rmtree(out)  # later, on a fresh machine: only the records, from git
    monkeypatch.setattr(script.subprocess, "call", lambda *a, **k: pytest.fail("a recorded run was run again"))
    assert script.run_one("weight_only", 0, args)
    assert script.status_line("weight_only-s0", args) == "done (record)"
    assert script.status_line("gain-s0", args) == "not started"
    again = script.compare(args).read_text()
    assert "| weight_only | 1 |" in again and again == first
    (report / "compare.md").unlink()
    script.main(["--config", str(base), "--out", str(out), "--report", str(report), "--methods", "weight_only",
                 "gain", "--seeds", "0", "--compare-only"])  # gain-s0 is not started: it is not run either
    assert (report / "compare.md").read_text() == first
    # a record made with another config is another experiment: it does not count as done
    other = argparse.Namespace(**{**vars(args), "set": ["weight.lr=0.001"]})
    assert script.record_of("weight_only-s0", other) is None
    assert script.status_line("weight_only-s0", other) == "not started"
    # --code-since: a record made by code older than the given commit is redone (same config)
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=TESTS.parent, capture_output=True, text=True).stdout.strip()
    parent = subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=TESTS.parent, capture_output=True, text=True).stdout.strip()
    if not head or not parent:
        return  # not a git checkout with history
    env_path = record / "environment.json"
    env = json.loads(env_path.read_text())
    for made, counts in ((head, True), (head + "+dirty", True), (parent, False), (None, False)):
        env_path.write_text(json.dumps({**env, "whale_commit": made}))
        since = argparse.Namespace(**{**vars(args), "code_since": head})
        assert (script.record_of("weight_only-s0", since) is not None) == counts, made
    since = argparse.Namespace(**{**vars(args), "code_since": parent})
    env_path.write_text(json.dumps({**env, "whale_commit": head}))
    assert script.record_of("weight_only-s0", since) == record  # made after the commit: counts
    with pytest.raises(SystemExit, match="not a commit"):  # a typo would otherwise redo every record
        script.main(["--config", str(base), "--out", str(out), "--report", str(report), "--methods", "weight_only",
                     "--seeds", "0", "--status", "--code-since", "f" * 40])


def test_comparison_records_are_not_ignored_by_git():
    """Records are kept "for committing" (scripts/compare.py --report): until 2026-12-02 the
    repository's `runs/` ignore pattern also matched docs/results/*/runs/, so none was committed."""
    import shutil
    import subprocess

    root = TESTS.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs the git checkout")
    record = "docs/results/cmp_new/runs/gain-s0/metrics.jsonl"
    ignored = subprocess.run(["git", "check-ignore", "-q", record], cwd=root).returncode == 0
    assert not ignored, f"{record} would be ignored by git"
    assert subprocess.run(["git", "check-ignore", "-q", "runs/gain-s0/metrics.jsonl"], cwd=root).returncode == 0


def test_compare_script_keeps_a_record_as_soon_as_its_run_ends(tiny_model_dir, tmp_path, monkeypatch):
    """The machine can go away during a later run of the batch: each run's record is copied when that
    run ends, not when the whole batch does."""
    import argparse

    from whale.config import dump_config

    script = _compare_script()
    out, report = tmp_path / "runs", tmp_path / "docs"
    base = tmp_path / "base.yaml"
    base.write_text(dump_config(tiny_config(tiny_model_dir, **{"schedule.budget_epochs": 0.25})))
    args = argparse.Namespace(out=str(out), report=str(report), methods=["weight_only"], seeds=[0],
                              config=str(base), set=[])

    def run_in_process(cmd, cwd=None):  # what `python -m whale.cli run ...` would do, in process
        run_experiment(script.planned_config("weight_only-s0", args), out=out / "weight_only-s0")
        return 0

    monkeypatch.setattr(script.subprocess, "call", run_in_process)
    assert script.run_one("weight_only", 0, args)
    assert script.record_of("weight_only-s0", args) == report / "runs" / "weight_only-s0"
    # killed in its final evaluation: the phase is "done" but the run is not finished, so it is
    # resumed and its record (without the final test) is not kept as done
    state_path = out / "weight_only-s0" / "state.json"
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({**state, "finished": None, "pending_eval": {"tag": "w4", "last": True}}))
    assert state["phase"] == "done" and script.run_state(out / "weight_only-s0") == "partial"


def test_val_best_pair_is_measured_on_test_at_the_end(tiny_model_dir, tmp_path, monkeypatch):
    """The val-selected column needs a test number at the val-best (harness, weights). When val
    peaks at an intermediate evaluation that measures val only, the run ends by restoring those
    weights and evaluating test under them (event eval_selected); the final-vs-final numbers stay."""
    import dataclasses

    import whale.evaluate as evaluate_module

    real, val_calls = evaluate_module.evaluate, []

    def evaluate_with_a_val_peak(*args, split="test", **kw):
        result, trajs = real(*args, split=split, **kw)
        if split == "val":
            val_calls.append(1)
            if len(val_calls) == 3:  # the evaluation after weight step 2 becomes the val-best
                result = dataclasses.replace(result, mean_at_k=2.0)
        return result, trajs

    monkeypatch.setattr(evaluate_module, "evaluate", evaluate_with_a_val_peak)
    cfg = tiny_config(tiny_model_dir, **{"schedule.kind": "weight_only", "eval.every_steps": 1,
                                         "eval.intermediate_splits": "[val]"})
    run_dir = run_experiment(cfg, out=tmp_path / "wo")
    state = json.loads((run_dir / "state.json").read_text())
    best = state["val_best"]
    assert best["mean_at_k"] == 2.0 and best["weights_version"] != state["weights_version"]
    rows = read_metrics(run_dir)
    selected = [r for r in rows if r.get("event") == "eval_selected"]
    assert [(r["split"], r["harness"], r["weights_version"]) for r in selected] == \
        [("test", best["harness_id"], best["weights_version"])]
    traces = [json.loads(line) for line in (run_dir / "evals" / "eval-val_best-test.jsonl").open()]
    assert len(traces) == 4 * 2 and {t["weights_version"] for t in traces} == {best["weights_version"]}
    s = load_summary(run_dir)
    final_test = [r for r in rows if r.get("event") == "eval" and r.get("split") == "test"][-1]
    assert s["val_selected"] == selected[0]["mean_at_k"] and s["final"] == final_test["mean_at_k"]
    assert (run_dir / "weights" / best["weights_version"]).exists()
    # a resumed finished run does not measure it again
    run_experiment(None, resume=run_dir)
    assert len([r for r in read_metrics(run_dir) if r.get("event") == "eval_selected"]) == 1
