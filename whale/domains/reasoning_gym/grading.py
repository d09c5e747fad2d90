"""The verifier: the task's own `score_answer`, run in the runner's grading processes.

What is scored is the submitted text's last `<answer>...</answer>`, as reasoning-gym's own
`extract_answer` finds it; a submission without the tag scores 0, as in reasoning-gym's own
evaluation. (Scoring the whole text instead hands the default scorer's partial credit to rambling
replies that happen to contain the gold: measured on the 135M model, 5 of 16 untagged replies got
0.002-0.02 that way.) reasoning-gym scores
are floats in [0, 1]; most tasks give 1/0, some give partial credit (the default scorer gives
len(gold)/len(answer) when the answer contains the gold). WHALE keeps the task's score as the
reward, so `weight.accept_threshold` decides which partial answers a weight phase trains on.

Dataset objects are rebuilt once per grading process and task config (score_answer is a method,
and some tasks read their config in it), then cached.
"""

from __future__ import annotations

import functools
import json
import re

from whale.domains.base import Problem
from whale.domains.reasoning_gym.data import make_dataset

_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.S)  # reasoning_gym.utils.extract_answer's pattern


def extract(answer: str | None) -> str | None:
    if answer is None:
        return None
    tagged = _ANSWER.findall(answer)
    return tagged[-1].strip() if tagged else None


@functools.lru_cache(maxsize=64)
def _scorer(task: str, config_json: str):
    return make_dataset(task, json.loads(config_json), size=1).score_answer


def grade_reasoning_gym(problem: Problem, answer: str | None) -> float:
    meta = problem.meta
    text = extract(answer)
    if not text:
        return 0.0
    score = _scorer(meta["task"], json.dumps(meta.get("config", {}), sort_keys=True))(text, meta["entry"])
    return min(1.0, max(0.0, float(score or 0.0)))
