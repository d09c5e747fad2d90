"""Harness phase: archive, validation, proposers, null probe, the search loop, mutations.

No model: a table engine answers "What is A + B?" correctly only when the prompt says "digits
only", so a harness change has a measurable effect. Episodes run through the real RolloutRunner
and sandbox. The toy domain is defined here so these tests do not depend on the real domains;
the mutation tests read the real domains' h0.py files (the library must fit them) and run the
mutated harnesses against small look-alike environments.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from whale.config import Config, ConfigError, load_config
from whale.harness.mechanism import NO_HINTS
from whale.domains.base import EpisodeEnv, EpisodeError, Problem
from whale.engine.base import Generation, GenerationRequest, QueuedSubmit, SamplingParams
from whale.engine.null import NullEngine
from whale.rollout.runner import RolloutRunner
from whale.rollout.trajectory import LLMCall, Trajectory
from whale.harness import mutation as M
from whale.harness.archive import Archive, code_hash
from whale.harness.guard import null_probe
from whale.harness.loop import HarnessSearch
from whale.harness.agent import AgentCLIProposer
from whale.harness.chat import ChatProposer, ChatTools
from whale.harness.chat_transport import ReplayTransport
from whale.harness.proposal import Proposal, ProposalContext
from whale.harness.proposers import make_proposer
from whale.harness.workspace import build_workspace, file_mode_is_read_only
from whale.harness.validate import check_prompt_only, static_check, validate_candidate

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "proposer" / "chat_replay.json"

# ----------------------------------------------------------------------------- toy domain + engine
TOY_H0 = '''"""Toy base harness."""
SYSTEM_PROMPT = "You answer arithmetic questions."
USER_PROMPT = "{question}"


def run(env, llm):
    out = llm([{"role": "system", "content": SYSTEM_PROMPT},
               {"role": "user", "content": USER_PROMPT.format(question=env.question)}])
    env.submit(str(out).strip())
'''
BETTER = TOY_H0.replace('"""Toy base harness."""', '"""Hypothesis: the model needs the format.\nMechanism: prompt"""') \
    .replace("You answer arithmetic questions.", "You answer arithmetic questions. Reply with digits only.")
CHEAT = '''"""Computes the answer itself: the model is never asked."""
import re

SYSTEM_PROMPT = ""
USER_PROMPT = ""


def run(env, llm):
    a, b = re.findall(r"\\d+", env.question)[:2]
    env.submit(str(env.add(int(a), int(b))))
'''


def toy_grade(problem, answer):
    return float(answer is not None and answer.strip() == str(problem.answer))


class AddEnv(EpisodeEnv):
    tools = ("add",)

    def add(self, a, b):
        return a + b


class ToyDomain:
    name = "toy"
    brief = "Questions 'What is A + B?'. env.add(a, b) returns a + b. Submit the number."
    answer_format = None
    hints = NO_HINTS

    def __init__(self, n=6):
        self.problems = [Problem(id=f"p{i}", question=f"What is {i} + {2 * i + 1}?", answer=str(3 * i + 1))
                         for i in range(n)]

    def load_splits(self):
        return {"weight": [], "harness": self.problems, "val": [], "test": []}

    def make_env(self, problem):
        return AddEnv(problem)

    def grade(self, problem, answer):
        return toy_grade(problem, answer)

    def grader(self):
        return toy_grade

    def base_harness(self):
        return TOY_H0


class TableEngine(QueuedSubmit):
    """Right answer when the prompt says 'digits only' (or among choices), else a useless sentence."""

    returns_ids = False

    def __init__(self):
        self.weights_version = "base"

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            text = " ".join(m["content"] for m in r.messages)
            m = re.search(r"What is (\d+) \+ (\d+)\?", text)
            ans = str(int(m.group(1)) + int(m.group(2))) if m else "?"
            reply = ans if "digits only" in text.lower() else "I think it is a number"
            gens = []
            for _ in range(r.n):
                t = (ans if ans in r.choices else r.choices[0]) if r.choices else reply
                gens.append(Generation(text=t, finish_reason="stop", weights_version=self.weights_version,
                                       prompt_tokens=len(text.split()), completion_tokens=len(t.split())))
            out.append(gens)
        return out

    def count_tokens(self, messages):
        return sum(len(m["content"].split()) for m in messages)

    def load_weights(self, path, version):
        self.weights_version = version

    def close(self):
        pass


class ScriptedProposer:
    """Returns the given proposal lists, one per call (then nothing)."""

    name = "scripted"

    def __init__(self, rounds, error=None):
        self.rounds = list(rounds)
        self.calls = 0
        self.error = error
        self.last_error = None
        self.last_usage = {}
        self.exhausted = False

    def propose(self, archive, domain, n, workspace, context):
        self.calls += 1
        self.last_error = self.error
        return self.rounds.pop(0) if self.rounds else []


class CrashingProposer:
    name = "crashing"
    last_error = None
    last_usage = {}
    exhausted = False

    def propose(self, *a, **k):
        raise RuntimeError("proposer bug")


def make_cfg(**harness):
    cfg = Config()
    cfg.runner.concurrency = 8
    cfg.harness.smoke_examples = 1
    for k, v in harness.items():
        setattr(cfg.harness, k, v)
    return cfg


class Toy(NamedTuple):
    cfg: Config
    domain: ToyDomain
    engine: TableEngine
    runner: RolloutRunner
    archive: Archive
    null_runner: RolloutRunner


@pytest.fixture(scope="module")
def runners():
    """One real-engine and one null-engine runner for the module (each starts a grading pool)."""
    cfg, domain, engine = make_cfg(), ToyDomain(), TableEngine()
    real, null = RolloutRunner(engine, domain, cfg), RolloutRunner(NullEngine(), domain, cfg)
    yield domain, engine, real, null
    real.close()
    null.close()


@pytest.fixture
def toy(tmp_path, runners):
    """A fresh config and archive (h0 = TOY_H0) over the module's runners."""
    domain, engine, runner, null = runners
    engine.weights_version = "base"
    archive = Archive(tmp_path / "run")
    archive.add_candidate(TOY_H0, None, "base", "base harness", "none")
    return Toy(make_cfg(), domain, engine, runner, archive, null)


