"""MathDomain: splits, the episode environment, the math-verify grader and h0 in one object."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

from whale.config import Config, ConfigError
from whale.domains.base import AnswerFormat, DataError, Problem, Setting, refuse_unread_settings, split_sizes
from whale.domains.math import data
from whale.domains.math.env import MathEnv
from whale.domains.math.grading import grade_math
from whale.domains.math.hints import HINTS

BRIEF = """\
Domain: math word problems and arithmetic.
Episode: `env.question` (str) is the problem. Tools:
  - env.python(code: str) -> str: runs a Python snippet in a fresh sandboxed process (no network,
    standard library only, time limit {timeout_s:g} s) and returns its stdout+stderr (truncated), or
    an error string such as "TimeoutError: ...". Print what you want to see.
  - env.submit(text: str): the final answer, once per episode.
Answer format: the submitted text must contain the final answer as \\boxed{{...}}; the LAST \\boxed{{}}
in the submitted text is graded.{lenient}
Grading: math-verify, gold first (3/4 equals 0.75, \\frac{{1}}{{2}} equals 0.5). When the gold is a
number the boxed answer must be a number too (\\boxed{{37+48}} scores 0, \\boxed{{85}} scores 1).
Reward is 1 or 0.
Data sources: {sources}.
"""


GRADERS = ("default", "math_verify")


def _offline(d) -> bool:
    return d.source == "offline"


def _real(d) -> bool:
    return d.source != "offline"


REAL = "domain.source: gsm8k | dapo | aime"
FIELDS = {"data_path": Setting("real data: a local file/folder or an HF dataset id", REAL, _real)}
OPTIONS = {
    "mix": Setting("source -> share, e.g. {arith_add: 0.5, word: 0.5} (default: mostly arithmetic, 5% gsm8k)",
                   "domain.source: offline", _offline),
    "lenient_last_number": Setting("also accept the last number when no \\boxed{} was given (default false)"),
    "python_timeout_s": Setting("env.python time limit (default 10)"),
    "python_memory_mb": Setting("env.python memory limit (default 512)"),
    "eval_path": Setting("val and test come from this file/folder/HF id (e.g. AIME)", REAL, _real),
    "eval_source": Setting("format of eval_path: gsm8k | dapo | aime (default aime)", "domain.options.eval_path",
                           lambda d: _real(d) and bool(d.options.get("eval_path"))),
    "hf_config": Setting("HF dataset config name (openai/gsm8k needs 'main')", REAL, _real),
    "hf_split": Setting("HF dataset split (default train)", REAL, _real),
}


class MathDomain:
    """The `math` domain. Offline: generated arithmetic + 100 GSM8K originals; real: gsm8k|dapo|aime.

    domain.options: see OPTIONS.
    """

    name = "math"
    answer_format = AnswerFormat("the final answer as \\boxed{...}", pattern=r"\\boxed\{|\\fbox\{")
    hints = HINTS

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.options: dict[str, Any] = dict(cfg.domain.options)
        self.source = cfg.domain.source
        if self.source != "offline" and self.source not in data.REAL_SOURCES:
            raise DataError(f"math: unknown domain.source '{self.source}'; choose offline, "
                            f"{', '.join(data.REAL_SOURCES)}")
        if cfg.domain.grader not in GRADERS:
            raise ConfigError(f"math: domain.grader must be one of {list(GRADERS)} (got {cfg.domain.grader!r})")
        refuse_unread_settings("math", cfg.domain, FIELDS, OPTIONS)
        self.lenient = bool(self.options.get("lenient_last_number", False))
        self.timeout_s = float(self.options.get("python_timeout_s", 10.0))
        self.memory_mb = int(self.options.get("python_memory_mb", 512))
        if self.source == "offline":
            sources = ", ".join(f"{k} ({v:g})" for k, v in data.parse_mix(self.options).items())
        else:
            sources = self.source
        lenient = " With lenient grading on, the last number counts when there is no \\boxed{}." if self.lenient else ""
        self.brief = BRIEF.format(timeout_s=self.timeout_s, lenient=lenient, sources=sources)
        self._splits: dict[str, list[Problem]] | None = None

    def load_splits(self) -> dict[str, list[Problem]]:
        if self._splits is None:
            sizes = split_sizes(self.cfg.domain.splits)
            if self.source == "offline":
                self._splits = data.offline_splits(sizes, self.cfg.seed, self.options)
            else:
                self._splits = data.real_splits(self.source, self.cfg.domain.data_path, sizes,
                                                self.cfg.seed, self.options)
        return self._splits

    def make_env(self, problem: Problem) -> MathEnv:
        return MathEnv(problem, timeout_s=self.timeout_s, memory_mb=self.memory_mb)

    def grade(self, problem: Problem, answer: str | None) -> float:
        return grade_math(problem, answer, lenient_last_number=self.lenient)

    def grader(self) -> Callable[[Problem, str | None], float]:
        """A picklable grader for worker processes."""
        return functools.partial(grade_math, lenient_last_number=self.lenient)

    def base_harness(self) -> str:
        return Path(__file__).with_name("h0.py").read_text(encoding="utf-8")
