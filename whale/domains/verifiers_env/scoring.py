"""The verifier: the environment's own Rubric, on a completion the parent recorded itself.

What is graded is never the harness's account of the episode. The parent builds the completion
from what went through it: every tool call it executed (name, arguments, the tool message it
returned), grouped into assistant turns, then the submitted text as the final assistant message.
That completion and the dataset row go through the environment's own `init_state` and
`rubric.score_group`, exactly the calls its rollouts make, in the runner's grading processes
(never in the sandbox). The reward is the rubric's weighted sum, unclipped, as the environment
would report it; `weight.accept_threshold` decides which rewards a weight phase trains on.

Differences from the environment's own transcript, on purpose: intermediate assistant messages
carry only their tool calls (their text came from the harness, so it is not trusted), and tool
calls of a last turn that were never executed are absent. Rubrics that read the final answer,
`info`, the tool messages or the number of executed calls score the same.
"""

from __future__ import annotations

import asyncio
import json
from itertools import groupby
from typing import Any

from whale.domains.base import Problem
from whale.domains.verifiers_env.loader import load_environment


def completion_messages(calls: list[dict[str, Any]], final: str) -> list[dict[str, Any]]:
    """OpenAI-style messages: one assistant message per turn of executed tool calls, each followed
    by its tool messages, then the final answer."""
    messages: list[dict[str, Any]] = []
    for _, turn in groupby(calls, key=lambda c: c["turn"]):
        turn = list(turn)
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in turn]})
        messages += [{"role": "tool", "content": c["content"], "tool_call_id": c["id"]} for c in turn]
    messages.append({"role": "assistant", "content": final})
    return messages


async def score_completion(env, row: dict[str, Any], completion: list[dict[str, Any]]) -> float:
    """The environment's reward for `completion` of dataset `row`, through its own scoring calls."""
    from verifiers.types import ClientConfig  # optional extra (see loader.verifiers_module)
    from verifiers.utils.message_utils import normalize_messages  # optional extra: verifiers

    state = await env.init_state(dict(row), ClientConfig(), "whale")
    state["completion"] = normalize_messages(completion, field_name="completion")
    await env.rubric.score_group([state])
    return float(state["reward"] or 0.0)


def grade_verifiers(problem: Problem, answer: str | None, *, spec: str, args: dict[str, Any]) -> float:
    """Picklable grader: `answer` is the episode's recorded transcript (VerifiersEnv.final_answer)."""
    if answer is None:
        return 0.0
    env = load_environment(spec, args)
    return asyncio.run(score_completion(env, problem.meta["row"], json.loads(answer)["completion"]))