def search_for(toy, proposer, **kw):
    return HarnessSearch(toy.cfg, toy.domain, toy.runner, toy.archive, proposer, progress=False,
                         null_runner=toy.null_runner, **kw)


def events(history, name):
    return [r for r in history if r["event"] == name]


def traj(pid, reward, calls=1, version="v0"):
    call = LLMCall(messages=[{"role": "user", "content": "q"}], completion="a", finish_reason="stop",
                   prompt_ids=[1, 2], completion_ids=[3])
    return Trajectory(problem_id=pid, sample=0, harness_id="x", calls=[call] * calls, reward=reward,
                      prompt_tokens=10, completion_tokens=5, weights_version=version)


# ----------------------------------------------------------------------------- archive
def test_archive_scores_by_version_frontier_best_and_reload(tmp_path):
    a = Archive(tmp_path)
    h0 = a.add_candidate(TOY_H0, None, "base", "base", "none")
    h1 = a.add_candidate(BETTER, h0, "scripted", "format", "prompt")
    h2 = a.add_candidate(BETTER + "\nX = 1\n", h0, "scripted", "", "const")
    assert (h0, h1, h2) == ("h0", "h1", "h2")
    a.record_scores(h0, "v0", [traj("p0", 1.0), traj("p1", 0.0)])
    a.record_scores(h1, "v0", [traj("p0", 1.0, calls=3), traj("p1", 0.0, calls=3)])  # same rate, more calls
    a.record_scores(h2, "v0", [traj("p0", 0.0), traj("p1", 0.0)])
    a.record_scores(h1, "v1", [traj("p0", 1.0, version="v1"), traj("p1", 1.0, version="v1")], gold={"p0": "7"})
    assert a.scores(h0, "v0")["success_rate"] == 0.5 and a.scores(h1, "v0")["mean_llm_calls"] == 3
    assert a.scores(h0, "v1") is None and a.scores(h1, "v1")["success_rate"] == 1.0
    assert a.best("v0") == h0  # tie on success rate -> fewer calls
    assert a.best("v1") == h1 and a.best("v0", exclude=[h0]) == h1
    assert [p["id"] for p in a.frontier("v0")] == [h0]
    assert a.evaluated(code_hash(TOY_H0), "v0") == h0 and a.evaluated(code_hash(TOY_H0), "v1") is None
    rows = [json.loads(x) for x in (a.root / h1 / "traces.jsonl").read_text().splitlines()]
    assert {r["scored_under"] for r in rows} == {"v0", "v1"}
    assert all("prompt_ids" not in c for r in rows for c in r["calls"])
    assert [r.get("gold") for r in rows if r["scored_under"] == "v1"] == ["7", None]
    summary = [json.loads(x) for x in (a.root / "summary.jsonl").read_text().splitlines()]
    assert len(summary) == 4 and {(r["id"], r["weights_version"]) for r in summary} >= {(h1, "v1")}
    # re-recording a (candidate, version) replaces its traces instead of appending
    a.record_scores(h1, "v1", [traj("p0", 0.0, version="v1")])
    assert len(a.traces(h1, "v1")) == 1 and len(a.traces(h1, "v0")) == 2
    b = Archive(tmp_path)  # everything reloads from disk
    assert b.ids() == [h0, h1, h2] and b.scores(h1, "v1") == a.scores(h1, "v1")
    assert b.best("v0") == h0 and b.meta(h1)["status"] == "valid" and b.source(h1) == BETTER
    assert json.loads((b.root / "frontier.json").read_text())["v0"][0]["id"] == h0
    assert b.add_candidate("x = 1\n", h0, "t") == "h3"
    assert [m["id"] for m in b.all_meta()] == ["h0", "h1", "h2", "h3"] and set(b.all_scores(h1)) == {"v0", "v1"}


def test_code_hash_ignores_comments_layout_and_docstrings():
    variant = TOY_H0.replace('"""Toy base harness."""', '"""Another story."""') + "\n# a comment\n"
    assert code_hash(variant) == code_hash(TOY_H0)
    assert code_hash(BETTER) != code_hash(TOY_H0)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("source, reason", [
    ("def run(env, llm):\n    return (\n", "syntax error"),
    ('SYSTEM_PROMPT = ""\nUSER_PROMPT = ""\ndef go(env, llm):\n    pass\n', "no top-level function run"),
    ('SYSTEM_PROMPT = ""\nUSER_PROMPT = ""\ndef run(env):\n    pass\n', "two positional parameters"),
    ('import numpy\n' + TOY_H0, "imports 'numpy'"),
    ('from whale.harness import archive\n' + TOY_H0, "imports 'whale'"),
    ('from . import x\n' + TOY_H0, "relative import"),
    (TOY_H0 + '\nm = __import__("requests")\n', "imports 'requests'"),
    ("", "empty file"),
    (TOY_H0 + "#" * 60_000, "max_file_bytes"),
])
def test_static_check_rejects_with_reason(source, reason):
    got = static_check(source, Config())
    assert got is not None and reason in got


