"""Math domain: the boxed/math-verify grader, the generator, splits, real-data loaders, h0."""

import ast
import pickle
import re
import threading
from pathlib import Path

import pytest

from whale.config import Config
from whale.domains.base import SPLITS, Problem
from whale.domains.math import MathDomain
from whale.domains.math import data as math_data
from whale.domains.math.env import MathEnv
from whale.domains.math.grading import grade_answer, grade_math, last_boxed
from whale.engine.base import QueuedSubmit
from whale.harness.mutation import mutations_for

FIXTURES = Path(__file__).parent / "fixtures" / "math"


def make_cfg(source="offline", data_path=None, weight=512, harness=64, val=64, test=64, **options):
    cfg = Config()
    cfg.domain.name = "math"
    cfg.domain.source = source
    cfg.domain.data_path = None if data_path is None else str(data_path)
    cfg.domain.options = options
    cfg.domain.splits.weight, cfg.domain.splits.harness = weight, harness
    cfg.domain.splits.val, cfg.domain.splits.test = val, test
    return cfg


# --- grader -----------------------------------------------------------------------------------


@pytest.mark.parametrize("gold, answer, expected", [
    ("42", "so the result is \\boxed{42}", 1.0),
    ("42", "The answer is 42", 0.0),  # strict: no box, no reward
    ("0.75", "\\boxed{3/4}", 1.0),
    ("3/4", "\\boxed{0.75}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("42", "\\boxed{41}", 0.0),
    ("42", "first \\boxed{41}, no wait: \\boxed{42}", 1.0),  # the last box wins
    ("42", "first \\boxed{42}, no wait: \\boxed{41}", 0.0),
    ("1000", "\\boxed{1,000}", 1.0),
    ("42", "\\boxed{\\$42}", 1.0),
    ("42", "\\boxed{42 \\text{ apples}}", 1.0),
    ("5", "\\boxed{x = 5}", 1.0),
    ("85", "\\boxed{37 + 48}", 0.0),  # copying the question into the box is not an answer
    ("85", "\\boxed{37 + 48 = 85}", 1.0),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1.0),  # LaTeX gold is wrapped in $...$ before parsing
    ("x^2+1", "\\boxed{x^2 + 1}", 1.0),
])
def test_grader_cases(gold, answer, expected):
    assert grade_answer(gold, answer) == expected


def test_lenient_last_number_option():
    assert grade_answer("42", "I think it is 41, no, 42.") == 0.0
    assert grade_answer("42", "I think it is 41, no, 42.", lenient_last_number=True) == 1.0
    assert grade_answer("42", "it is 41", lenient_last_number=True) == 0.0
    assert grade_answer("42", "\\boxed{41} but really 42", lenient_last_number=True) == 0.0  # a box still rules


@pytest.mark.parametrize("garbage", [
    None, "", "\\boxed{", "\\boxed{\\frac{", "\\boxed{}", "}{}{\\boxed{)(}", "\\boxed{" + "{" * 5000,
    "\\boxed{" + "9" * 400 + "}", "x" * 100_000, "\\boxed{\\sqrt[}", 12345, b"\\boxed{42}", ["\\boxed{42}"],
    "\\boxed{1/0}", "\\boxed{\\infty}", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
])
def test_garbage_never_raises(garbage):
    assert grade_answer("42", garbage) in (0.0, 1.0)
    assert grade_answer("\\frac{1}{2}", garbage) in (0.0, 1.0)


