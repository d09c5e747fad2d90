"""What every proposer takes and returns: the Proposer protocol, Proposal, ProposalContext.

Its own module so that the implementations (mutation.py, agent.py, chat.py) and the factory
(proposers.py) all import it and none of them import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from whale.errors import WhaleError
from whale.harness.archive import Archive
from whale.harness.validate import parse_docstring_fields


@dataclass
class Proposal:
    source: str
    hypothesis: str = ""
    mechanism: str = ""
    notes: str = ""
    parent: str | None = None


@dataclass
class ProposalContext:
    """What a proposer needs to know about the phase it proposes for."""

    iteration: int
    weights_version: str
    incoming_id: str
    brief: str = ""  # BRIEF.md text (brief.make_brief)
    prompt_only: bool = False
    base_source: str | None = None  # prompt-only: the harness whose prompts may change
    tag: str = ""  # folder name for this proposal round under harnesses/_proposals/
    seed: int = 0


class ProposerStopped(WhaleError, RuntimeError):
    """The proposer failed the same way round after round (harness/loop.py): the search stops.
    Its line already says how to continue (`whale run --resume`), so the CLI adds no second hint."""

    resumable = False


class Proposer(Protocol):
    """Writes up to `n` candidates. A failure (crash, timeout, nothing written, endpoint down)
    never raises: `propose` returns what it has (maybe []) and says why in `last_error`.
    `last_usage` is what the last round spent: seconds, and tokens / cost_usd where known; both
    are reset by every `propose`. `name` is what the archive records as each candidate's proposer.
    `exhausted` is True when the last round came back empty because the proposer has nothing left
    to write under these weights (every edit of an offline library is in the archive): not a
    failure to fix, so the phase ends keeping what it has (whale/harness/loop.py) and the run
    goes on, where a failure repeated would stop it."""

    name: str  # "mutation", "chat", "agent_cli"
    last_error: str | None
    last_usage: dict[str, float]
    exhausted: bool

    def propose(self, archive: Archive, domain: Any, n: int, workspace: Path,
                context: ProposalContext) -> list[Proposal]: ...


def proposal_from_source(source: str, notes: str = "", default_parent: str | None = None) -> Proposal:
    """A Proposal whose hypothesis, mechanism and parent come from the file's docstring fields."""
    fields = parse_docstring_fields(source)
    parent = fields.get("parent", default_parent)
    parent = parent.split()[0].strip("`'\".,") if parent else default_parent
    return Proposal(source=source, hypothesis=fields.get("hypothesis", ""),
                    mechanism=fields.get("mechanism", "unspecified"), notes=notes, parent=parent)