def test_static_check_accepts_contract_and_allowlisted_package():
    cfg = Config()
    assert static_check(TOY_H0, cfg) is None
    assert static_check("import json, re\nimport collections.abc\n" + TOY_H0, cfg) is None
    cfg.runner.sandbox.extra_packages = ["numpy"]
    assert static_check("import numpy as np\n" + TOY_H0, cfg) is None


def test_prompt_constants_are_required_only_by_prompt_only_search():
    bare = "def run(env, llm):\n    env.submit(str(llm([{'role': 'user', 'content': env.question}])))\n"
    assert static_check(bare, Config()) is None  # the harness contract: run(env, llm) is all of it
    for source, reason in [('USER_PROMPT = ""\n' + bare, "SYSTEM_PROMPT"),
                           ('SYSTEM_PROMPT = "a".upper()\nUSER_PROMPT = ""\n' + bare, "string literal")]:
        assert static_check(source, Config()) is None
        got = static_check(source, Config(), base_source=TOY_H0, prompt_only=True)
        assert got is not None and reason in got and "prompt-only" in got
        for key, value in (("harness.prompt_only", "true"), ("schedule.kind", "prompt_only")):
            got = static_check(source, load_config(None, [f"{key}={value}"]))  # e.g. harness.initial of such a run
            assert got is not None and reason in got


def test_prompt_only_mode_allows_only_prompt_changes():
    cfg = Config()
    assert static_check(BETTER, cfg, base_source=TOY_H0, prompt_only=True) is None  # prompt + docstring
    code_change = TOY_H0.replace("str(out).strip()", "str(out)")
    reason = static_check(code_change, cfg, base_source=TOY_H0, prompt_only=True)
    assert reason and "prompt-only" in reason
    assert check_prompt_only(TOY_H0 + "\nEXTRA = 1\n", TOY_H0) is not None


def test_leak_check_only_when_traces_show_gold():
    problems = ToyDomain().problems
    leaky = TOY_H0 + '\nTABLE = {"What is 2 + 5?": "7"}\n'
    partial = TOY_H0 + '\nif False:\n    KEY = "what is 3 +"\n'
    cfg = Config()
    assert static_check(leaky, cfg, harness_problems=problems) is None  # gold not shown: no check
    cfg.domain.show_gold_in_traces = True
    assert "question p2" in static_check(leaky, cfg, harness_problems=problems)
    assert static_check(partial, cfg, harness_problems=problems) is None  # short literal, not a question
    gold_leak = TOY_H0 + '\nANSWER = "1000"\n'
    problems[0].answer = "1000"
    assert "gold answer" in static_check(gold_leak, cfg, harness_problems=problems)
    # literals the parent already had are exempt
    assert static_check(gold_leak, cfg, harness_problems=problems, base_source=gold_leak) is None


def test_smoke_run_rejects_a_harness_that_always_crashes(toy):
    cfg, domain, engine, runner, archive, _ = toy
    crashing = TOY_H0.replace("env.submit(str(out).strip())", "raise ValueError('boom')")
    ok, reason = validate_candidate(crashing, domain, cfg, runner, harness_problems=domain.problems)
    assert not ok and "smoke run" in reason and "boom" in reason
    counted = []
    ok, reason = validate_candidate(BETTER, domain, cfg, runner, harness_problems=domain.problems,
                                    on_rollouts=lambda p, t: counted.append((p, len(t))))
    assert ok and reason.startswith("ok") and counted == [("smoke", 1)]


# ----------------------------------------------------------------------------- null engine + probe
def test_null_engine_is_uniform_over_choices_and_seeded():
    e = NullEngine(seed=1)
    assert e.weights_version == "null" and e.returns_ids is False
    reqs = [GenerationRequest(messages=[{"role": "user", "content": "x"}], choices=["a", "b", "c"], seed=s)
            for s in range(300)]
    picks = [g[0].text for g in e.generate(reqs, SamplingParams())]
    assert set(picks) == {"a", "b", "c"} and all(60 < picks.count(c) < 140 for c in "abc")
    assert picks == [g[0].text for g in NullEngine(seed=1).generate(reqs, SamplingParams())]
    free = e.generate([GenerationRequest(messages=[{"role": "user", "content": "x"}], n=2, seed=0,
                                         max_tokens=5)], SamplingParams())[0]
    assert len(free) == 2 and all(0 < len(g.text.split()) <= 5 and not g.completion_ids for g in free)
    e.load_weights("/nowhere", "v3")
    assert e.weights_version == "null"


def test_null_probe_flags_a_harness_that_ignores_the_model(toy):
    cfg, domain, engine, runner, archive, _ = toy
    counted = []
    cheat = null_probe(runner, CHEAT, domain.problems, cfg, domain=domain,
                       ledger_callback=lambda p, t: counted.append((p, len(t))))  # builds its own null runner
    assert cheat["real"] == 1.0 and cheat["null"] == 1.0 and cheat["flagged"]
    assert "only 6 problems" in cheat["note"] and cheat["n"] == 6
    assert counted == [("null_probe", 6), ("null_probe", 6)]
    honest = null_probe(runner, BETTER, domain.problems, cfg, null_runner=toy.null_runner)
    assert honest["real"] == 1.0 and honest["null"] == 0.0 and not honest["flagged"]


