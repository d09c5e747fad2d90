"""The `Domain` protocol: data splits, the episode environment, the verifier and the base harness.

A domain keeps three things apart (research/domains.md §5): serialisable `Problem`s with their
gold answers, the episode environment whose tools the harness may call, and a pure `grade`
function that the parent runs after the episode. The harness never sees `Problem.answer`.

Tools are proxied automatically: every name in `EpisodeEnv.tools` becomes a method on the `env`
proxy inside the sandbox; attributes in `public_state()` become read-only attributes there and are
refreshed after every tool call (chess's `env.fen` changes as moves are played).

Your own task: write a class with these members in your own module and name it in the config as
`domain.module: "my_module:MyDomain"` (see examples/custom_domain.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

SPLITS = ("weight", "harness", "val", "test")


def split_sizes(sizes: Any) -> dict[str, int]:
    """`domain.splits` as a dict, refusing negative sizes."""
    out = {name: int(getattr(sizes, name)) for name in SPLITS}
    bad = [f"{k}={v}" for k, v in out.items() if v < 0]
    if bad:
        raise ValueError(f"domain.splits sizes must be >= 0 (got {', '.join(bad)})")
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a bad line is an error naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not valid JSON: {e}") from None
    return rows


@dataclass
class Problem:
    id: str
    question: str
    answer: Any  # gold: str, list of aliases, or a domain-specific JSON value
    source: str = ""  # data source, for per-source breakdowns
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class EpisodeError(Exception):
    """Raised by a tool for a refused request; the message goes back to the harness."""


class EpisodeEnv:
    """Parent-side state of one episode. Subclasses add tool methods named in `tools`."""

    tools: tuple[str, ...] = ()

    def __init__(self, problem: Problem):
        self.problem = problem
        self.submitted: str | None = None

    def public_state(self) -> dict[str, Any]:
        """Attributes the harness can read as `env.<name>`. Never include the gold answer."""
        return {"question": self.problem.question}

    def submit(self, answer: str) -> dict[str, Any]:
        if self.submitted is not None:
            raise EpisodeError("env.submit was already called for this episode")
        self.submitted = str(answer)
        return {"ok": True}

    @property
    def done(self) -> bool:
        return self.submitted is not None

    def final_answer(self) -> str | None:
        """What gets graded (chess overrides: the moves played)."""
        return self.submitted

    def close(self) -> None:
        """Release per-episode resources (e.g. a sandboxed Python tool)."""


@runtime_checkable
class Domain(Protocol):
    name: str
    brief: str  # for proposers: what env offers, answer format, what good harnesses do

    def load_splits(self) -> dict[str, list[Problem]]:
        """All four splits (SPLITS), disjoint by content, deterministic from the config seed."""
        ...

    def make_env(self, problem: Problem) -> EpisodeEnv: ...

    def grade(self, problem: Problem, answer: str | None) -> float:
        """Binary reward from what was submitted. Must be picklable/pure: runs in a process."""
        ...

    def base_harness(self) -> str:
        """Source code of h0, the deliberately weak base harness."""
        ...
