"""verifiers environments as a domain: rows, tools and rubric, and h0 scoring what the environment scores.

The environments are written for the tests (tests/fixtures/verifiers_envs): a SingleTurnEnv and a
ToolEnv. One scripted policy (`script`) answers both WHALE's engine and a verifiers client, so the
environment's own `evaluate` and `whale eval` with h0 see the same model outputs.
"""

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers")
pytest.importorskip("verifiers.legacy", reason="the classic verifiers API (0.3.x)")

from verifiers.clients import Client  # noqa: E402
from verifiers.types import Response, ResponseMessage, ToolCall  # noqa: E402

from toy import ScriptedEngine as ToyEngine  # noqa: E402
from whale.config import ConfigError, load_config  # noqa: E402
from whale.domains import load_domain  # noqa: E402
from whale.engine.base import Generation  # noqa: E402
from whale.evaluate import evaluate  # noqa: E402
from whale.rollout.runner import RolloutRunner  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "verifiers_envs"


@pytest.fixture(autouse=True)
def _fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def _cfg(env, *sets, sizes=(8, 2, 2, 8)):
    names = ("weight", "harness", "val", "test")
    return load_config(None, ["domain.name=verifiers", f"domain.options.env={env}", "runner.grader_processes=1",
                              "domain.budget.seconds=30", *sets]
                       + [f"domain.splits.{n}={s}" for n, s in zip(names, sizes)])


def script(messages, with_tools):
    """The scripted policy: (text, tool_calls) from the conversation so far.

    Single turn: the right sum for even a, the wrong one for odd a, a long reply when a % 3 == 0.
    Tools: look the country up (misspelt for Peru, so the tool raises), then answer from the tool
    message; Japan is answered without the tool.
    """
    last = messages[-1]
    if not with_tools:
        a, b = (int(x) for x in re.findall(r"\d+", last["content"])[:2])
        total = a + b if a % 2 == 0 else a + b + 1
        pad = " I added the two numbers carefully, digit by digit." if a % 3 == 0 else ""
        return f"<answer>{total}</answer>{pad}", None
    if last["role"] == "tool":
        return str(last["content"]), None
    country = last["content"].rsplit(" ", 1)[-1].rstrip("?")
    if country == "Japan":
        return "Kyoto", None
    name = "Perú" if country == "Peru" else country
    return "", [{"id": f"call-{country}", "type": "function",
                 "function": {"name": "lookup_capital", "arguments": json.dumps({"country": name})}}]


class ScriptedPolicyEngine(ToyEngine):
    returns_ids = False

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            text, calls = script(r.messages, bool(r.tools))
            out.append([Generation(text=text, finish_reason="stop", tool_calls=calls) for _ in range(r.n)])
        return out



def _plain(message):
    """A verifiers message object as an OpenAI-style dict (what `script` reads)."""
    d = message if isinstance(message, dict) else message.model_dump()
    return {"role": d["role"], "content": d.get("content") or ""}


class ScriptedClient(Client):
    """A verifiers client that answers with `script`: the environment's own rollouts, offline."""

    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, *a, **kw):
        raise NotImplementedError

    async def raise_from_native_response(self, response):
        pass

    async def from_native_response(self, response):
        return response

    async def close(self):
        pass

    async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        text, calls = script([_plain(m) for m in prompt], bool(tools))
        message = ResponseMessage(role="assistant", content=text, finish_reason="tool_calls" if calls else "stop",
                                  is_truncated=False, tool_calls=[
                                      ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                                      for c in calls] if calls else None)
        return Response(id="r", created=int(time.time()), model=model, message=message)


def own_rewards(vf_env, rows):
    """Rewards from the environment's own rollouts and scoring (`Environment.generate`)."""
    outputs = asyncio.run(vf_env.generate(rows, client=ScriptedClient(None), model="scripted",
                                          on_progress=lambda *a, **k: None))
    return {o["example_id"]: o["reward"] for o in outputs["outputs"]}


def whale_rewards(dom, problems):
    runner = RolloutRunner(ScriptedPolicyEngine(), dom, dom.cfg)
    try:
        result, trajs = evaluate(runner, dom.base_harness(), problems, 1)
    finally:
        runner.close()
    assert all(t.error is None for t in trajs), [t.error for t in trajs]
    return {p.meta["row"]["example_id"]: t.reward for p, t in zip(problems, trajs)}, trajs