# ----------------------------------------------------------------------------- the search loop
def test_search_accepts_better_candidate_and_reports_invalid_and_duplicates(toy):
    cfg, domain, engine, runner, archive, _ = toy
    proposer = ScriptedProposer([[
        Proposal(BETTER, "format", "prompt"),
        Proposal("def run(env, llm):\n    return (\n", "broken", "syntax"),
        Proposal(TOY_H0.replace("Toy base harness.", "A copy."), "copy", "none"),
        Proposal("import numpy\n" + TOY_H0, "numpy", "import"),
    ]])
    cfg.harness.candidates_per_iteration = 4
    ledger, rows = [], []
    search = search_for(toy, proposer, ledger_callback=lambda p, t: ledger.append((p, len(t))))
    result = search.run_phase("h0", "base", iterations=2, on_iteration=rows.append)
    assert result.accepted_id == "h1" and result.iterations == 2 and rows == result.history
    assert archive.meta("h1")["status"] == "valid" and archive.scores("h1", "base")["success_rate"] == 1.0
    assert archive.scores("h0", "base")["success_rate"] == 0.0
    invalid = {r["id"]: r["reason"] for r in events(result.history, "invalid")}
    assert "syntax error" in invalid["h2"] and "numpy" in invalid["h4"]
    assert archive.meta("h2")["status"] == "invalid" and "syntax" in archive.meta("h2")["reason"]
    dup = events(result.history, "duplicate")
    assert [d["id"] for d in dup] == ["h3"] and "same code as h0" in dup[0]["reason"]
    assert archive.meta("h3")["duplicate_of"] == "h0"
    probe = events(result.history, "null_probe")
    assert probe and probe[0]["id"] == "h1" and not probe[0]["flagged"]
    assert events(result.history, "accept")[0]["id"] == "h1"
    purposes = [p for p, _ in ledger]
    assert purposes.count("rescore") == 1 and purposes.count("harness") == 1
    assert "smoke" in purposes and "null_probe" in purposes
    archive.record_invalid("h2", "syntax error")
    with pytest.raises(ValueError, match="h2 is invalid"):
        search.run_phase("h2", "v9", iterations=1)


def test_incoming_harness_wins_when_nothing_beats_it(toy):
    worse = TOY_H0.replace("env.submit(str(out).strip())", "llm([{'role': 'user', 'content': 'x'}])\n"
                                                              "    env.submit(str(out).strip())")
    proposer = ScriptedProposer([[Proposal(worse, "two calls", "extra call")]])
    result = search_for(toy, proposer).run_phase("h0", "base", iterations=2)
    assert result.accepted_id == "h0"  # same success rate (0), fewer calls
    assert not events(result.history, "null_probe")  # the incoming harness is never probed


def test_flagged_harness_is_rejected_for_the_next_best(toy):
    cfg, domain, engine, runner, archive, _ = toy
    cfg.harness.candidates_per_iteration = 2
    proposer = ScriptedProposer([[Proposal(CHEAT, "compute it", "tool"), Proposal(BETTER, "format", "prompt")]])
    result = search_for(toy, proposer).run_phase("h0", "base", iterations=2)
    assert archive.ranking("base")[0] == "h1"  # the cheat ranks first (0 LLM calls) ...
    assert result.accepted_id == "h2"  # ... but the null probe flags it
    assert archive.meta("h1")["flagged"] and archive.meta("h1")["null_probe"]["base/p1"]["flagged"]
    cfg.harness.reject_flagged = False  # flagged is then recorded, not rejected
    search = search_for(toy, ScriptedProposer([[Proposal(CHEAT, "compute it", "tool")]]))
    result = search.run_phase("h0", "other", iterations=2)
    assert result.accepted_id == "h3" and archive.meta("h3")["flagged"]


def test_scores_are_keyed_by_weights_version(toy):
    cfg, domain, engine, runner, archive, _ = toy
    first = search_for(toy, ScriptedProposer([[Proposal(BETTER, "format", "prompt")]]))
    assert first.run_phase("h0", "v0", iterations=2).accepted_id == "h1"
    engine.load_weights(None, "v1")
    second = search_for(toy, ScriptedProposer([[Proposal(BETTER, "same code again", "prompt")]]))
    result = second.run_phase("h1", "v1", iterations=2)
    rescore = events(result.history, "rescore")[0]
    assert rescore["id"] == "h1" and not rescore["reused"]  # re-scored under the new weights
    assert set(json.loads((archive.root / "h1" / "scores.json").read_text())) == {"v0", "v1"}
    # same code hash as h1, and h1 is already evaluated under v1 -> a duplicate, not re-evaluated
    assert archive.meta("h2")["status"] == "duplicate"
    assert archive.scores("h0", "v1") is None and result.accepted_id == "h1"


def test_proposer_failures_leave_the_run_going(toy):
    cfg, domain, engine, runner, archive, _ = toy
    for proposer, expect in [(CrashingProposer(), "proposer bug"),
                             (AgentCLIProposer("sleep 100", timeout_s=1, sandbox="none"), "timed out"),
                             (AgentCLIProposer("true", timeout_s=30, sandbox="none"), "wrote no candidates"),
                             (ScriptedProposer([], error=None), "no candidates")]:
        started = time.monotonic()
        result = search_for(toy, proposer).run_phase("h0", f"v-{type(proposer).__name__}-{expect}", iterations=2)
        failures = events(result.history, "proposer_failure")
        assert result.accepted_id == "h0" and len(failures) == 1 and expect in failures[0]["reason"]
        assert time.monotonic() - started < 30


