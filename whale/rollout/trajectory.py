"""What one episode leaves behind: every model call as sampled, every tool call, the answer.

A `Trajectory` is the unit that flows everywhere: the weight phase turns the calls of accepted
trajectories into training rows, the harness phase writes them into the archive as raw traces,
evaluation averages their rewards. It is recorded by the parent, never reported by the harness,
so a harness cannot forge what it was graded on. Each call says whether it is trained (`used`) and
why (`use_reason`; the rule is in usage.py), so traces show what a weight step learns from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LLMCall:
    messages: list[dict[str, Any]]
    completion: str
    finish_reason: str
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    weights_version: str = "base"
    prefill: str | None = None  # text of a trailing assistant message the model continued
    choices: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    sample_index: int = 0  # which of n samples of the same request
    # Did this completion reach the episode's outcome (and so may be trained)? Decided by
    # whale.rollout.usage at the end of the episode; None in traces written before the rule.
    used: bool | None = None
    use_reason: str = ""
    mark: bool | None = None  # the harness's completion.use() (True) / .discard() (False)


@dataclass
class ToolCall:
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    result: Any
    error: str | None = None
    seconds: float = 0.0
    after_calls: int | None = None  # LLM calls recorded before this tool call (None: unknown)


@dataclass
class Trajectory:
    problem_id: str
    sample: int
    harness_id: str
    source: str = ""
    question: str = ""
    calls: list[LLMCall] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    reward: float = 0.0
    error: str | None = None
    seconds: float = 0.0  # wall time excluding time queued for the engine
    prompt_tokens: int = 0
    completion_tokens: int = 0
    weights_version: str = "base"
    stdout_tail: str = ""

    def to_json(self, gold: Any = None, include_ids: bool = True) -> dict[str, Any]:
        row = asdict(self)
        if not include_ids:
            for call in row["calls"]:
                call.pop("prompt_ids", None)
                call.pop("completion_ids", None)
        if gold is not None:
            row["gold"] = gold
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "Trajectory":
        row = {k: v for k, v in row.items() if k in cls.__dataclass_fields__}
        row["calls"] = [LLMCall(**c) for c in row.get("calls", [])]
        row["tool_calls"] = [ToolCall(**t) for t in row.get("tool_calls", [])]
        return cls(**row)