def test_grader_works_outside_the_main_thread():
    result = []
    t = threading.Thread(target=lambda: result.append(grade_answer("0.75", "\\boxed{3/4}")))
    t.start()
    t.join()
    assert result == [1.0]


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{5} then \\boxed{unclosed") == "5"
    assert last_boxed("\\boxed 7") == "7"
    assert last_boxed("nothing here") is None


def test_domain_grader_is_picklable_and_respects_lenient_option():
    problem = Problem(id="p", question="What is 6 * 7?", answer="42", source="arith_mul")
    strict = MathDomain(make_cfg()).grader()
    lenient = pickle.loads(pickle.dumps(MathDomain(make_cfg(lenient_last_number=True)).grader()))
    assert strict(problem, "42") == 0.0 and lenient(problem, "42") == 1.0
    assert pickle.loads(pickle.dumps(strict))(problem, "\\boxed{42}") == 1.0
    assert grade_math(problem, "\\boxed{42}") == 1.0
    assert MathDomain(make_cfg()).grade(problem, "\\boxed{43}") == 0.0


# --- generator and offline splits ----------------------------------------------------------------


def test_generator_is_deterministic_and_correct():
    for source in math_data.GENERATED:
        a = math_data.generate(source, 200, seed=3)
        b = math_data.generate(source, 200, seed=3)
        c = math_data.generate(source, 200, seed=4)
        assert [p.question for p in a] == [p.question for p in b]
        assert [p.question for p in a] != [p.question for p in c]
        assert len({p.question for p in a}) == 200
        assert all(p.source == source and re.fullmatch(r"-?\d+", p.answer) for p in a)
    for p in math_data.generate("arith_mixed", 100, seed=0) + math_data.generate("arith_add", 100, seed=0):
        expr = re.search(r"(?:is|Compute|Calculate(?: the value of)?) (.+?)[?.]$", p.question).group(1)
        expr = expr.replace("plus", "+").replace("minus", "-")
        assert eval(expr) == int(p.answer), p.question  # test-only check of our own literal expressions


def test_offline_splits_are_disjoint_deterministic_and_mixed():
    cfg = make_cfg()
    splits = MathDomain(cfg).load_splits()
    assert {k: len(v) for k, v in splits.items()} == {"weight": 512, "harness": 64, "val": 64, "test": 64}
    questions = [math_data.normalize_question(p.question) for v in splits.values() for p in v]
    assert len(set(questions)) == len(questions)
    ids = [p.id for v in splits.values() for p in v]
    assert len(set(ids)) == len(ids)
    sources = {p.source for p in splits["test"]}
    assert sources == {"arith_add", "arith_mul", "arith_mixed", "word", "gsm8k"}
    again = MathDomain(make_cfg()).load_splits()
    assert [p.id for p in again["test"]] == [p.id for p in splits["test"]]
    cfg.seed = 7
    assert [p.id for p in MathDomain(cfg).load_splits()["test"]] != [p.id for p in splits["test"]]
    bigger = MathDomain(make_cfg(weight=1000)).load_splits()
    assert [p.id for p in bigger["test"]] == [p.id for p in splits["test"]]  # test set stable


def _arith_expression_key(question):
    """The test's own canonical form of an arith_* question: parse it, sort the operands of + and *."""
    text = re.search(r"(?:is|Compute|Calculate(?: the value of)?) (.+?)[?.]$", question).group(1)
    for word, op in (("plus", "+"), ("minus", "-"), ("times", "*"), ("divided by", "/")):
        text = text.replace(word, op)

    def canon(node):
        if isinstance(node, ast.Constant):
            return str(node.value)
        parts = [canon(node.left), canon(node.right)]
        op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(node.op)]
        return "(" + op.join(sorted(parts) if op in "+*" else parts) + ")"

    return canon(ast.parse(text, mode="eval").body)


def _content_key(p):
    if p.source.startswith("arith_"):
        return _arith_expression_key(p.question)
    if p.source == "word":  # the generator's expression, checked against the question and the answer
        expr = p.meta["expression"]
        assert sorted(re.findall(r"\d+", expr)) == sorted(re.findall(r"\d+", p.question)), p.question
        assert eval(expr) == int(p.answer), p.question  # test-only: our own literal expression
        return expr
    return math_data.normalize_question(p.question)


def test_phrasings_of_one_expression_share_a_key():
    assert _arith_expression_key("What is 7 * 8?") == _arith_expression_key("Compute 8 times 7.")
    assert math_data.mul(7, 8) == math_data.mul(8, 7) == _arith_expression_key("Calculate 8 * 7.")
    assert math_data.add(math_data.mul(3, 4), 5) == math_data.add(5, math_data.mul(4, 3))
    assert math_data.sub(9, 4) != math_data.sub(4, 9)