def test_a_proposer_with_nothing_left_ends_the_phase_and_the_run_goes_on(toy):
    """An offline library whose every edit is in the archive (Proposer.exhausted) is not a failure
    to fix: each phase ends after its empty round and keeps its harness, however many phases in a
    row (a prompt-only chess run stopped with ProposerStopped after three such rounds, 2026-12-07).
    A proposer that fails without being exhausted is still stopped (test_agent_cli.py)."""
    spent = ScriptedProposer([])
    spent.exhausted = True
    search = search_for(toy, spent)
    for phase, version in enumerate(["base", "v1", "v2", "v3"]):
        result = search.run_phase("h0", version, iterations=5)
        assert result.accepted_id == "h0" and result.iterations == 2  # the rescore, then one empty round
        [ended] = events(result.history, "proposer_exhausted")
        assert "keeping the best harness so far" in ended["reason"] and not events(result.history, "proposer_failure")
    assert spent.calls == 4


def test_should_stop_ends_the_phase_at_an_iteration_boundary(toy):
    cfg, domain, engine, runner, archive, _ = toy
    proposer = ScriptedProposer([[Proposal(BETTER, "format", "prompt")]])
    asked = []
    result = search_for(toy, proposer, splits=domain.load_splits()).run_phase(
        "h0", "base", iterations=5, should_stop=lambda: asked.append(1) or len(asked) > 1)
    assert result.iterations == 2 and result.accepted_id == "h1" and proposer.calls == 1
    assert events(result.history, "phase_stopped")[0]["iteration"] == 2


def test_adaptive_phase_stops_on_patience(toy):
    cfg, domain, engine, runner, archive, _ = toy
    cfg.harness.min_iterations, cfg.harness.max_iterations, cfg.harness.patience = 1, 6, 2
    result = search_for(toy, ScriptedProposer([])).run_phase("h0", "base", adaptive=True)
    assert result.iterations == 3  # rescore + 2 iterations without a new best
    cfg.harness.patience = 1
    proposer = ScriptedProposer([[Proposal(BETTER, "format", "prompt")]])
    result = search_for(toy, proposer).run_phase("h0", "v2", adaptive=True)
    assert result.iterations == 3 and result.accepted_id == "h1"  # improved at 2, stale at 3


class Killed(Exception):
    pass


def test_resume_redoes_only_the_inflight_candidate(toy):
    cfg, domain, engine, runner, archive, _ = toy
    cfg.harness.candidates_per_iteration = 2
    second = BETTER.replace("digits only.", "digits only. Be exact.")
    saved, ledger = {}, []
    search = search_for(toy, ScriptedProposer([[Proposal(BETTER, "a", "prompt"), Proposal(second, "b", "prompt")]]),
                        ledger_callback=lambda p, t: ledger.append((p, [x.harness_id for x in t][:1])))

    def kill_after_first_candidate(row):
        saved["state"] = search.state_dict()
        if row["event"] == "candidate":
            raise Killed

    with pytest.raises(Killed):
        search.run_phase("h0", "base", iterations=2, on_iteration=kill_after_first_candidate)
    assert saved["state"]["pending"]["ids"] == ["h1", "h2"] and saved["state"]["done"] == 1
    ledger.clear()
    never = ScriptedProposer([])
    resumed = search_for(reloaded(toy), never, ledger_callback=lambda p, t: ledger.append((p, t[0].harness_id)))
    resumed.load_state_dict(saved["state"])
    result = resumed.run_phase("h0", "base", iterations=2)
    assert never.calls == 0  # proposals were archived before the kill: no re-proposal
    assert [(r["id"], r.get("resumed", False)) for r in events(result.history, "candidate")] == \
        [("h1", True), ("h2", False)]  # h1's row is reported again, in case it was lost in the kill
    assert [h for p, h in ledger if p == "harness"] == ["h2"]  # h0 and h1 are not re-evaluated
    assert result.accepted_id == "h1" and len(Archive(archive.run_dir).traces("h1", "base")) == 6
    finished = resumed.state_dict()
    resumed.load_state_dict(finished)  # killed after the phase ended: its result comes back, no work
    again = resumed.run_phase("h0", "base", iterations=2)
    assert again.accepted_id == "h1" and again.history == [] and never.calls == 0
    # without a load, the same (incoming, version) is a new phase (weights unchanged after a weight phase)
    new_phase = resumed.run_phase("h1", "base", iterations=2)
    assert never.calls == 1 and resumed.state_dict()["phase"] == finished["phase"] + 1
    fresh = search_for(toy, ScriptedProposer([]))  # a new object numbers its phase after those on disk
    fresh.run_phase("h1", "base", iterations=2)
    assert fresh.state_dict()["phase"] == finished["phase"] + 2
    assert events(new_phase.history, "rescore")[0]["reused"] and new_phase.accepted_id == "h1"


def reloaded(toy):
    return toy._replace(archive=Archive(toy.archive.run_dir))


# ----------------------------------------------------------------------------- agent CLI proposer
AGENT_SCRIPT = r'''
cd "$1"
find . -type f | sed 's/^/FILE /'
echo "SECRET ${WHALE_TEST_SECRET:-absent}"
(echo tampered > archive/h0/harness.py) 2>/dev/null || echo "blocked"
cp "$2" candidates/cand_1.py
'''


