"""`whale run` with `compute.train_ranks: 2`: it finishes, reports the steps a 1-rank run reports,
and resumes after a SIGKILL of the whole run (driver and, through their parent pipe, the ranks).

Runs are forked from one warm process (tests/kill_lab.py), as in tests/test_resume.py.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
from test_resume import finished, outcome
from test_run import tiny_config

from whale.config import dump_config
from whale.store import read_metrics

TESTS = Path(__file__).resolve().parent
# 4 weight steps (LoRA), evaluations at the start and the end; one episode at a time, so a run is
# a function of its seed and its weights (see test_resume.py)
RUN = {"schedule.kind": "weight_only", "runner.concurrency": 1, "eval.every_steps": 0}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    configs = {}
    for ranks in (1, 2):
        configs[ranks] = tmp / f"ranks{ranks}.yaml"
        configs[ranks].write_text(dump_config(tiny_config(tiny_model_dir, **RUN, **{"compute.train_ranks": ranks})))
    # weight_step@w1: the second step trained and saved by rank 0, the run's state not saved yet;
    # train@driver: the resumed run killed while its ranks train that step again;
    # rows@w2: the next step's rollouts on disk, the ranks idle
    scenarios = {"one": (1, []), "two": (2, []),
                 "two-killed": (2, ["weight_step@w1", "train@driver", "rows@w2"])}
    chains = {name: {"config": str(configs[r]), "out": str(tmp / name), "points": points}
              for name, (r, points) in scenarios.items()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    lab = subprocess.Popen([sys.executable, str(TESTS / "kill_lab.py")], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env)
    try:
        lab.stdin.write(json.dumps({"chains": chains, "parallel": 1}) + "\n")
        lab.stdin.flush()
        ready, _, _ = select.select([lab.stdout], [], [], 900)
        assert ready, "the runs did not finish in 15 minutes"
        answers = json.loads(lab.stdout.readline())
    finally:
        lab.stdin.close()
        lab.wait(timeout=60)
    return {name: (Path(chains[name]["out"]), answers[name]) for name in chains}


def steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["event"] == "weight_step"]


def test_two_ranks_report_the_steps_of_one(runs):
    one, two = steps(finished(runs, "one")), steps(finished(runs, "two"))
    assert [s["step"] for s in two] == [s["step"] for s in one] == [0, 1, 2, 3]
    assert [s["weights_version"] for s in two] == [s["weights_version"] for s in one]
    # the first step trains the same rows from the same weights: the same loss
    assert (two[0]["rows"], two[0]["trained_tokens"]) == (one[0]["rows"], one[0]["trained_tokens"])
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], abs=1e-5)
    assert (finished(runs, "two") / "weights" / "w3" / "adapter_model.safetensors").exists()


def test_two_ranks_resume_after_sigkills(runs):
    assert len(runs["two-killed"][1]) == 4
    assert outcome(finished(runs, "two-killed")) == outcome(finished(runs, "two"))