@pytest.mark.parametrize("seed, weight, harness, val, test, mix", [
    (0, 512, 64, 64, 64, None),
    (1, 1000, 16, 16, 32, None),
    (3, 200, 40, 40, 60, {"arith_mul": 0.5, "word": 0.5}),  # products as numbers and as stories
    (8, 200, 40, 40, 40, {"arith_mul": 1}),
])
def test_no_expression_crosses_splits(seed, weight, harness, val, test, mix):
    cfg = make_cfg(weight=weight, harness=harness, val=val, test=test, **({"mix": mix} if mix else {}))
    cfg.seed = seed
    splits = MathDomain(cfg).load_splits()
    assert {k: len(v) for k, v in splits.items()} == {"weight": weight, "harness": harness, "val": val, "test": test}
    owner = {}
    for name, problems in splits.items():
        for p in problems:
            key = _content_key(p)
            assert owner.setdefault(key, name) == name, f"{key} ({p.question!r}) in {owner[key]} and {name}"


def test_more_problems_than_expressions_is_a_clear_error():
    with pytest.raises(ValueError, match="arith_mul' found only 341 problems with distinct expressions"):
        MathDomain(make_cfg(weight=400, harness=4, val=4, test=4, mix={"arith_mul": 1})).load_splits()


@pytest.mark.parametrize("source, data_path, settings, message", [
    ("offline", "data/gsm8k.jsonl", {}, "domain.data_path is read only with domain.source: gsm8k"),
    ("gsm8k", FIXTURES / "gsm8k.jsonl", {"options": {"mix": {"word": 1}}},
     "domain.options.mix is read only with domain.source: offline"),
    ("offline", None, {"options": {"eval_path": "aime.jsonl"}}, "domain.options.eval_path is read only with"),
    ("gsm8k", FIXTURES / "gsm8k.jsonl", {"options": {"eval_source": "aime"}},
     "domain.options.eval_source is read only with domain.options.eval_path"),
    ("offline", None, {"corpus_path": "c.jsonl"}, "math: domain.corpus_path is not read"),
    ("offline", None, {"retriever_url": "http://x"}, "math: domain.retriever_url is not read"),
    ("offline", None, {"judge_model": "gpt-4o-mini"}, "math: domain.judge_model is not read"),
    ("offline", None, {"grader": "em"}, "math: domain.grader must be one of"),
])
def test_math_settings_the_mode_ignores_are_errors(source, data_path, settings, message):
    cfg = make_cfg(source, data_path)
    for key, value in settings.items():
        setattr(cfg.domain, key, value)
    with pytest.raises(ValueError, match=message):
        MathDomain(cfg)
    cfg = make_cfg()
    cfg.domain.budget.invalid_moves = 1
    with pytest.raises(ValueError, match="budget.invalid_moves is not read"):
        MathDomain(cfg)


def test_mix_option_and_clear_errors():
    splits = MathDomain(make_cfg(weight=20, harness=4, val=4, test=4, mix={"arith_add": 1})).load_splits()
    assert {p.source for v in splits.values() for p in v} == {"arith_add"}
    with pytest.raises(ValueError, match="GSM8K set has 100"):
        MathDomain(make_cfg(weight=300, mix={"gsm8k": 1})).load_splits()
    with pytest.raises(ValueError, match="unknown source"):
        MathDomain(make_cfg(mix={"algebra": 1})).load_splits()
    with pytest.raises(ValueError, match="unknown domain.source"):
        MathDomain(make_cfg(source="mathqa"))
    with pytest.raises(ValueError, match="unknown domain.options"):
        MathDomain(make_cfg(lenient_last_numbr=True))


def test_vendored_gsm8k_has_100_problems_and_licence_note():
    problems = math_data.load_gsm8k_vendored()
    assert len(problems) == 100 and len({p.question for p in problems}) == 100
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", p.answer) for p in problems)
    header = math_data.GSM8K_FILE.read_text().splitlines()[0]
    assert "MIT" in header and "GSM8K" in header