def test_agent_cli_workspace_exposes_only_the_archive(toy, tmp_path, monkeypatch):
    cfg, domain, engine, runner, archive, _ = toy
    archive.record_scores("h0", "base", runner.run(TOY_H0, domain.problems, purpose="harness"))
    (archive.root / "h0" / "secret.txt").write_text("not for proposers")
    (archive.run_dir / "eval").mkdir()
    (archive.run_dir / "eval" / "test.jsonl").write_text("{}")
    cand = tmp_path / "cand.py"
    cand.write_text(BETTER.replace("Mechanism: prompt", "Mechanism: prompt\nParent: h0"))
    monkeypatch.setenv("WHALE_TEST_SECRET", "s3cret")
    ws = tmp_path / "ws"
    # the workspace itself: read-only copy, writable candidates/
    copy = build_workspace(archive, ws, "brief")
    files = sorted(str(p.relative_to(ws)) for p in ws.rglob("*") if p.is_file())
    assert files == ["BRIEF.md", "archive/frontier.json", "archive/h0/harness.py", "archive/h0/meta.json",
                     "archive/h0/scores.json", "archive/h0/traces.jsonl", "archive/summary.jsonl"]
    assert all(file_mode_is_read_only(p) for p in copy.rglob("*"))
    assert file_mode_is_read_only(copy) and not file_mode_is_read_only(ws / "candidates")
    assert (copy / "h0" / "harness.py").stat().st_ino != (archive.root / "h0" / "harness.py").stat().st_ino
    if os.getuid() != 0:
        with pytest.raises(PermissionError):
            (copy / "h0" / "harness.py").write_text("x")
    # a run of the agent command (no sandbox here: tests/test_proposers.py covers bubblewrap)
    script = AGENT_SCRIPT.replace('"$1"', "{workspace}").replace('"$2"', str(cand))
    proposer = AgentCLIProposer(script, timeout_s=60, sandbox="none")
    ctx = ProposalContext(iteration=2, weights_version="base", incoming_id="h0", brief="brief", tag="t1")
    props = proposer.propose(archive, domain, 3, ws, ctx)
    assert len(props) == 1 and props[0].mechanism == "prompt" and props[0].parent == "h0"
    transcript = (archive.root / "_proposals" / "t1" / "transcript.txt").read_text()
    listed = re.findall(r"^FILE \./(\S+)", transcript, re.M)
    assert "archive/h0/harness.py" in listed and not any("secret" in f or "eval" in f for f in listed)
    assert "SECRET absent" in transcript and "s3cret" not in transcript
    assert archive.source("h0") == TOY_H0  # whatever it did to its copy
    assert not ws.exists() and proposer.last_error is None


def test_make_proposer_from_config():
    cfg = Config()
    assert isinstance(make_proposer(cfg), M.MutationProposer)
    cfg.harness.proposer = "agent_cli"
    with pytest.raises(ConfigError, match="agent_command"):
        make_proposer(cfg)
    cfg.harness.agent_command, cfg.harness.agent_env = "claude -p {brief}", ["ANTHROPIC_API_KEY"]
    cfg.harness.agent_sandbox = "none"
    agent = make_proposer(cfg)
    assert isinstance(agent, AgentCLIProposer) and agent.env_vars == ("ANTHROPIC_API_KEY",)
    cfg.harness.proposer = "chat"
    with pytest.raises(ConfigError, match="chat_base_url"):
        make_proposer(cfg)
    cfg.harness.chat_model, cfg.harness.chat_base_url = "m", "http://localhost:1/v1"
    assert isinstance(make_proposer(cfg), ChatProposer)


# ----------------------------------------------------------------------------- chat proposer
def _resp(calls=(), content=""):
    tool_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                  for i, (n, a) in enumerate(calls)]
    return {"choices": [{"message": {"role": "assistant", "content": content, "tool_calls": tool_calls}}],
            "usage": {"total_tokens": 50}}


CHAT_SCRIPT = [
    _resp([("list_files", {"path": "."})], "Let me look at the archive."),
    _resp([("read_file", {"path": "h0/harness.py"}), ("read_file", {"path": "../../../etc/passwd"})]),
    _resp([("grep", {"pattern": "success_rate", "path": "summary.jsonl"})]),
    _resp([("write_candidate", {"source": BETTER, "hypothesis": "h0 answers in sentences; ask for digits",
                                "mechanism": "answer-format instruction in the system prompt"})]),
    _resp([("finish", {})], "Done."),
]


class ScriptedChat:
    """The 'model' whose answers the fixture records (used only with WHALE_RECORD=1)."""

    def __init__(self, responses):
        self.responses = list(responses)

    def __call__(self, request):
        return self.responses.pop(0)


def test_chat_tools_confine_paths_to_the_archive(tmp_path):
    (tmp_path / "arch" / "h0").mkdir(parents=True)
    (tmp_path / "arch" / "h0" / "harness.py").write_text("line0\nSECRET_TOKEN\n")
    (tmp_path / "outside.txt").write_text("SECRET_TOKEN")
    tools = ChatTools(tmp_path / "arch", tmp_path / "out", n=1)
    assert "outside the archive" in tools.call("read_file", json.dumps({"path": "../outside.txt"}))
    assert "outside the archive" in tools.call("grep", json.dumps({"pattern": "SECRET", "path": "/../.."}))
    assert "h0/harness.py:1: SECRET_TOKEN" in tools.call("grep", json.dumps({"pattern": "SECRET"}))
    assert "[lines 1-2 of 2]" in tools.call("read_file", json.dumps({"path": "/h0/harness.py", "offset": 1}))
    assert "unknown tool" in tools.call("rm", "{}")


