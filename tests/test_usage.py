"""Which calls RSFT trains on: only completions that reached the episode's outcome.

Before this rule every recorded call became loss tokens; each test below names the calls that
then would have been trained and must not be now.
"""

from __future__ import annotations

import random
import re

from toy import ToyDomain
from whale.config import Config
from whale.engine.base import Generation, QueuedSubmit
from whale.rollout.runner import RolloutRunner
from whale.rollout.trajectory import LLMCall, ToolCall, Trajectory
from whale.rollout.usage import decide_usage, record_mark
from whale.harness.mutation import MAJORITY_VOTE
from whale.weights.rows import rows_from_trajectory


class ScriptEngine(QueuedSubmit):
    """Replies from `script(request, sample, nth)` (nth: how many times this prompt was asked), with
    one id per character, so the rows show which completions were trained."""

    weights_version = "base"
    weight_sync = "none"

    def __init__(self, script):
        self.script = script
        self.asked: dict[str, int] = {}

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            prompt = "|".join(m["content"] for m in r.messages)
            nth = self.asked.get(prompt, 0)
            self.asked[prompt] = nth + 1
            gens = []
            for i in range(r.n):
                text = r.choices[0] if r.choices else self.script(r, i, nth)
                gens.append(Generation(text=text, finish_reason="choice" if r.choices else "stop",
                                       prompt_ids=[ord(c) for c in prompt], completion_ids=[ord(c) for c in text]))
            out.append(gens)
        return out

    def count_tokens(self, messages):
        return sum(len(m["content"]) for m in messages)

    def load_weights(self, path, version):
        pass

    def close(self):
        pass


def sum_of(request) -> int:
    a, b = re.findall(r"\d+", request.messages[-1]["content"])[:2]
    return int(a) + int(b)


def play(source, script, n_problems=2):
    cfg = Config()
    domain = ToyDomain(n_problems)
    runner = RolloutRunner(ScriptEngine(script), domain, cfg)
    try:
        return runner.run(source, domain.problems)
    finally:
        runner.close()


def trained_texts(traj) -> list[str]:
    """The completions that are loss spans of the episode's rows (ids are characters here)."""
    spans = []
    for row in rows_from_trajectory(traj):
        text, inside = "", False
        for t, m in zip(row.input_ids, row.loss_mask):
            if m:
                text += chr(t)
            elif inside:
                spans.append(text)
                text = ""
            inside = bool(m)
        if text:
            spans.append(text)
    return spans


TAGGED = '''
import re

def run(env, llm):
    out = llm([{"role": "user", "content": env.question}])
    m = re.search(r"<answer>(.*?)</answer>", out)
    env.submit(m.group(1) if m else "none")
'''


def test_majority_vote_trains_only_the_samples_that_gave_the_submitted_answer():
    vote = MAJORITY_VOTE.apply(TAGGED, random.Random(0))
    # three samples: right, wrong, right -> the vote submits the right answer
    trajs = play(vote, lambda r, i, nth: f"<answer>{sum_of(r) + (i == 1)}</answer>")
    for t in trajs:
        assert t.reward == 1.0 and len(t.calls) == 3
        assert [c.used for c in t.calls] == [True, False, True]  # before: all three trained
        assert "final answer" in t.calls[0].use_reason or "env.submit" in t.calls[0].use_reason
        right = f"<answer>{t.answer}</answer>"
        assert trained_texts(t) == [right, right]


def test_retry_loop_trains_only_the_kept_retry():
    retry = '''
import re

def run(env, llm):
    for _ in range(3):
        out = llm([{"role": "user", "content": env.question}])
        m = re.search(r"<answer>(.*?)</answer>", out)
        if m:
            env.submit(m.group(1))
            return
'''
    # the rejected first reply even names the right number, untagged: only the kept retry earned it
    trajs = play(retry, lambda r, i, nth: f"<answer>{sum_of(r)}</answer>" if nth else f"maybe {sum_of(r)}?")
    for t in trajs:
        assert t.reward == 1.0 and len(t.calls) == 2
        assert [c.used for c in t.calls] == [False, True]  # before: the rejected reply trained too
        assert trained_texts(t) == [f"<answer>{t.answer}</answer>"]


def test_explicit_marks_override_the_default():
    marks = '''
import re

def run(env, llm):
    a, b, c = llm([{"role": "user", "content": env.question}], n=3)
    a.discard()   # would be trained by default (it gave the answer)
    b.use()       # would not
    env.submit(re.search(r"<answer>(.*?)</answer>", a).group(1))
'''
    trajs = play(marks, lambda r, i, nth: f"<answer>{sum_of(r) + (i == 1)}</answer>")
    for t in trajs:
        assert t.error is None and t.reward == 1.0
        assert [c.mark for c in t.calls] == [True if i == 1 else False if i == 0 else None for i in range(3)]
        assert [c.used for c in t.calls] == [False, True, True]
        assert t.calls[0].use_reason == "discarded by the harness"
        assert t.calls[1].use_reason == "marked used by the harness"


