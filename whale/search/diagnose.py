"""Why do a harness's episodes fail? A failure-mode count read off its raw traces.

Meta-Harness's ablation found that reading raw traces is what makes a proposer good, so the
offline proposer should do what a human reading `traces.jsonl` would do first: sort the failed
episodes by *why* they failed and fix the most common reason. This module is that first read.
It is shared: the mutation proposer picks mechanisms that address the dominant mode (and writes
the diagnosis into the candidate's hypothesis), and the LLM proposers' brief gets the same text.

A failed episode (reward < 0.5) can show several modes; each is counted once per episode.
Generic modes look only at the trace contract (errors, finish reasons, tool calls, the answer):

  harness_error     the episode ended with an error (crash, budget, wall time)
  no_submission     the harness never submitted an answer
  length_cutoff     a model call stopped at max_tokens (finish_reason "length")
  tool_error        a tool call was refused or failed
  unused_tool       the domain's main tool was never called

Domain-aware modes use what the trace shows of the domain's tools and answer format:

  searchqa  empty_retrieval     every search returned nothing
            off_topic_query     the queries do not name the question's entity, nor do the passages
            off_topic_retrieval the queries name it, but no retrieved title/text mentions it
            missing_relation    the entity is there, but nothing mentions what is asked
                                (e.g. a Capital passage for a currency question)
            no_answer_tag       no complete <answer>...</answer> in the submission
            empty_answer        an empty <answer></answer>
            long_answer         the answer is a sentence (> 5 words), not an entity
  math      no_boxed_answer     no \\boxed{...} in the submission
  chess     illegal_move        a move was refused as illegal or unparsable

and `wrong_answer` is what is left: the episode ran cleanly and answered wrongly.

Why word overlap for "off-topic": the question's entity (its capitalised words) and its other
content words are what BM25 needs to match; a passage that names neither cannot contain the
answer. Comparing stems (the first max(4, len - 2) letters) tolerates "Kenya"/"Kenyan".
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

MODES: dict[str, str] = {
    "harness_error": "the episode ended with an error (crash, budget or wall time)",
    "no_submission": "the harness never submitted an answer",
    "unused_tool": "the domain's main tool was never called",
    "tool_error": "a tool call was refused or failed",
    "empty_retrieval": "every search returned no passage",
    "off_topic_query": "the search queries do not mention the question's entity (so neither do the passages)",
    "off_topic_retrieval": "no retrieved passage (title or text) mentions the question's entity",
    "missing_relation": "the passages name the entity but not what is asked",
    "length_cutoff": "a model call was cut off at max_tokens",
    "no_answer_tag": "the submission has no complete <answer>...</answer>",
    "empty_answer": "the answer tag is empty (the model opened with a line break or stop string)",
    "long_answer": "the answer is a sentence (more than 5 words), not a short entity",
    "no_boxed_answer": "the submission has no \\boxed{...} answer",
    "illegal_move": "a move was refused as illegal or unparsable",
    "wrong_answer": "the episode ran cleanly and answered wrongly",
}
ORDER = list(MODES)  # ties go to the upstream cause: retrieval before reading before format

MAIN_TOOL = {"searchqa": "search", "math": "python", "chess": "move"}
ANSWER_WORDS = 5
_STOP = set("""a an the of in on at to for from by with and or is are was were be been do does did what which who
whom whose where when why how name named called this that these those it its their there here as into than
then about country""".split())
_ANSWER = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)


@dataclass
class Diagnosis:
    episodes: int = 0
    failures: int = 0
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)  # mode -> a few questions

    def share(self, mode: str) -> float:
        return self.counts.get(mode, 0) / self.failures if self.failures else 0.0

    def ranked(self) -> list[str]:
        return sorted(self.counts, key=lambda m: (-self.counts[m], ORDER.index(m) if m in ORDER else len(ORDER)))

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
            parts.append(f"{mode} in {self.counts[mode]}/{self.failures} ({MODES.get(mode, mode)}{ex})")
        return f"{self.failures} of {self.episodes} episodes failed. Failure modes: " + "; ".join(parts) + "."

    def to_json(self) -> dict[str, Any]:
        return {"episodes": self.episodes, "failures": self.failures, "counts": dict(self.counts),
                "dominant": self.dominant}


def diagnose(traces: Iterable[dict[str, Any]], domain: str) -> Diagnosis:
    """Count failure modes over trace rows (archive `traces.jsonl` rows or `Trajectory.to_json()`)."""
    d = Diagnosis()
    for row in traces:
        d.episodes += 1
        if float(row.get("reward") or 0.0) >= 0.5:
            continue
        d.failures += 1
        for mode in episode_modes(row, domain):
            d.counts[mode] += 1
            examples = d.examples.setdefault(mode, [])
            question = str(row.get("question", ""))
            if len(examples) < 3 and question not in examples:
                examples.append(question)
    return d


def episode_modes(row: dict[str, Any], domain: str) -> list[str]:
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
    main = MAIN_TOOL.get(domain)
    if main is not None and not any(t.get("name") == main for t in tools):
        modes.append("unused_tool")
    if domain == "searchqa":
        modes += _searchqa_modes(row, tools, answer)
    elif domain == "math":
        if answer is not None and "\\boxed" not in answer and "\\fbox" not in answer:
            modes.append("no_boxed_answer")
    elif domain == "chess":
        if any(isinstance(t.get("result"), dict) and "illegal" in str(t["result"].get("error") or "")
               for t in tools if t.get("name") == "move"):
            modes.append("illegal_move")
    return modes or ["wrong_answer"]


def _searchqa_modes(row: dict[str, Any], tools: list[dict], answer: str | None) -> list[str]:
    modes = []
    searches = [t for t in tools if t.get("name") == "search" and not t.get("error")]
    if searches:
        passages = [_passage_text(t.get("result")) for t in searches]
        found = " ".join(p for p in passages if p)
        if not found.strip():
            modes.append("empty_retrieval")
        else:
            entity, topic = key_terms(str(row.get("question", "")))
            seen = _stems_in(found)
            if entity and not any(_mentioned(t, seen) for t in entity):
                queried = _stems_in(" ".join(str(t.get("args", [""])[0] if t.get("args") else
                                                 (t.get("kwargs") or {}).get("query", "")) for t in searches))
                good_query = any(_mentioned(t, queried) for t in entity)
                modes.append("off_topic_retrieval" if good_query else "off_topic_query")
            elif topic and not any(_mentioned(t, seen) for t in topic):
                modes.append("missing_relation")
    if answer is not None:
        tagged = _ANSWER.findall(answer)
        if not tagged:
            modes.append("no_answer_tag")
        elif not tagged[-1].strip():
            modes.append("empty_answer")
        elif len(tagged[-1].split()) > ANSWER_WORDS:
            modes.append("long_answer")
    return modes


def _passage_text(result: Any) -> str:
    """Titles and texts of a search result (a list of dicts, or the trace's clipped JSON string)."""
    if isinstance(result, str):
        return result
    if isinstance(result, list):
        return " ".join(f"{r.get('title', '')} {r.get('text', '')}" if isinstance(r, dict) else str(r) for r in result)
    return ""


def _fold(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


def key_terms(question: str) -> tuple[list[str], list[str]]:
    """(entity words, other content words) of a question, lower-cased and accent-folded.

    Entity words are the capitalised words after the first; content words are the remaining
    non-stopwords of three letters or more."""
    words = re.findall(r"[A-Za-z0-9][\w'-]*", _fold(question))
    entity, topic = [], []
    for i, w in enumerate(words):
        low = w.lower()
        if low in _STOP:
            continue
        if i > 0 and w[0].isupper():
            entity.append(low)
        elif len(low) >= 3:
            topic.append(low)
    return entity, topic


def _stem(word: str) -> str:
    return word[: max(4, len(word) - 2)]


def _stems_in(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z0-9][\w'-]*", _fold(text))}


def _mentioned(term: str, words: set[str]) -> bool:
    stem = _stem(term)
    return any(w.startswith(stem) or (len(w) >= 4 and term.startswith(_stem(w))) for w in words)


def diagnose_harness(archive, cid: str, weights_version: str, domain: str) -> Diagnosis:
    """The diagnosis of one archive member's traces under `weights_version` (else its latest)."""
    rows = archive.traces(cid, weights_version)
    if not rows:
        all_rows = archive.traces(cid)
        latest = all_rows[-1].get("scored_under") if all_rows else None
        rows = [r for r in all_rows if r.get("scored_under") == latest]
    return diagnose(rows, domain)
