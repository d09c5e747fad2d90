"""The offline proposer's domain-general mechanisms, and hints as declared domain knowledge.

Each mechanism is run as the harness code it splices (the candidate's whole source, executed with
a scripted `llm` and a recording `env`), and the test shows the submission the grader reads with
the mechanism against the one without it (the parent), so it fails if the mechanism does nothing.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from whale.config import Config
from whale.domains.base import AnswerFormat, Problem
from whale.domains.reasoning_gym.domain import ReasoningGymDomain
from whale.domains.searchqa.domain import SearchQADomain
from whale.harness import mutation as M
from whale.harness.archive import Archive
from whale.harness.brief import make_brief
from whale.harness.diagnose import diagnose, episode_modes
from whale.harness.mechanism import NO_HINTS
from whale.harness.proposal import ProposalContext
from whale.harness.validate import static_check

from examples.language_domain import H0 as LANG_H0
from examples.language_domain import LanguageDomain, grade_label

TAGS = ReasoningGymDomain.answer_format
LABELS = LanguageDomain.answer_format
PLAIN_H0 = '''
SYSTEM_PROMPT = "Answer the question."
USER_PROMPT = "{question}"


def run(env, llm):
    out = llm([{"role": "system", "content": SYSTEM_PROMPT},
               {"role": "user", "content": USER_PROMPT.format(question=env.question)}])
    env.submit(str(out))
'''


class Reply(str):
    def __new__(cls, text, finish_reason="stop"):
        obj = super().__new__(cls, text)
        obj.finish_reason = finish_reason
        obj.tool_calls = None
        obj.usage = {}
        return obj


class Env:
    def __init__(self, question):
        self.question = question
        self.submitted = None

    def submit(self, answer):
        self.submitted = str(answer)


def play(source: str, question: str, reply) -> tuple[str, list[dict]]:
    """Run a harness source once: `reply(messages, kw)` scripts the model; returns (submission, calls)."""
    calls: list[dict] = []

    def llm(messages, **kw):
        calls.append({"messages": [dict(m) for m in messages], **kw})
        out = reply(messages, kw)
        return [Reply(out) for _ in range(kw["n"])] if kw.get("n", 1) != 1 else Reply(out)

    ns: dict = {"__name__": "harness"}
    exec(compile(source, "harness.py", "exec"), ns)
    env = Env(question)
    ns["run"](env, llm)
    return env.submitted, calls


def mechanism(name: str, fmt: AnswerFormat | None, solved=()) -> M.Mutation:
    return next(m for m in M.general_library(fmt, Config(), list(solved)) if m.name == name)


def applied(name: str, source: str, fmt: AnswerFormat | None, solved=()) -> str:
    new = M.apply_mutation(mechanism(name, fmt, solved), source, "h0", random.Random(0))
    assert new is not None and static_check(new, Config()) is None
    return new


def lang_problem(label="French"):
    return Problem(id="p", question="Bonjour. Le chat dort.", answer=label)


# ----- the declared answer format and the general failure modes --------------------------------------
def test_answer_format_extracts_what_the_grader_reads():
    assert TAGS.extract("think... <answer> 7 </answer> <answer>8</answer>") == "8"
    assert TAGS.extract("no tag") is None and TAGS.extract(None) is None
    assert LABELS.extract(" French ") == "French"
    assert LABELS.extract("french") is None and LABELS.extract("It is French.") is None


def test_general_failure_modes_come_from_the_declared_format():
    def row(answer, reward=0.0):
        return {"question": "q", "reward": reward, "answer": answer, "calls": [], "tool_calls": []}

    assert episode_modes(row("It is French."), LABELS) == ["format_mismatch"]
    assert episode_modes(row("<answer></answer>"), TAGS) == ["empty_format"]
    assert episode_modes(row("<answer>No\nbecause</answer>"), TAGS) == ["multiline_answer"]
    assert episode_modes(row("<answer>No</answer>"), TAGS) == ["wrong_answer"]
    assert episode_modes(row("It is French.")) == ["wrong_answer"]  # nothing declared: nothing to check
    # a domain's own modes only with its hints
    sentence = row("<answer>" + "word " * 9 + "</answer>")
    assert "long_answer" in episode_modes(sentence, SearchQADomain.answer_format, SearchQADomain.hints)
    assert "long_answer" not in episode_modes(sentence, SearchQADomain.answer_format, NO_HINTS)
    d = diagnose([row("It is French.")] * 3 + [row("French", 1.0)], LABELS)
    assert (d.failures, d.dominant) == (3, "format_mismatch") and "answer format" in d.text()


# ----- each mechanism, run ----------------------------------------------------------------------------
def test_answer_prefill_opens_the_reply_in_the_format_and_stops_at_its_close():
    def model(messages, kw):
        return "Yes" if messages[-1] == {"role": "assistant", "content": "<answer>"} else "I think the answer is yes."

    before, _ = play(PLAIN_H0, "Does it follow?", model)
    after, calls = play(applied("answer_prefill", PLAIN_H0, TAGS), "Does it follow?", model)
    assert TAGS.extract(before) is None and TAGS.extract(after) == "Yes"
    assert "</answer>" in calls[0]["stop"]


def test_answer_line_stop_ends_a_prefilled_answer_at_its_line():
    prefilled = applied("answer_prefill", PLAIN_H0, TAGS)

    def model(messages, kw):
        return "No" if "\n" in (kw.get("stop") or []) else "No\n\nBecause all cats are mammals."

    before, _ = play(prefilled, "Does it follow?", model)
    after, calls = play(applied("answer_line_stop", prefilled, TAGS), "Does it follow?", model)
    assert TAGS.extract(before).startswith("No\n") and TAGS.extract(after) == "No"
    assert set(calls[0]["stop"]) == {"</answer>", "\n"}


def test_constrained_answer_draws_one_of_the_graders_choices():
    def model(messages, kw):
        return kw["choices"][1] if kw.get("choices") else "This text is written in French."

    before, _ = play(LANG_H0, "Bonjour. Le chat dort.", model)
    after, calls = play(applied("constrained_answer", LANG_H0, LABELS), "Bonjour. Le chat dort.", model)
    assert grade_label(lang_problem(), before) == 0.0 and grade_label(lang_problem(), after) == 1.0
    assert calls[0]["choices"] == list(LABELS.choices)


def test_answer_extraction_submits_the_choice_the_reply_names():
    def model(messages, kw):
        return "The text is written in french, not in English."

    before, _ = play(LANG_H0, "Bonjour. Le chat dort.", model)
    after, calls = play(applied("answer_extraction", LANG_H0, LABELS), "Bonjour. Le chat dort.", model)
    assert grade_label(lang_problem(), before) == 0.0 and after == "French" and len(calls) == 1
    tagged, _ = play(applied("answer_extraction", PLAIN_H0, TAGS), "q", lambda m, kw: "Let me think.\n42")
    assert tagged == "<answer>42</answer>"


def test_format_repair_asks_once_more_when_the_submission_does_not_parse():
    def model(messages, kw):
        return "French" if kw.get("choices") else "This text is written in French."

    before, _ = play(LANG_H0, "Bonjour. Le chat dort.", model)
    after, calls = play(applied("format_repair", LANG_H0, LABELS), "Bonjour. Le chat dort.", model)
    assert grade_label(lang_problem(), before) == 0.0 and grade_label(lang_problem(), after) == 1.0
    assert len(calls) == 2 and "formatted as" in calls[1]["messages"][-1]["content"]
    # a submission that already parses costs no call
    _, calls = play(applied("format_repair", LANG_H0, LABELS), "q", lambda m, kw: "French")
    assert len(calls) == 1
    tagged, calls = play(applied("format_repair", PLAIN_H0, TAGS), "q", lambda m, kw: "7" if kw.get("stop") else "so 7")
    assert tagged == "<answer>7</answer>" and calls[1]["messages"][-1] == {"role": "assistant", "content": "<answer>"}


def test_few_shot_shows_solved_harness_episodes_but_never_an_episodes_own_answer():
    rows = [{"question": "Hola. Es tarde.", "answer": "Spanish", "reward": 1.0},
            {"question": "Hello. It is late.", "answer": "English", "reward": 1.0},
            {"question": "Ciao.", "answer": "I do not know", "reward": 0.0}]
    solved = M.solved_examples(rows)
    assert solved == [("Hola. Es tarde.", "Spanish"), ("Hello. It is late.", "English")]
    source = applied("few_shot", LANG_H0, LABELS, solved)
    _, calls = play(LANG_H0, "Bonjour.", lambda m, kw: "French")
    _, shot = play(source, "Bonjour.", lambda m, kw: "French")
    assert len(shot[0]["messages"]) == len(calls[0]["messages"]) + 4
    assert {"role": "assistant", "content": "Spanish"} in shot[0]["messages"]
    _, own = play(source, "Hola. Es tarde.", lambda m, kw: "Spanish")
    assert {"role": "assistant", "content": "Spanish"} not in own[0]["messages"]  # its own answer is left out
    assert "few_shot" not in {m.name for m in M.general_library(LABELS, Config(), [])}  # nothing solved: none


def test_answer_trim_turns_partial_credit_into_full_credit():
    pytest.importorskip("reasoning_gym")  # the optional extra whose scorer gives the partial credit
    from whale.domains.reasoning_gym.grading import grade_reasoning_gym

    def row(answer, reward):
        return {"question": "q", "reward": reward, "answer": answer, "calls": [], "tool_calls": []}

    assert episode_modes(row("<answer>No.</answer>", 2 / 3), TAGS) == ["partial_credit"]
    assert diagnose([row("<answer>No.</answer>", 2 / 3)], TAGS).failures == 1  # below full credit: diagnosed
    problem = Problem(id="p", question="Does it follow? (Answer Yes or No)", answer="No", source="syllogism",
                      meta={"task": "syllogism", "config": {},
                            "entry": {"question": "q", "answer": "No", "metadata": {}}})
    model = lambda m, kw: "<answer>No.</answer>"  # noqa: E731
    before, _ = play(PLAIN_H0, "q", model)
    after, _ = play(applied("answer_trim", PLAIN_H0, TAGS), "q", model)
    assert 0 < grade_reasoning_gym(problem, before) < 1 and grade_reasoning_gym(problem, after) == 1.0
    assert after == "<answer>No</answer>"
    plain, _ = play(applied("answer_trim", LANG_H0, AnswerFormat("the number", pattern=r"\d+")), "q",
                    lambda m, kw: " 42. ")
    assert plain == "42"


def test_more_tokens_doubles_the_replys_room_up_to_the_cap():
    cfg = Config()
    _, before = play(PLAIN_H0, "q", lambda m, kw: "x")
    _, after = play(applied("more_tokens", PLAIN_H0, None), "q", lambda m, kw: "x")
    assert "max_tokens" not in before[0] and after[0]["max_tokens"] == min(cfg.sampling.max_tokens_cap,
                                                                           2 * cfg.sampling.max_tokens)


def test_format_mechanisms_exist_only_where_the_domain_declares_a_format():
    names = {m.name for m in M.general_library(None, Config())}
    assert names == {"majority_vote", "system_prompt_rewrite", "more_tokens"}
    assert {"answer_prefill", "answer_line_stop", "format_repair", "answer_extraction"} <= \
        {m.name for m in M.general_library(TAGS, Config())}
    assert "constrained_answer" in {m.name for m in M.general_library(LABELS, Config())}


# ----- hints: declared, switchable, labelled ---------------------------------------------------------
def lang_archive(tmp_path) -> Archive:
    from whale.rollout.trajectory import Trajectory

    archive = Archive(tmp_path)
    archive.add_candidate(LANG_H0, None, "base")
    rows = [{"problem_id": f"p{i}", "sample": 0, "harness_id": "h0", "question": f"Bonjour {i}.",
             "answer": "This text is written in French.", "reward": 0.0, "calls": [], "tool_calls": []}
            for i in range(6)]
    archive.record_scores("h0", "base", [Trajectory.from_json(r) for r in rows])
    return archive


def test_hints_off_the_proposer_fixes_the_format_with_general_mechanisms_only(tmp_path):
    ctx = ProposalContext(iteration=1, weights_version="base", incoming_id="h0")
    off = Config.model_validate({"harness": {"domain_hints": "off"}})
    got = M.MutationProposer(seed=0, cfg=off).propose(lang_archive(tmp_path / "a"), LanguageDomain, 4, tmp_path, ctx)
    assert len(got) == 4 and not any(p.mechanism.startswith("hint: ") for p in got)
    assert {p.mechanism for p in got[:3]} <= {"constrained_answer", "answer_extraction", "format_repair",
                                              "system_prompt_rewrite"}
    assert all("format_mismatch in 6/6" in p.hypothesis for p in got)
    on = M.MutationProposer(seed=0, cfg=Config()).propose(lang_archive(tmp_path / "b"), LanguageDomain, 6, tmp_path,
                                                          ctx)
    hinted = [p for p in on if p.mechanism == "hint: label_only_reminder"]
    assert hinted and "Mechanism: hint: label_only_reminder" in hinted[0].source


def test_the_brief_carries_the_hints_as_text_only_when_on():
    domain = SearchQADomain(Config())
    on = make_brief(domain, Config(), 2, weights_version="base", incoming_id="h0")
    off = make_brief(domain, Config.model_validate({"harness": {"domain_hints": False}}), 2,
                     weights_version="base", incoming_id="h0")
    assert "## Domain hints" in on and "question_as_query" in on
    assert on.index("## The domain") < on.index("## Domain hints") < on.index("## What to read")
    assert "## Domain hints" not in off and "question_as_query" not in off


def test_report_and_compare_name_the_proposer_hints_and_accepted_mechanisms(tmp_path):
    from whale.compare import _method
    from whale.report import provenance_line, search_provenance

    rows = [{"event": "candidate", "id": "h1", "parent": "h0", "mechanism": "answer_extraction"},
            {"event": "candidate", "id": "h2", "parent": "h1", "mechanism": "hint: label_only_reminder"},
            {"event": "harness_accepted", "accepted": "h2", "harness": "h0"}]
    cfg = {"schedule": {"kind": "harness_only"}, "harness": {"proposer": "mutation", "domain_hints": False}}
    line = provenance_line(search_provenance(cfg, rows))
    assert line == ("proposer **mutation**, domain hints **off**, accepted mechanisms: "
                    "h2 = answer_extraction + hint: label_only_reminder")
    assert _method(cfg) == "harness_only+hints-off"
    assert _method({"schedule": {"kind": "harness_only"}}) == "harness_only"
    assert search_provenance({"schedule": {"kind": "weight_only"}}, rows) == {}
    assert json.dumps(search_provenance({"schedule": {"kind": "whale"}}, []))  # old runs: hints were on
    assert re.search(r"hints \*\*on\*\*", provenance_line(search_provenance({"schedule": {"kind": "whale"}}, [])))