@pytest.mark.parametrize("env,sizes", [("single_turn_env", (8, 2, 2, 8)), ("tool_env:load_environment", (4, 2, 2, 2))])
def test_h0_under_whale_eval_scores_what_the_environment_scores(env, sizes):
    dom = load_domain(_cfg(env, sizes=sizes))
    problems = [p for split in dom.load_splits().values() for p in split]
    mine, _ = whale_rewards(dom, problems)
    theirs = own_rewards(dom.vf_env, [p.meta["row"] for p in problems])
    assert mine == pytest.approx(theirs)
    assert len(set(mine.values())) >= 2  # the script makes the rubric give different rewards


def test_single_turn_rows_become_problems_with_held_out_eval_rows():
    dom = load_domain(_cfg("single_turn_env"))
    splits = dom.load_splits()
    train_ids = {p.id for s in ("weight", "harness") for p in splits[s]}
    held_ids = {p.id for s in ("val", "test") for p in splits[s]}
    assert all(i.startswith("dataset-") for i in train_ids) and all(i.startswith("eval_dataset-") for i in held_ids)
    p = splits["test"][0]
    assert p.question.startswith("What is") and p.meta["row"]["prompt"][0]["role"] == "system"
    again = load_domain(_cfg("single_turn_env")).load_splits()
    assert [q.id for q in again["test"]] == [q.id for q in splits["test"]]


def test_tools_run_in_the_parent_as_the_tool_env_runs_them():
    dom = load_domain(_cfg("tool_env", sizes=(4, 2, 2, 2)))
    _, trajs = whale_rewards(dom, dom.load_splits()["test"])
    calls = [c for t in trajs for c in t.tool_calls if c.name == "call_tool"]
    assert calls and all(c.args[0] == "lookup_capital" for c in calls)
    env = dom.make_env(dom.load_splits()["test"][0])
    assert env.call_tool("lookup_capital", '{"country": "Mars"}') == "'no such country: Mars'"  # KeyError as ToolEnv formats it
    assert env.lookup_capital(country="Peru") == "Lima"
    assert env.public_state()["tool_schemas"][0]["function"]["name"] == "lookup_capital"


def test_grading_uses_the_recorded_transcript_not_the_harness_claims():
    dom = load_domain(_cfg("tool_env", sizes=(4, 2, 2, 2)))
    p = next(p for s in dom.load_splits().values() for p in s)
    env = dom.make_env(p)
    env.submit(p.answer)  # right answer, but no tool call went through the parent
    assert dom.grade(p, env.final_answer()) == pytest.approx(1.0)
    env = dom.make_env(p)
    env.call_tool("lookup_capital", json.dumps({"country": p.meta["row"]["info"]["country"]}))
    env.submit(p.answer)
    assert dom.grade(p, env.final_answer()) == pytest.approx(1.25)  # + the used_tool reward


def test_environment_whose_dataset_lacks_prompt_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"verifiers env 'broken_envs:no_prompt'.*'prompt'"):
        load_domain(_cfg("broken_envs:no_prompt"))


@pytest.mark.parametrize("spec,message", [
    ("broken_envs:not_an_environment", "returned dict; WHALE supports SingleTurnEnv and ToolEnv"),
    ("no_such_module_xyz", "could not be imported"),
    ("single_turn_env:missing_factory", "could not be imported"),
])
def test_bad_environment_names_it(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_domain(_cfg(spec))


def test_load_environment_args_reach_the_factory():
    dom = load_domain(_cfg("single_turn_env", "domain.options.args={n_train: 30, bonus_weight: 0.0}"))
    assert len(dom.rows["dataset"]) == 30 and "short_reply" not in dom.brief


def test_cli_eval_reports_a_bad_environment_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "whale.cli", "eval", "--domain", "verifiers",
                           "--set", "domain.options.env=broken_envs:no_prompt", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{FIXTURES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2, proc.stderr
    said = " ".join(proc.stderr.split())  # rich wraps long lines
    assert "verifiers env 'broken_envs:no_prompt': dataset rows lack 'prompt'" in said and "Traceback" not in said
    assert not (tmp_path / "out").exists()