# --- real-data loaders on fixtures -----------------------------------------------------------


def test_gsm8k_loader_extracts_answers_and_dedupes():
    splits = MathDomain(make_cfg("gsm8k", FIXTURES / "gsm8k.jsonl", weight=2, harness=1, val=1, test=1)).load_splits()
    problems = [p for s in SPLITS for p in splits[s]]
    assert len(problems) == 5
    answers = {p.question.split()[0]: p.answer for p in problems}
    assert answers["Natalia"] == "72" and answers["A"] == "2400"
    assert all(p.source == "gsm8k" for p in problems)
    with pytest.raises(ValueError, match="5 distinct problems"):
        MathDomain(make_cfg("gsm8k", FIXTURES / "gsm8k.jsonl", weight=3, harness=1, val=1, test=1)).load_splits()


def test_dapo_loader_strips_the_answer_instruction():
    splits = MathDomain(make_cfg("dapo", FIXTURES / "dapo.jsonl", weight=2, harness=1, val=0, test=1)).load_splits()
    problems = [p for s in SPLITS for p in splits[s]]
    assert {p.answer for p in problems} == {"5", "28", "8", "1024"}
    for p in problems:
        assert "Answer:" not in p.question and "Remember" not in p.question and p.question.endswith((".", "?"))
    processed = MathDomain(make_cfg("dapo", FIXTURES / "dapo_processed.jsonl", weight=1, harness=0, val=0,
                                    test=1)).load_splits()
    assert {p.answer for s in SPLITS for p in processed[s]} == {"2", "30"}


def test_dapo_train_with_aime_test_like_the_paper():
    cfg = make_cfg("dapo", FIXTURES / "dapo.jsonl", weight=3, harness=1, val=1, test=3,
                   eval_path=str(FIXTURES / "aime.jsonl"), eval_source="aime")
    splits = MathDomain(cfg).load_splits()
    assert all(p.source.startswith("aime20") for p in splits["test"] + splits["val"])
    assert all(p.source == "dapo" for p in splits["weight"] + splits["harness"])
    assert {p.source for p in splits["test"] + splits["val"]} <= {"aime2024", "aime2025"}


def test_aime_loader_from_parquet_and_folder(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import json

    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIXTURES / "aime.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("year")  # year from the id instead
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "aime.parquet")
    splits = MathDomain(make_cfg("aime", tmp_path, weight=1, harness=1, val=1, test=1)).load_splits()
    problems = [p for s in SPLITS for p in splits[s]]
    assert sorted(p.answer for p in problems) == ["120", "14", "23", "576"]
    assert {p.source for p in problems} == {"aime2024", "aime2025"}


def test_loader_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="needs domain.data_path"):
        MathDomain(make_cfg("gsm8k")).load_splits()
    with pytest.raises(ValueError, match="neither a file"):
        MathDomain(make_cfg("gsm8k", tmp_path / "nope" / "x.jsonl")).load_splits()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no hashes"}\n')
    with pytest.raises(ValueError, match="####"):
        MathDomain(make_cfg("gsm8k", bad, weight=1, harness=0, val=0, test=0)).load_splits()


# --- env and h0 ------------------------------------------------------------------------------