def test_chat_proposer_end_to_end_with_replay_fixture(toy):
    cfg, domain, engine, runner, archive, _ = toy
    record = os.environ.get("WHALE_RECORD") == "1"
    if not record and not FIXTURE.exists():
        pytest.fail(f"missing fixture {FIXTURE}; record it with WHALE_RECORD=1")
    transport = ReplayTransport(FIXTURE, inner=ScriptedChat(CHAT_SCRIPT) if record else None)
    proposer = ChatProposer("scripted-model", transport=transport, max_turns=8)
    cfg.harness.candidates_per_iteration = 1
    result = search_for(toy, proposer).run_phase("h0", "base", iterations=2)
    assert proposer.last_error is None, proposer.last_error
    assert result.accepted_id == "h1" and archive.meta("h1")["proposer"] == "chat"
    assert archive.meta("h1")["mechanism"] == "answer-format instruction in the system prompt"
    assert proposer.last_usage["turns"] == 5 and proposer.last_usage["tokens"] == 250
    transcript = next((archive.root / "_proposals").glob("*/transcript.txt")).read_text()
    assert "outside the archive" in transcript and "h0/harness.py" in transcript
    # replay refuses a request it has not seen
    with pytest.raises(KeyError, match="unseen"):
        ReplayTransport(FIXTURE, record=False)({"model": "other", "messages": []})


# ----------------------------------------------------------------------------- mutation proposer
def real_h0(domain):
    path = ROOT / "whale" / "domains" / domain / "h0.py"
    if not path.exists():
        pytest.skip(f"{path} not written yet")
    return path.read_text()


def declared(domain):
    """The domain class (its declared answer_format and hints are class attributes)."""
    from whale.domains.chess.domain import ChessDomain
    from whale.domains.math.domain import MathDomain
    from whale.domains.searchqa.domain import SearchQADomain

    return {"searchqa": SearchQADomain, "math": MathDomain, "chess": ChessDomain, "toy": ToyDomain}[domain]


@pytest.mark.parametrize("domain", ["searchqa", "math", "chess", "toy"])
def test_every_mutation_applies_to_the_base_harness_and_stays_valid(domain):
    source = TOY_H0 if domain == "toy" else real_h0(domain)
    cfg = Config()
    names = []
    for mutation in M.mutations_for(declared(domain), cfg):
        new = M.apply_mutation(mutation, source, "h0", random.Random(0))
        assert new is not None, f"{mutation.name} does not apply to {domain} h0"
        assert static_check(new, cfg) is None, (mutation.name, static_check(new, cfg))
        assert code_hash(new) != code_hash(source)
        fields = dict(re.findall(r"^(Mechanism|Parent): (.+)$", new, re.M))
        assert fields == {"Mechanism": mutation.label, "Parent": "h0"}
        if mutation.prompt_only:
            assert check_prompt_only(new, source) is None, mutation.name
        assert M.apply_mutation(mutation, new, "h1", random.Random(0)) is None or mutation.prompt_only
        names.append(mutation.name)
    assert len(names) >= (2 if domain == "toy" else 5)
    only = M.mutations_for(declared(domain), cfg, prompt_only=True)
    assert only and all(m.prompt_only for m in only)


def test_mutation_proposer_is_seeded_prefers_valid_parents_and_skips_known_code(tmp_path):
    archive = Archive(tmp_path)
    archive.add_candidate(real_h0("chess"), None, "base")
    archive.record_scores("h0", "v0", [traj("p0", 0.0)])

    class Chess:
        name = "chess"
        answer_format = None
        hints = declared("chess").hints

    ctx = ProposalContext(iteration=2, weights_version="v0", incoming_id="h0")
    a = M.MutationProposer(seed=3).propose(archive, Chess(), 4, tmp_path / "ws", ctx)
    b = M.MutationProposer(seed=3).propose(archive, Chess(), 4, tmp_path / "ws", ctx)
    assert [p.source for p in a] == [p.source for p in b] and len(a) == 4
    assert len({code_hash(p.source) for p in a}) == 4 and all(p.parent == "h0" for p in a)
    for p in a:
        archive.add_candidate(p.source, "h0", "mutation", p.hypothesis, p.mechanism)
    c = M.MutationProposer(seed=3).propose(archive, Chess(), 4, tmp_path / "ws", ctx)
    assert not {code_hash(p.source) for p in c} & {code_hash(p.source) for p in a}
    po = ProposalContext(iteration=2, weights_version="v0", incoming_id="h0", prompt_only=True,
                         base_source=real_h0("chess"))
    only = M.MutationProposer(seed=1).propose(archive, Chess(), 2, tmp_path / "ws", po)
    assert only and all(check_prompt_only(p.source, real_h0("chess")) is None for p in only)


