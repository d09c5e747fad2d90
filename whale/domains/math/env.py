"""The math episode: the question, a sandboxed Python tool, and one final submission."""

from __future__ import annotations

from whale.domains.base import EpisodeEnv, EpisodeError, Problem
from whale.rollout.sandbox import run_python


class MathEnv(EpisodeEnv):
    """`env.python(code)` runs code in a fresh sandboxed process; `env.submit(text)` ends the episode.

    The graded answer is the last `\\boxed{...}` of the submitted text (see grading.py).
    """

    tools = ("python", "submit")

    def __init__(self, problem: Problem, timeout_s: float = 10.0, memory_mb: int = 512):
        super().__init__(problem)
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb

    def python(self, code: str) -> str:
        if not isinstance(code, str):
            raise EpisodeError(f"env.python expects the code as a string, got {type(code).__name__}")
        return run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
