"""A toy domain and a scripted engine for runner/search tests (tests only, not product code).

The toy task: "What is A + B?"; env offers `add(a, b)`; the engine answers from a rule so tests
are deterministic and need no model.
"""

from __future__ import annotations

import re

from whale.harness.mechanism import NO_HINTS
from whale.domains.base import EpisodeEnv, Problem
from whale.engine.base import Generation, QueuedSubmit

H0 = '''
SYSTEM_PROMPT = "You add numbers."
USER_PROMPT = "{question}"

def run(env, llm):
    out = llm([{"role": "system", "content": SYSTEM_PROMPT},
               {"role": "user", "content": USER_PROMPT.format(question=env.question)}])
    env.submit(str(out))
'''


class ToyEnv(EpisodeEnv):
    tools = ("add",)

    def add(self, a, b):
        return a + b


def toy_grade(problem, answer):
    return 1.0 if answer is not None and answer.strip() == str(problem.answer) else 0.0


class ToyDomain:
    name = "toy"
    brief = "Answer 'What is A + B?' with the number. env.add(a, b) adds."
    answer_format = None
    hints = NO_HINTS

    def __init__(self, n=8):
        self.problems = [Problem(id=f"p{i}", question=f"What is {i} + {i + 1}?", answer=2 * i + 1,
                                 source="even" if i % 2 == 0 else "odd") for i in range(n)]

    def load_splits(self):
        p = self.problems
        return {"weight": p, "harness": p, "val": p, "test": p}

    def make_env(self, problem):
        return ToyEnv(problem)

    def grader(self):
        return toy_grade

    def grade(self, problem, answer):
        return toy_grade(problem, answer)

    def base_harness(self):
        return H0


class ScriptedEngine(QueuedSubmit):
    """Answers 'What is A + B?' correctly when the prompt asks 'correctly', else with A.

    Returns fake ids (one id per character) so training-row code paths can be exercised.
    """

    returns_ids = True

    def __init__(self):
        self.weights_version = "base"
        self.calls = 0
        self.batch_sizes = []

    def generate(self, requests, sampling):
        self.batch_sizes.append(len(requests))
        out = []
        for r in requests:
            self.calls += 1
            text = " ".join(m["content"] for m in r.messages)
            nums = [int(x) for x in re.findall(r"\d+", text)]
            if r.choices:
                gens = [Generation(text=r.choices[0], finish_reason="choice", weights_version=self.weights_version)]
            else:
                ans = str(sum(nums[-2:])) if "correctly" in text and len(nums) >= 2 else (str(nums[0]) if nums else "?")
                prompt_ids = [ord(c) % 256 for c in text][:64]
                gens = [Generation(text=ans, finish_reason="stop", prompt_ids=prompt_ids,
                                   completion_ids=[ord(c) for c in ans] + [0], weights_version=self.weights_version,
                                   prompt_tokens=len(prompt_ids), completion_tokens=len(ans) + 1)
                        for _ in range(r.n)]
            out.append(gens)
        return out

    def count_tokens(self, messages):
        return sum(len(m["content"]) for m in messages)

    def load_weights(self, path, version):
        self.weights_version = version

    def close(self):
        pass


def parity_grade(problem, answer):
    """Accepts about half of random outputs (even length): gives a random tiny model rows to train on."""
    return 1.0 if answer is not None and len(answer) % 2 == 0 else 0.0


class ParityDomain(ToyDomain):
    """ToyDomain built from a config (as `domain.module` loads it), graded by answer-length parity."""

    name = "parity"

    def __init__(self, cfg):
        super().__init__(64)
        s = cfg.domain.splits
        p = self.problems
        self.splits = {"test": p[: s.test], "val": p[s.test: s.test + s.val],
                       "harness": p[s.test + s.val: s.test + s.val + s.harness],
                       "weight": p[s.test + s.val + s.harness: s.test + s.val + s.harness + s.weight]}

    def load_splits(self):
        return self.splits

    def grader(self):
        return parity_grade

    def grade(self, problem, answer):
        return parity_grade(problem, answer)
