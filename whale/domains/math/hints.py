"""Math's hints: what we learned about this task, declared for the harness search.

Used only with `harness.domain_hints: on` (the default, so the published math runs repeat); shown
in the archive and the report as "hint: <name>". Mechanisms splice the blocks of hint_blocks.py.
"""

from __future__ import annotations

from typing import Any

from whale.domains.math import hint_blocks as B
from whale.harness.mechanism import REWRITE_FIXES, Hints, Mutation, append_user_prompt, rewrite_system_prompt, wrap

SYSTEM_PROMPTS = (
    "You are a careful mathematician. Solve the problem step by step, check each computation, and end "
    "with the final answer in \\boxed{}.",
    "You solve math problems. When a computation is tedious, write a short ```python block that "
    "prints the result. Always end with \\boxed{answer}.",
)

TEXT = """\
What helps a small model here: short prompts, asking for Python that prints the result and feeding
the printed number back, then asking for \\boxed{NUMBER} (or prefilling "\\boxed{" as an assistant
message); giving it another turn when no \\boxed{} was produced."""

MECHANISMS = (
    Mutation("system_prompt_rewrite_math", "A system prompt that states the strategy and the answer format "
             "keeps a small model on task.", rewrite_system_prompt(SYSTEM_PROMPTS), prompt_only=True,
             fixes=REWRITE_FIXES, hint=True, replaces=("system_prompt_rewrite",)),
    Mutation("python_first", "Small models make arithmetic slips; a Python program run before solving "
             "gives the model a computed result to rely on.", wrap("python_first", B.PYTHON_FIRST),
             fixes=("unused_tool", "wrong_answer", "tool_error"), hint=True),
    Mutation("boxed_reminder", "Many replies never reach a boxed answer; a firm reminder to end with it "
             "raises the parse rate.", append_user_prompt(B.BOXED_REMINDER), prompt_only=True,
             fixes=("no_boxed_answer", "length_cutoff"), hint=True),
    Mutation("retry_parse_failure", "When the submission has no boxed answer, one short prefilled "
             "follow-up call recovers a gradable answer.", wrap("retry_parse_failure", B.RETRY_PARSE),
             fixes=("no_boxed_answer", "length_cutoff", "no_submission"), keeps_layout=True, hint=True,
             replaces=("format_repair",)),
    Mutation("self_check", "Asking the model to check its solution before submitting catches some "
             "wrong answers.", wrap("self_check", B.SELF_CHECK), fixes=("wrong_answer",), hint=True),
)

MODES = {"no_boxed_answer": "the submission has no \\boxed{...} answer"}


def episode_modes(row: dict[str, Any], tools: list[dict], answer: str | None) -> list[str]:
    return ["no_boxed_answer"] if answer is not None and "\\boxed" not in answer and "\\fbox" not in answer else []


HINTS = Hints(mechanisms=MECHANISMS, modes=MODES, episode_modes=episode_modes, main_tool="python", text=TEXT)
