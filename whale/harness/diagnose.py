"""Why do a harness's episodes fail? A failure-mode count read off its raw traces.

Meta-Harness's ablation found that reading raw traces is what makes a proposer good, so the
offline proposer should do what a human reading `traces.jsonl` would do first: sort the failed
episodes by *why* they failed and fix the most common reason. This module is that first read.
It is shared: the mutation proposer picks mechanisms that address the dominant mode (and writes
the diagnosis into the candidate's hypothesis), and the LLM proposers' brief gets the same text.

A failed episode (reward below full credit, 1) can show several modes; each is counted once per
episode. Full credit, not 0.5, because some graders give partial credit (reasoning-gym's default
scorer gives 2/3 to "No." for the gold "No"), and an answer that lost a third is worth fixing.
General modes look only at the trace contract (errors, finish reasons, tool calls, the answer)
and at what the domain declares (`Domain.answer_format`):

  harness_error     the episode ended with an error (crash, budget, wall time)
  no_submission     the harness never submitted an answer
  length_cutoff     a model call stopped at max_tokens (finish_reason "length")
  tool_error        a tool call was refused or failed
  format_mismatch   the submission does not match the grader's declared answer format
  empty_format      it matches, but the answer inside is empty
  multiline_answer  the answer inside runs over several lines (an answer and what followed it)
  partial_credit    the grader gave part of the reward: the answer is near the gold, not it

Domain-aware modes come from the domain's hints (`Hints.episode_modes`, `Hints.main_tool`: e.g.
search QA's off-topic retrieval, math's missing \\boxed{}, chess's illegal moves, a never-called
main tool as `unused_tool`), only with `harness.domain_hints: on`; and `wrong_answer` is what is
left: the episode ran cleanly and answered wrongly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from whale.domains.base import AnswerFormat
from whale.harness.mechanism import NO_HINTS, Hints, hints_in_use

MODES: dict[str, str] = {
    "harness_error": "the episode ended with an error (crash, budget or wall time)",
    "no_submission": "the harness never submitted an answer",
    "unused_tool": "the domain's main tool was never called",
    "tool_error": "a tool call was refused or failed",
    "format_mismatch": "the submission does not match the answer format the grader reads",
    "empty_format": "the submission matches the answer format, but the answer in it is empty",
    "multiline_answer": "the answer in the format runs over several lines (the answer and what followed it)",
    "partial_credit": "the grader gave part of the reward: the answer is near the gold but not it (extra characters?)",
    "length_cutoff": "a model call was cut off at max_tokens",
    "wrong_answer": "the episode ran cleanly and answered wrongly",
}
# ties go to the upstream cause: retrieval before reading before format (a domain's modes sit
# before the general format and answer modes, in the order its hints list them)
_GENERAL_FIRST = ["harness_error", "no_submission", "unused_tool", "tool_error"]
_GENERAL_LAST = ["length_cutoff", "format_mismatch", "empty_format", "multiline_answer", "partial_credit",
                 "wrong_answer"]


def mode_order(hints: Hints = NO_HINTS) -> list[str]:
    return _GENERAL_FIRST + [m for m in hints.modes if m not in MODES] + _GENERAL_LAST


@dataclass
class Diagnosis:
    episodes: int = 0
    failures: int = 0
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)  # mode -> a few questions
    order: list[str] = field(default_factory=mode_order)
    descriptions: dict[str, str] = field(default_factory=lambda: dict(MODES))

    def share(self, mode: str) -> float:
        return self.counts.get(mode, 0) / self.failures if self.failures else 0.0

    def ranked(self) -> list[str]:
        order = self.order
        return sorted(self.counts, key=lambda m: (-self.counts[m], order.index(m) if m in order else len(order)))

    @property
    def dominant(self) -> str | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def text(self, top: int = 3) -> str:
        """One paragraph: what fails and why, most common mode first."""
        if not self.episodes:
            return "No traces to diagnose yet."
        if not self.failures:
            return f"All {self.episodes} episodes succeeded."
        parts = []
        for mode in self.ranked()[:top]:
            ex = "; e.g. " + " | ".join(f"'{q[:70]}'" for q in self.examples.get(mode, [])[:2]) if self.examples.get(mode) else ""
            parts.append(f"{mode} in {self.counts[mode]}/{self.failures} ({self.descriptions.get(mode, mode)}{ex})")
        return f"{self.failures} of {self.episodes} episodes failed. Failure modes: " + "; ".join(parts) + "."

    def to_json(self) -> dict[str, Any]:
        return {"episodes": self.episodes, "failures": self.failures, "counts": dict(self.counts),
                "dominant": self.dominant}


def diagnose(traces: Iterable[dict[str, Any]], answer_format: AnswerFormat | None = None,
             hints: Hints = NO_HINTS) -> Diagnosis:
    """Count failure modes over trace rows (archive `traces.jsonl` rows or `Trajectory.to_json()`)."""
    d = Diagnosis(order=mode_order(hints), descriptions={**hints.modes, **MODES})
    for row in traces:
        d.episodes += 1
        if float(row.get("reward") or 0.0) >= 1.0:
            continue
        d.failures += 1
        for mode in episode_modes(row, answer_format, hints):
            d.counts[mode] += 1
            examples = d.examples.setdefault(mode, [])
            question = str(row.get("question", ""))
            if len(examples) < 3 and question not in examples:
                examples.append(question)
    return d


def episode_modes(row: dict[str, Any], answer_format: AnswerFormat | None = None,
                  hints: Hints = NO_HINTS) -> list[str]:
    """Failure modes of one failed episode; ["wrong_answer"] when nothing else explains it."""
    modes: list[str] = []
    tools = [t for t in row.get("tool_calls") or [] if t.get("name") != "submit"]
    answer = row.get("answer")
    error = str(row.get("error") or "")
    if answer is None:
        modes.append("no_submission")
    if error and "never submitted" not in error:
        modes.append("harness_error")
    if any(c.get("finish_reason") == "length" for c in row.get("calls") or []):
        modes.append("length_cutoff")
    if any(t.get("error") for t in tools):
        modes.append("tool_error")
    if hints.main_tool is not None and not any(t.get("name") == hints.main_tool for t in tools):
        modes.append("unused_tool")
    if hints.episode_modes is not None:
        modes += hints.episode_modes(row, tools, answer)
    if answer is not None and answer_format is not None:
        extracted = answer_format.extract(answer)
        if extracted is None:
            modes.append("format_mismatch")
        elif not extracted:
            modes.append("empty_format")
        elif "\n" in extracted:
            modes.append("multiline_answer")
    if 0.0 < float(row.get("reward") or 0.0) < 1.0:
        modes.append("partial_credit")
    return list(dict.fromkeys(modes)) or ["wrong_answer"]


def harness_traces(archive, cid: str, weights_version: str) -> list[dict[str, Any]]:
    """One archive member's trace rows (harness split) under `weights_version`, else its latest."""
    rows = archive.traces(cid, weights_version)
    if not rows:
        all_rows = archive.traces(cid)
        latest = all_rows[-1].get("scored_under") if all_rows else None
        rows = [r for r in all_rows if r.get("scored_under") == latest]
    return rows


def diagnose_harness(archive, cid: str, weights_version: str, domain: Any, use_hints: bool) -> Diagnosis:
    """The diagnosis of one archive member's traces under `weights_version` (else its latest), with
    the domain's declared answer format and, when `use_hints`, its hints' failure modes."""
    return diagnose(harness_traces(archive, cid, weights_version), domain.answer_format,
                    hints_in_use(domain, use_hints))
