"""Resume after SIGKILL at every window that matters (docs/design.md, "Resume units").

Each scenario kills `whale run` at named points (the WHALE_TEST_KILL_AT hook, so every cut is
deterministic), resumes it after each kill, and compares the finished run with an unkilled one of
the same config: the same weight steps, harness phases, evaluations (units, tags, values), budget
rollouts, archive, and final (harness, weights), down to the bytes of the final weights.

All runs are forked from one warm process (tests/kill_lab.py) and the scenarios run side by side,
one per core, when the module's first test asks for them.
"""

import hashlib
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
from test_run import tiny_config

from whale.config import dump_config
from whale.store import BUDGET_PURPOSES, read_metrics

TESTS = Path(__file__).resolve().parent

# 4 weight steps in two phases of 2 (w0 w1 | harness c0: rescore + 1 proposal | w2 w3), an
# every-3-steps evaluation (eval-w3) besides those at the phase ends, and no spare weights versions
# kept, so pruning deletes old versions during the run. One episode at a time: a sample is a function
# of its seed only when its batch is too (BLAS sums a row differently in batches of other shapes,
# and which episodes share a batch depends on timing), and the comparison below is exact.
# With 4 harness problems no paired test reaches p <= 0.05 (its least p-value is 1/16): alpha 1 and no
# confirmation re-run make acceptance "a positive gain on the selection traces", so the harness
# phase replaces h0 and its phase-end evaluation runs. Two candidates (a majority vote, which the
# proposer tries first under trained weights, and a system-prompt rewrite, which wins here): the
# shape then does not hang on which of the two the proposer orders first.
WHALE = {"eval.every_steps": 3, "weight.keep_versions": 0, "runner.concurrency": 1,
         "harness.accept_alpha": 1.0, "harness.confirm_top": 0, "harness.candidates_per_iteration": 2}
# weight-only full fine-tuning: keep_versions (LoRA only) must not keep old full checkpoints
FULL = {"schedule.kind": "weight_only", "weight.finetune": "full", "weight.keep_versions": 2,
        "eval.every_steps": 2, "runner.concurrency": 1}