def test_single_choice_call_gives_no_row_and_cannot_be_marked_used():
    single = '''
def run(env, llm):
    a, b = [int(x) for x in env.question.replace("?", "").split() if x.isdigit()]
    target = llm([{"role": "user", "content": env.question}], choices=[str(a + b)])
    try:
        target.use()
        env.submit("marked")
    except Exception as e:
        env.submit(str(target) if "single choice" in str(e) else "other error")
'''
    trajs = play(single, lambda r, i, nth: "unused")
    for t in trajs:
        assert t.reward == 1.0 and t.calls[0].completion_ids  # accepted, with ids the engine returned
        assert t.calls[0].used is False and t.calls[0].mark is None
        assert rows_from_trajectory(t) == []  # before: the harness's own target became a row


def test_forged_marks_over_the_pipe_are_refused():
    forger = '''
def run(env, llm):
    out = llm([{"role": "user", "content": env.question}])
    channel = next(c.cell_contents for c in out._mark.__closure__ if hasattr(c.cell_contents, "request"))
    refused = []
    for msg in ({"op": "mark", "call": 7, "used": True, "text": "x"},             # not returned to it
                {"op": "mark", "call": 0, "used": True, "text": "invented text"}, # text it did not get
                {"op": "mark", "call": 0, "used": "yes", "text": str(out)},       # not a bool
                {"op": "mark", "call": -1, "used": True, "text": str(out)}):
        try:
            channel.request(dict(msg))
        except Exception as e:
            refused.append(str(e)[:30])
    env.submit(str(len(refused)))
'''
    trajs = play(forger, lambda r, i, nth: "nope")
    for t in trajs:
        assert t.error is None and t.answer == "4"
        assert t.calls[0].mark is None and t.calls[0].used is False


# ------------------------------------------------------------------ the rule on recorded trajectories
def llm_call(messages, completion, prefill=None, choices=None, sample_index=0, ids=None):
    prompt_ids, completion_ids = ids or ([], [])
    return LLMCall(messages=messages, completion=completion, finish_reason="stop", prefill=prefill, choices=choices,
                   sample_index=sample_index, prompt_ids=prompt_ids, completion_ids=completion_ids)


def tool(name, *args, after, error=None):
    return ToolCall(name=name, args=list(args), kwargs={}, result=None, error=error, after_calls=after)


def decided(calls, tools=(), answer=None):
    t = Trajectory(problem_id="p", sample=0, harness_id="h", calls=calls, tool_calls=list(tools), answer=answer)
    decide_usage(t)
    return [c.used for c in t.calls]


def test_searchqa_h0_shape_uses_both_calls_and_the_prefill_alone_produces_nothing():
    user = [{"role": "user", "content": "Question: capital of France?"}]
    first = llm_call(user + [{"role": "assistant", "content": "<search>"}], "capital of France", prefill="<search>")
    second_msgs = user + [{"role": "assistant", "content": "<search>capital of France</search>"},
                          {"role": "user", "content": "<information>Paris is ...</information>"},
                          {"role": "assistant", "content": "<answer>"}]
    second = llm_call(second_msgs, "Paris", prefill="<answer>")
    assert decided([first, second], [tool("search", "capital of France", after=1),
                                     tool("submit", "<answer>Paris</answer>", after=2)],
                   "<answer>Paris</answer>") == [True, True]
    # an empty continuation after the prefill produced nothing, although "<answer>" is in the answer
    empty = llm_call(second_msgs, "", prefill="<answer>")
    assert decided([empty], [tool("submit", "<answer></answer>", after=1)], "<answer></answer>") == [False]


def test_a_dead_end_draft_is_not_trained_even_though_a_later_prompt_quotes_it():
    user = [{"role": "user", "content": "What is 2 + 5?"}]
    draft = llm_call(user, "Let me think: 2 + 5 = 8")
    critique = llm_call([{"role": "user", "content": "Critique: Let me think: 2 + 5 = 8"}], "It is wrong.")
    fresh = llm_call(user, "2 + 5 = 7")  # the harness dropped both and asked again
    assert decided([draft, critique, fresh], [tool("submit", "7", after=3)], "7") == [False, False, True]
    # but a draft carried into the call that produced the answer is trained (transitively)
    draft = llm_call(user, "Let me think: 2 + 5 = 8")
    fixed = llm_call([{"role": "user", "content": "Fix: Let me think: 2 + 5 = 8"}], "so 7")
    assert decided([draft, fixed], [tool("submit", "7", after=2)], "7") == [True, True]


def test_choice_picks_count_when_acted_on_not_when_listed_in_a_later_prompt():
    legal = ["e2e4", "d2d4", "g1f3"]
    first = llm_call([{"role": "user", "content": "Pick a move"}], "d2d4", choices=legal)
    listed = llm_call([{"role": "user", "content": "Pick again. Legal: e2e4 d2d4 g1f3"}], "g1f3", choices=legal)
    # the first pick was never played; the second was
    assert decided([first, listed], [tool("move", "g1f3", after=2)], "g1f3") == [False, True]
    # a refused move is no action
    assert decided([first], [tool("move", "d2d4", after=1, error="illegal")]) == [False]


