"""Your own task as a WHALE domain: unit conversion with a calculator tool.

Use it with:

    PYTHONPATH=. whale eval --set domain.module=examples.custom_domain:UnitsDomain --harness h0 --k 2 --limit 8

(from the repository root, so that `examples` is importable; any importable module works)

A domain provides four things (whale.domains.base.Domain): disjoint splits of `Problem`s, an
episode environment whose tool methods the harness can call through `env`, a pure grading
function the parent runs after the episode, and a base harness h0. The harness never sees
`Problem.answer`; tools run in the parent; the harness runs in the sandbox.
"""

from __future__ import annotations

import functools
import random

from whale.config import Config
from whale.domains.base import AnswerFormat, EpisodeEnv, EpisodeError, Problem
from whale.harness.mechanism import NO_HINTS

FACTORS = {("km", "m"): 1000, ("m", "cm"): 100, ("kg", "g"): 1000, ("h", "min"): 60, ("min", "s"): 60}

H0 = '''
SYSTEM_PROMPT = "You convert units. Use the calculator when useful."
USER_PROMPT = "{question} Reply with the number only."

def run(env, llm):
    out = llm([{"role": "system", "content": SYSTEM_PROMPT},
               {"role": "user", "content": USER_PROMPT.format(question=env.question)}], max_tokens=16)
    env.submit(out.strip())
'''


class UnitsEnv(EpisodeEnv):
    tools = ("calculate",)

    def calculate(self, a: float, op: str, b: float) -> float:
        """A four-function calculator: the domain's tool, executed in the parent."""
        if op not in "+-*/" or len(op) != 1:
            raise EpisodeError("op must be one of + - * /")
        a, b = float(a), float(b)
        if op == "/" and b == 0:
            raise EpisodeError("division by zero")
        return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0.0}[op]


def grade_units(problem: Problem, answer: str | None) -> float:
    try:
        return 1.0 if answer is not None and abs(float(answer.strip()) - float(problem.answer)) < 1e-6 else 0.0
    except ValueError:
        return 0.0


class UnitsDomain:
    name = "units"
    brief = ("Questions 'How many <unit> are in N <unit>?'. env.calculate(a, op, b) is a calculator. "
             "Submit the number only with env.submit(str). Graded by numeric equality.")
    grader_name = "numeric"
    answer_format = AnswerFormat("the number only", pattern=r"^\s*-?\d+(?:\.\d+)?\s*$")  # what the grader reads
    hints = NO_HINTS  # no knowledge for proposers beyond the above (see examples/label_domain.py for a hint)

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def load_splits(self) -> dict[str, list[Problem]]:
        rng = random.Random(self.cfg.seed)
        seen, problems = set(), []
        while len(problems) < 400:
            (big, small), f = rng.choice(list(FACTORS.items()))
            n = rng.randint(1, 99)
            q = f"How many {small} are in {n} {big}?"
            if q not in seen:
                seen.add(q)
                problems.append(Problem(id=f"u{len(problems)}", question=q, answer=n * f, source=f"{big}->{small}"))
        s = self.cfg.domain.splits
        sizes = [("test", s.test), ("val", s.val), ("harness", s.harness), ("weight", s.weight)]
        out, start = {}, 0
        for name, size in sizes:
            out[name] = problems[start:start + size]
            start += size
        return out

    def make_env(self, problem: Problem) -> UnitsEnv:
        return UnitsEnv(problem)

    def grader(self):
        return functools.partial(grade_units)

    def grade(self, problem: Problem, answer: str | None) -> float:
        return grade_units(problem, answer)

    def base_harness(self) -> str:
        return H0