def test_move_annotations_match_python_chess():
    chess = pytest.importorskip("chess")
    from whale.domains.chess import hint_blocks as B

    ns = {}
    exec(B.ANNOTATE_MOVES.replace("__INNER__", "print"), ns)
    rows = [json.loads(x) for x in (ROOT / "whale/domains/chess/puzzles.jsonl").read_text().splitlines()[1:120]]
    checked = 0
    for row in rows:
        board = chess.Board(row["fen"])
        for uci in row["moves"].split():
            for move in board.legal_moves:
                after = board.copy()
                after.push(move)
                want = (["mate"] if after.is_checkmate() else ["check"] if after.is_check() else []) \
                    + (["capture"] if board.is_capture(move) else []) + (["promotion"] if move.promotion else [])
                assert ns["_am_effects"](board.fen(), move.uci()) == want, (board.fen(), move.uci())
                checked += 1
            board.push(chess.Move.from_uci(uci))
    assert checked > 5000


# look-alike environments with the real domains' tool APIs, to run mutated real h0 harnesses
class FakeSearchEnv(EpisodeEnv):
    tools = ("search", "submit")

    def search(self, query, k=3):
        if not str(query).strip():
            raise EpisodeError("empty query")
        return [{"title": f"France {i}", "text": "Paris is the capital of France. " * 30} for i in range(int(k))]


class FakeMathEnv(EpisodeEnv):
    tools = ("python", "submit")

    def python(self, code):
        return "2\n"


class FakeChessEnv(EpisodeEnv):
    tools = ("move",)

    def __init__(self, problem):
        super().__init__(problem)
        import chess

        self.board = chess.Board(problem.answer["fen"])
        self.played, self._done = [], False

    @property
    def done(self):
        return self._done

    def public_state(self):
        legal = [] if self._done else sorted(m.uci() for m in self.board.legal_moves)
        return {"question": self.problem.question, "fen": self.board.fen(), "legal_moves": legal, "done": self._done}

    def move(self, uci):
        import chess

        try:
            move = chess.Move.from_uci(str(uci))
        except ValueError:
            move = None
        if move is None or move not in self.board.legal_moves:
            return {**self.public_state(), "opponent_move": None, "error": f"illegal move {uci!r}"}
        self.board.push(move)
        self.played.append(move.uci())
        self._done = True
        return {**self.public_state(), "opponent_move": None, "error": None}

    def final_answer(self):
        return " ".join(self.played)


def fake_grade(problem, answer):
    return float(answer is not None and problem.answer["gold"] in answer)


class FakeDomains:
    """Look-alikes of the three real domains in one (problem.meta["kind"] picks the env), so one
    runner serves all three."""

    name = "fake"
    ENVS = {"searchqa": FakeSearchEnv, "math": FakeMathEnv, "chess": FakeChessEnv}

    def problems(self, kind):
        fen = "6k1/5ppp/8/8/8/8/5PPP/R5K1 w - - 0 1"  # Ra8#
        question = {"searchqa": "What is the capital of France?", "math": "What is 1 + 1?",
                    "chess": f"Position (FEN): {fen}"}[kind]
        gold = {"searchqa": "Paris", "math": "\\boxed{2}", "chess": "a1a8"}[kind]
        return [Problem(id=f"{kind}{i}", question=question, answer={"gold": gold, "fen": fen}, meta={"kind": kind})
                for i in range(2)]

    def make_env(self, problem):
        return self.ENVS[problem.meta["kind"]](problem)

    def grader(self):
        return fake_grade


class DomainEngine(QueuedSubmit):
    """Plausible replies per domain: a search then an answer; code then a boxed answer; a move."""

    returns_ids = False
    weights_version = "base"

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            last = r.messages[-1]
            prefill = last["content"] if last["role"] == "assistant" else ""
            text = " ".join(m["content"] for m in r.messages)
            if r.choices:
                reply = "a1a8" if "a1a8" in r.choices else r.choices[0]
            elif prefill.endswith("```python\n"):
                reply = "print(1 + 1)\n"
            elif prefill.endswith("\\boxed{"):
                reply = "2}"
            elif "FEN" in text:
                reply = "<move>a1a8</move>"
            elif "capital" in text:
                reply = "Paris" if prefill.endswith("<answer>") else "<search>capital of France"
            else:
                reply = "Compute:\n```python\nprint(1 + 1)\n```\nSo \\boxed{2}" if "Output of" not in text else "\\boxed{2}"
            out.append([Generation(text=reply, finish_reason="stop", prompt_tokens=10, completion_tokens=5)
                        for _ in range(r.n)])
        return out

    def count_tokens(self, messages):
        return 10

    def load_weights(self, path, version):
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def fake_runner():
    cfg = Config()
    cfg.runner.concurrency = 8
    runner = RolloutRunner(DomainEngine(), FakeDomains(), cfg)
    yield runner
    runner.close()


@pytest.mark.parametrize("domain", ["searchqa", "math", "chess"])
def test_mutated_base_harnesses_run_cleanly_in_the_sandbox(domain, fake_runner):
    source = real_h0(domain)
    problems = FakeDomains().problems(domain)
    rng = random.Random(0)
    library = M.mutations_for(declared(domain), Config())
    variants = {m.name: M.apply_mutation(m, source, "h0", random.Random(0)) for m in library}
    stacked = source
    for m in rng.sample(library, 3):
        stacked = M.apply_mutation(m, stacked, "hx", rng) or stacked
    variants["stacked"] = stacked
    variants["h0"] = source
    for name, src in variants.items():
        trajs = fake_runner.run(src, problems, 1, harness_id=name, purpose="smoke")
        assert all(t.error is None for t in trajs), (name, trajs[0].error)
        assert all(t.reward == 1.0 for t in trajs), (name, trajs[0].answer)