def test_tool_call_completions_are_carried_by_their_calls():
    asked = llm_call([{"role": "user", "content": "q"}], '<tool_call>{"name": "search"}</tool_call>')
    asked.tool_calls = [{"id": "call_0", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]
    later_msgs = [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": '{"q":"x"}'}}]},
                  {"role": "tool", "content": "result"}]
    answer = llm_call(later_msgs, "done: 42")
    assert decided([asked, answer], [tool("submit", "42", after=2)], "42") == [True, True]
    # whatever a harness put into a message's tool_calls, the decision does not raise
    for junk in (5, "call_0", [None, {"function": 3}, {"function": {"name": "search", "arguments": "{"}}]):
        asked.used = None
        later_msgs[1]["tool_calls"] = junk
        assert decided([asked, llm_call(later_msgs, "done: 42")], [tool("submit", "42", after=2)], "42") == [False, True]


def test_record_mark_checks_what_it_is_given():
    calls = [LLMCall(messages=[], completion="engine error: x", finish_reason="error"),
             llm_call([], "a"), llm_call([], "b", sample_index=1), llm_call([], "only", choices=["only"])]
    t = Trajectory(problem_id="p", sample=0, harness_id="h", calls=calls)
    assert record_mark(t, 0, True, "a") is None and calls[1].mark is True  # the errored round was never returned
    assert record_mark(t, 1, False, "b") is None and calls[2].mark is False
    assert "no completion #3" in record_mark(t, 3, True, "x")
    assert "does not match" in record_mark(t, 0, True, "engine error: x")
    assert "bool" in record_mark(t, True, True, "a")
    assert "single choice" in record_mark(t, 2, True, "only")
    assert record_mark(t, 2, False, "only") is None


# ------------------------------------------------------------------ rows: unused calls inside merged rows
def test_unused_middle_call_is_glue_or_nothing_in_the_merged_row():
    def merged(third_prompt):
        calls = [llm_call([], "a", ids=([1, 2], [3])), llm_call([], "b", ids=([1, 2, 3, 9], [4, 4])),
                 llm_call([], "c", ids=(third_prompt, [5]))]
        for c, used in zip(calls, (True, False, True)):
            c.used = used
        return rows_from_trajectory(Trajectory(problem_id="p", sample=0, harness_id="h", calls=calls))

    # the third prompt contains the unused call: its ids are context (mask 0) of one row
    rows = merged([1, 2, 3, 9, 4, 4, 8])
    assert [(r.input_ids, r.loss_mask) for r in rows] == [([1, 2, 3, 9, 4, 4, 8, 5], [0, 0, 1, 0, 0, 0, 0, 1])]
    # the harness dropped it (a retry): still one row, and the unused ids appear nowhere
    rows = merged([1, 2, 3, 7])
    assert [(r.input_ids, r.loss_mask) for r in rows] == [([1, 2, 3, 7, 5], [0, 0, 1, 0, 1])]


def test_chess_h0_through_the_runner_trains_every_call_of_a_solved_puzzle():
    from test_chess import MateEngine, small_cfg
    from whale.domains.chess import ChessDomain

    class FirstUntagged(MateEngine):
        """Replies without a tag once per episode (h0 retries, keeping the reply in the conversation)."""

        def generate(self, requests, sampling):
            out = super().generate(requests, sampling)
            for r, gens in zip(requests, out):
                if len(r.messages) == 2:
                    gens[:] = [Generation(text="I think the queen moves", finish_reason="stop")]
            return out

    cfg = small_cfg()
    domain = ChessDomain(cfg)
    runner = RolloutRunner(FirstUntagged(), domain, cfg)
    try:
        trajs = runner.run(domain.base_harness(), domain.load_splits()["test"][:2])
    finally:
        runner.close()
    for t in trajs:
        assert t.reward == 1.0 and len(t.calls) == 2
        assert t.tool_calls[0].after_calls == 2
        # the untagged reply stays in the conversation that produced the mate: carried, so trained
        assert [c.used for c in t.calls] == [True, True], [c.use_reason for c in t.calls]
        assert t.calls[0].use_reason == "carried into the prompt of call 1"


def test_searchqa_h0_through_the_runner_trains_both_calls_of_an_answered_question():
    from test_searchqa import ReaderEngine
    from whale.domains.searchqa import SearchQADomain

    cfg = Config()
    domain = SearchQADomain(cfg)
    problems = [p for p in domain.load_splits()["test"] if p.source == "capital"][:3]
    runner = RolloutRunner(ReaderEngine(), domain, cfg)
    try:
        trajs = runner.run(domain.base_harness(), problems)
    finally:
        runner.close()
    solved = [t for t in trajs if t.reward == 1.0]
    assert solved
    for t in solved:
        assert [c.used for c in t.calls] == [True, True], [c.use_reason for c in t.calls]
