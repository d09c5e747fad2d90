"""What a mechanism of the offline proposer is, and what a domain declares as hints.

A `Mutation` is one real code transformation of a harness: a source edit (harness/source_edit.py)
that splices a marked block of plain harness code into a candidate. Two kinds exist:

- domain-general mechanisms (harness/mutation.py, blocks in harness/blocks/): they rely only on the
  harness contract and what a domain declares (its `answer_format`, the parent's traces), so they
  apply to a task nobody wrote them for;
- hints (`hint=True`): a domain's own knowledge, declared as `Domain.hints` in the domain's
  `hints.py` (whale/domains/<name>/hints.py; a user's domain ships its own). They are used only with
  `harness.domain_hints: on` and show in the archive and the report as "hint: <name>", so a reader
  sees how much of a result is the general search and how much hand-written knowledge.

`Hints` also carries the domain's failure modes (read by harness/diagnose.py) and the text the LLM
proposers' brief gets (harness/brief.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from whale.harness.source_edit import edit_prompt, escape_braces, wrap_run

HINT_PREFIX = "hint: "
# what a system-prompt rewrite addresses, the general one and a domain's alike
REWRITE_FIXES = ("wrong_answer", "long_answer", "no_answer_tag", "no_boxed_answer", "format_mismatch")


@dataclass(frozen=True)
class Mutation:
    name: str
    hypothesis: str
    apply: Callable[[str, random.Random], str | None]
    fixes: tuple[str, ...] = ()  # failure modes (harness/diagnose.py) it addresses; tried first for them
    prompt_only: bool = False  # changes only SYSTEM_PROMPT / USER_PROMPT
    conflicts: tuple[str, ...] = ()  # mechanisms (names) a lineage may not also have
    # Keeps the layout of what the model reads as it was: it changes which passage it gets, how many
    # samples are drawn or how a reply is parsed, not the prompt text or the format of the context.
    # Under weights trained in this run these go first (relevance ties within each group), because
    # RSFT weights co-adapt with the harness they were trained under: measured on search QA
    # (docs/results/headroom_after_weights), on weight-only's trained weights three passages
    # instead of one cost -0.52 [-0.60, -0.44] test mean@2, while majority vote gained +0.023
    # [+0.008, +0.043] and question-as-query was neutral; under the base weights the same three
    # passages are a fix. A layout change can still come, after the layout-preserving fixes: in
    # the seed-0 `gain_v2` run's second harness phase (weights w11, h4 at ~0.88) the layout changes
    # scored 0.06 (more search turns), 0.22 (three passages) and 0.50 (retrieved titles) on 32
    # problems, while the layout-preserving ones held 0.875.
    keeps_layout: bool = False
    hint: bool = False  # a domain's declared knowledge, not a general mechanism
    replaces: tuple[str, ...] = ()  # general mechanisms this one stands in for when offered (a domain's prompts)

    @property
    def label(self) -> str:
        """The mechanism name the archive records: "hint: <name>" for a domain's hints."""
        return HINT_PREFIX + self.name if self.hint else self.name


EpisodeModes = Callable[[dict[str, Any], list[dict[str, Any]], "str | None"], list[str]]


@dataclass(frozen=True)
class Hints:
    """A domain's knowledge for proposers (see the module docstring). `Hints()` means none."""

    mechanisms: tuple[Mutation, ...] = ()
    modes: dict[str, str] = field(default_factory=dict)  # failure mode -> what it means
    # (trace row, its non-submit tool calls, the submission) -> this domain's failure modes
    episode_modes: EpisodeModes | None = None
    main_tool: str | None = None  # the tool a good harness calls (diagnosis: unused_tool)
    text: str = ""  # for the LLM proposers' brief


NO_HINTS = Hints()


def hints_in_use(domain: Any, on: bool) -> Hints:
    """The domain's declared hints when `harness.domain_hints` is on, else none."""
    return domain.hints if on else NO_HINTS


# ----- constructors shared by the general library and the domains' hints --------------------------
def append_user_prompt(text: str) -> Callable[[str, random.Random], str | None]:
    def apply(source, rng):
        return edit_prompt(source, "USER_PROMPT",
                           lambda old, fmt: None if escape_braces(text, fmt).strip() in old
                           else old.rstrip() + "\n" + escape_braces(text, fmt))
    return apply


def rewrite_system_prompt(options: list[str] | tuple[str, ...]) -> Callable[[str, random.Random], str | None]:
    def apply(source, rng):
        choice = rng.choice(list(options))
        return edit_prompt(source, "SYSTEM_PROMPT", lambda old, fmt: escape_braces(choice, fmt))
    return apply


def fill(block: str, **constants: Any) -> str:
    """`block` with each `__NAME__` placeholder replaced by the Python literal of constants["name"]."""
    for name, value in constants.items():
        block = block.replace(f"__{name.upper()}__", repr(value))
    return block


def wrap(name: str, block: str, *, needs: str = "", imports: tuple[str, ...] = ()):
    def apply(source, rng):
        if needs and needs not in source:
            return None
        return wrap_run(source, name, block, imports)
    return apply