class EnvProxy:
    """What the sandbox gives a harness: public_state as attributes, tools as methods."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        if name in self._env.tools:
            return getattr(self._env, name)
        return self._env.public_state()[name]


def _h0():
    source = MathDomain(make_cfg()).base_harness()
    ns = {}
    exec(compile(source, "h0.py", "exec"), ns)
    return source, ns


def test_h0_shape():
    source, ns = _h0()
    assert ns["SYSTEM_PROMPT"] == ""
    assert "{question}" in ns["USER_PROMPT"] and "\\boxed{}" in ns["USER_PROMPT"].format(question="q")
    assert set(re.findall(r"^\s*(?:import|from)\s+(\w+)", source, re.M)) <= {"re", "json"}


def test_h0_runs_code_then_submits_the_final_reply():
    _, ns = _h0()
    problem = Problem(id="p", question="What is 6 * 7?", answer="42")
    env = MathEnv(problem)
    ran = []
    env.python = lambda code: ran.append(code) or "42\n"  # the sandbox itself is tested below
    replies = iter(["Let me compute.\n```python\nprint(6 * 7)\n```", "The answer is \\boxed{42}."])
    prompts = []

    def llm(messages, **kw):
        prompts.append(list(messages))  # the proxy serialises at call time; copy like it
        return next(replies)

    ns["run"](EnvProxy(env), llm)
    assert ran == ["print(6 * 7)\n"]
    assert prompts[0] == [{"role": "user", "content": ns["USER_PROMPT"].format(question=problem.question)}]
    assert "42" in prompts[1][-1]["content"] and prompts[1][1]["role"] == "assistant"
    assert env.submitted == "The answer is \\boxed{42}." and grade_math(problem, env.final_answer()) == 1.0


def test_h0_without_code_submits_the_first_reply():
    _, ns = _h0()
    env = MathEnv(Problem(id="p", question="What is 2 + 2?", answer="4"))
    ns["run"](EnvProxy(env), lambda messages, **kw: "\\boxed{4}")
    assert env.submitted == "\\boxed{4}"


def test_python_tool_runs_in_the_sandbox():
    env = MathDomain(make_cfg(python_timeout_s=5)).make_env(Problem(id="p", question="q", answer="1"))
    assert env.tools == ("python", "submit")
    assert env.python("print(6 * 7)").strip() == "42"
    assert "Error" in env.python("raise ValueError('boom')")


class ArithmeticEngine(QueuedSubmit):
    """Writes a Python block that evaluates the question's expression, then boxes the tool output."""

    returns_ids = False

    def __init__(self):
        self.weights_version = "base"

    def generate(self, requests, sampling):
        from whale.engine.base import Generation

        out = []
        for r in requests:
            last = r.messages[-1]["content"]
            if last.startswith("Output of your code:"):
                text = "So the answer is \\boxed{" + last.split("\n")[1].strip() + "}."
            else:
                expr = re.search(r"(?:is|Compute|Calculate(?: the value of)?) (.+?)[?.]\n", last).group(1)
                expr = expr.replace("plus", "+").replace("minus", "-").replace("times", "*")
                expr = expr.replace("divided by", "//")
                text = f"```python\nprint({expr})\n```"
            out.append([Generation(text=text, finish_reason="stop")] * r.n)
        return out

    def count_tokens(self, messages):
        return sum(len(m["content"]) for m in messages)

    def load_weights(self, path, version):
        self.weights_version = version

    def close(self):
        pass


def test_h0_through_the_runner_uses_the_python_tool():
    from whale.rollout.runner import RolloutRunner

    cfg = make_cfg(weight=4, harness=4, val=4, test=4, mix={"arith_add": 1, "arith_mul": 1, "arith_mixed": 1})
    domain = MathDomain(cfg)
    problems = domain.load_splits()["test"]
    runner = RolloutRunner(ArithmeticEngine(), domain, cfg)
    try:
        trajs = runner.run(domain.base_harness(), problems)
    finally:
        runner.close()
    assert [t.error for t in trajs] == [None] * 4
    assert [t.reward for t in trajs] == [1.0] * 4
    assert all(t.tool_calls and t.tool_calls[0].name == "python" for t in trajs)


def test_math_hints_offer_one_format_repair_not_two():
    """retry_parse_failure is math's own repair call (prefilled with the boxed answer); with hints on it
    takes the place of the general format_repair, so the search does not spend candidates on both."""
    on = {m.name for m in mutations_for(MathDomain(make_cfg()), make_cfg())}
    off_cfg = make_cfg()
    off_cfg.harness.domain_hints = False
    off = {m.name for m in mutations_for(MathDomain(off_cfg), off_cfg)}
    assert "retry_parse_failure" in on and "format_repair" not in on
    assert "format_repair" in off and "retry_parse_failure" not in off
