"""A user domain named in the config loads and runs through the same runner."""

import sys
from pathlib import Path

import pytest

from toy import ScriptedEngine
from whale.config import ConfigError, load_config
from whale.domains import load_domain
from whale.rollout.runner import RolloutRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def test_user_domain_from_module_runs():
    cfg = load_config(None, ["domain.module=examples.custom_domain:UnitsDomain", "domain.splits.test=8"])
    dom = load_domain(cfg)
    splits = dom.load_splits()
    assert len(splits["test"]) == 8
    ids = [set(p.question for p in splits[s]) for s in ("weight", "harness", "val", "test")]
    assert all(not (a & b) for i, a in enumerate(ids) for b in ids[i + 1:])
    harness = '''
SYSTEM_PROMPT = ""
USER_PROMPT = "{question}"
def run(env, llm):
    words = env.question.replace("?", "").split()
    n = float(words[-2])
    factor = {"m": 1000, "cm": 100, "g": 1000, "min": 60, "s": 60}[words[2]]
    env.submit(str(env.calculate(n, "*", factor)))
'''
    runner = RolloutRunner(ScriptedEngine(), dom, cfg)
    try:
        trajs = runner.run(harness, splits["test"])
    finally:
        runner.close()
    assert [t.reward for t in trajs] == [1.0] * 8
    assert all(t.tool_calls[0].name == "calculate" for t in trajs)


def test_bad_module_is_a_clear_error():
    with pytest.raises(ConfigError, match="could not be loaded"):
        load_domain(load_config(None, ["domain.module=nope.nothing:X"]))
    with pytest.raises(ConfigError, match="package.module:ClassName"):
        load_domain(load_config(None, ["domain.module=examples.custom_domain"]))


class NoGrader:
    """A user domain missing members of the Domain protocol (loaded by name in the test below)."""

    answer_format = None

    def __init__(self, cfg):
        self.cfg = cfg

    def load_splits(self):
        return {}


def test_user_domain_missing_protocol_members_is_one_clear_error():
    with pytest.raises(ConfigError, match="lacks make_env, grade, grader, base_harness, hints"):
        load_domain(load_config(None, ["domain.module=tests.test_custom_domain:NoGrader"]))