BOUNDARIES = [
    "eval@eval-w2-val",     # in the evaluation that closes a weight phase (resumed into an extra step)
    "eval@eval-c0-h-test",  # in the evaluation after a harness phase's last iteration (ran a new phase)
    "eval@eval-w3-val",     # in an every_steps evaluation (was never redone)
    "candidate@c0-h2",      # a candidate's scores recorded, the state not saved (its rollouts left the budget)
]
MANY = [
    "rows@w1",              # the rollouts of a phase's last step on disk, killed before training
    "weight_step@w1",       # that step's row written, its state (and the phase end) not saved
    "prune",                # the state naming w1 saved, w0 about to be deleted
    "rescore@c0-h1",        # the incoming harness re-scored, the state not saved
    "proposals@c0-h2",      # proposals archived, not yet saved as pending (would be proposed again)
    "accept@c0-h2",         # the phase's acceptance logged, the phase end not saved
    "weight_step@w3",       # the last step: the run's end not saved
    "run_end@end",          # everything done but the final state
]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Every scenario's run directory and kill log, run once for the module."""
    tmp = tmp_path_factory.mktemp("resume")
    configs = {}
    for name, over in (("whale", WHALE), ("full", FULL)):
        configs[name] = tmp / f"{name}.yaml"
        configs[name].write_text(dump_config(tiny_config(tiny_model_dir, **over)))
    scenarios = {"whale": ("whale", []), "full": ("full", []), "full-prune": ("full", ["prune"]),
                 "many": ("whale", MANY), **{p: ("whale", [p]) for p in BOUNDARIES}}
    chains = {name: {"config": str(configs[cfg]), "out": str(tmp / name.replace("@", "-")), "points": points}
              for name, (cfg, points) in scenarios.items()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    lab = subprocess.Popen([sys.executable, str(TESTS / "kill_lab.py")], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env)
    try:
        lab.stdin.write(json.dumps({"chains": chains, "parallel": min(2, os.cpu_count() or 1)}) + "\n")
        lab.stdin.flush()
        ready, _, _ = select.select([lab.stdout], [], [], 1200)
        assert ready, "the resume scenarios did not finish in 20 minutes"
        answers = json.loads(lab.stdout.readline())
    finally:
        lab.stdin.close()
        lab.wait(timeout=60)
    return {name: (Path(chains[name]["out"]), answers[name]) for name in chains}


def finished(runs, name: str) -> Path:
    """The run dir of scenario `name`, after checking that every kill hit and the last resume finished."""
    out, steps = runs[name]
    log = Path(f"{out}.log").read_text()[-3000:] if Path(f"{out}.log").exists() else ""
    for step in steps[:-1]:
        assert step["killed"], f"{name}: never reached kill point {step['kill_at']!r}\n{log}"
    assert len(steps) == len(runs[name][1]) and steps[-1]["kill_at"] is None and steps[-1]["code"] == 0, \
        f"{name}: {steps}\n{log}"
    return out


def outcome(run_dir: Path) -> dict:
    """Everything a killed and resumed run must share with an unkilled one."""
    rows = read_metrics(run_dir)
    state = json.loads((run_dir / "state.json").read_text())
    final = hashlib.sha256()
    for f in sorted((run_dir / "weights" / state["weights_version"]).glob("*.safetensors")):
        final.update(f.read_bytes())
    archive = {}
    for meta in sorted((run_dir / "harnesses").glob("h*/meta.json")):
        m = json.loads(meta.read_text())
        scores = meta.parent / "scores.json"
        archive[m["id"]] = (m["status"], m["code_hash"], json.loads(scores.read_text()) if scores.exists() else None)
    return {
        "finished": (state["phase"], state.get("finished"), state.get("pending_eval")),
        "steps": [(r["step"], r["weights_version"], r["rollouts"], r["accepted"], r["rows"])
                  for r in rows if r["event"] == "weight_step"],
        "harness_phases": [(r["unit"], r["accepted"], r["iterations"]) for r in rows if r["event"] == "harness_accepted"],
        "evals": sorted((r["unit"], r["tag"], r["harness"], r["weights_version"], r["mean_at_k"])
                        for r in rows if r["event"] == "eval"),
        "budget": {p: state["ledger"]["rollouts"].get(p, 0) for p in BUDGET_PURPOSES},
        "final": (state["harness_id"], state["weights_version"], final.hexdigest()),
        "val_best": state.get("val_best"),
        "archive": archive,
        "weights_on_disk": sorted(d.name for d in (run_dir / "weights").iterdir()),
    }


@pytest.fixture(scope="module")
def unkilled(runs):
    result = outcome(finished(runs, "whale"))
    # the shape the kill points rely on
    assert [s[0] for s in result["steps"]] == [0, 1, 2, 3]
    assert [u for u, *_ in result["evals"]] == sorted(
        f"eval-{t}-{s}" for t in ("initial", "w2", "c0-h", "w3", "w4") for s in ("val", "test"))
    assert len(result["harness_phases"]) == 1 and "h1" in result["archive"]
    assert result["finished"] == ("done", True, None)
    return result


@pytest.mark.parametrize("point", BOUNDARIES)
def test_resume_after_sigkill(runs, unkilled, point):
    assert outcome(finished(runs, point)) == unkilled


def test_resume_after_many_sigkills_in_a_row(runs, unkilled):
    assert len(runs["many"][1]) == len(MANY) + 1
    assert outcome(finished(runs, "many")) == unkilled


def test_full_finetune_resumes_and_keeps_only_the_current_and_val_best_checkpoints(runs):
    ref = outcome(finished(runs, "full"))
    assert [s[0] for s in ref["steps"]] == [0, 1, 2, 3] and ref["final"][1] == "w3"
    # keep_versions applies to LoRA adapters only: a full checkpoint holds the model and the optimizer
    assert set(ref["weights_on_disk"]) == {"w3", ref["val_best"]["weights_version"]} - {"base"}
    assert outcome(finished(runs, "full-prune")) == ref
