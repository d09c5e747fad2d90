"""The offline mutation proposer: a fixed library of real code transformations, chosen by diagnosis.

It reads the archive the way a person would start: the parent's raw traces are sorted by why
episodes failed (diagnose.py: a submission the grader cannot read, cut-off calls, tool errors,
and, from the domain's hints, off-topic retrieval, illegal moves, ...), and the mechanisms that
address the dominant failure mode (`Mutation.fixes`) are tried first, untried ones before tried
ones; the diagnosis goes into the candidate's hypothesis (meta.json). It also reads the archive's
scores: a mechanism that was tried in this run and never beat its parent (under any weights) waits
until every relevant mechanism not yet shown to fail has had its try, so a phase does not spend its
candidates on the fixes earlier phases already refuted (measured: a seed-1 search QA run spent 12
of 18 candidates over three phases on three such mechanisms and never tried question-as-query). It
can come back after that: harness and weights are coupled. Under weights trained in this run,
mechanisms that keep the layout of the model's context (vote, parsing, which passage is retrieved)
go before those that change it (prompt text, passage format): trained weights co-adapt with the
harness they were trained under (`Mutation.keeps_layout`). The parent is the best archive member
most of the time, another one sometimes. It is still a library, not a reasoner: it exists so the
whole WHALE loop runs offline, in tests and on a laptop without an agent CLI or an API key; real
searches should use `agent_cli` or `chat` (whose brief carries the same diagnosis).

The library has two parts (harness/mechanism.py):
- domain-general mechanisms (`general_library`), built from what the domain declares (its
  `answer_format`) and the parent's traces (its solved episodes, for few-shot exemplars), so they
  apply to a task nobody wrote them for: an answer prefill, a repair call when the submission does
  not parse, extraction of the answer the grader reads, constrained choice among the grader's
  answers, few-shot exemplars, a vote, longer replies, a system-prompt rewrite;
- the domain's declared hints (`Domain.hints`, whale/domains/<name>/hints.py), only with
  `harness.domain_hints: on`, recorded as "hint: <name>".

Why diagnosis rather than uniform draws: measured on search QA (docs/results/cmp), a uniform
draw of 2-4 mechanisms per phase often missed the one fix that mattered (question-as-query for
h0's off-topic retrieval); the traces name it in the first read.

How edits are made robust to any descendant of the domains' h0 harnesses:
- most mechanisms *wrap* the harness: the current top-level `run` is renamed and a new `run`
  hands it a wrapped `llm` and/or `env` (extra passages in the prompt, a vote over samples,
  constrained choices, a retry on a refused move). This depends only on the harness contract;
- prompt mechanisms rewrite the SYSTEM_PROMPT / USER_PROMPT literals (braces escaped when the
  code calls `.format` on them), so they are also valid in prompt-only mode;
- a few touch named constants or replace the base `run` when the parent has the expected shape,
  and are skipped otherwise.
Every block is marked `# --- mutation: <name> ---`, a mechanism is applied at most once per
lineage, and every result passes the same static checks as any candidate. The general code blocks
live in harness/blocks/, a domain's in its hint_blocks.py; the source edits that splice them in, in
harness/source_edit.py.
"""

from __future__ import annotations

import random
from typing import Any

from whale.config import Config
from whale.domains.base import AnswerFormat
from whale.harness import blocks as B
from whale.harness.archive import code_hash
from whale.harness.diagnose import Diagnosis, diagnose, harness_traces
from whale.harness.mechanism import REWRITE_FIXES, Mutation, fill, hints_in_use, rewrite_system_prompt, wrap
from whale.harness.proposal import Proposal
from whale.harness.source_edit import MARK, has_mutation, stamp_docstring
from whale.harness.validate import static_check

FEW_SHOT_EXAMPLES = 2  # solved episodes shown as exemplars
FEW_SHOT_CHARS = 600  # longest question or answer an exemplar may have

MAJORITY_VOTE = Mutation(
    "majority_vote", "Sampling several completions and keeping the most common answer removes one-off sampling "
    "errors at temperature 1.", wrap("majority_vote", B.MAJORITY_VOTE), fixes=("wrong_answer", "empty_answer"),
    keeps_layout=True)


def solved_examples(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(question, submitted answer) of solved episodes, short ones first, distinct answers first."""
    solved = [(str(r.get("question", "")), str(r.get("answer"))) for r in rows
              if float(r.get("reward") or 0.0) >= 0.5 and r.get("answer") is not None]
    solved = [(q, a) for q, a in dict.fromkeys(solved) if q and a.strip() and len(q) <= FEW_SHOT_CHARS
              and len(a) <= FEW_SHOT_CHARS]
    solved.sort(key=lambda qa: len(qa[0]) + len(qa[1]))
    out: list[tuple[str, str]] = []
    for distinct in (True, False):
        for q, a in solved:
            if len(out) < FEW_SHOT_EXAMPLES and (q, a) not in out and (not distinct or a not in {x for _, x in out}):
                out.append((q, a))
    return out


def general_library(fmt: AnswerFormat | None, cfg: Config, solved: list[tuple[str, str]] = ()) -> list[Mutation]:
    """The domain-general mechanisms for a domain with answer format `fmt` and a parent that solved
    `solved` harness-split episodes (module docstring)."""
    prompts = B.SYSTEM_PROMPTS if fmt is None else tuple(
        f"{p} The answer format: {fmt.description}" for p in B.SYSTEM_PROMPTS)
    lib = [MAJORITY_VOTE,
           Mutation("system_prompt_rewrite", "A system prompt that asks for care and the exact answer format "
                    "keeps a small model on task.", rewrite_system_prompt(prompts), prompt_only=True,
                    fixes=REWRITE_FIXES)]
    s = cfg.sampling
    lib.append(Mutation("more_tokens", "Replies are cut off at max_tokens before the answer; twice the tokens "
                        "let them finish.", wrap("more_tokens", fill(B.MORE_TOKENS, default=s.max_tokens,
                                                                        cap=s.max_tokens_cap)),
                        fixes=("length_cutoff",), keeps_layout=True))
    if fmt is None:
        return lib
    if fmt.open and fmt.close:
        lib.append(Mutation("answer_prefill", f"Replies miss the format the grader reads ({fmt.description}); "
                            f"opening the assistant turn with {fmt.open!r} and stopping at {fmt.close!r} makes every "
                            "reply an answer in it.", wrap("answer_prefill", fill(B.ANSWER_PREFILL, open=fmt.open,
                                                                                   close=fmt.close)),
                            fixes=("format_mismatch", "empty_format", "length_cutoff")))
    if fmt.open:
        lib.append(Mutation("answer_line_stop", "Answers opened in the format run on past their first line "
                            "(explanations, a next question), which the grader reads as the answer; stopping at the "
                            "line's end keeps the answer alone.",
                            wrap("answer_line_stop", fill(B.ANSWER_LINE_STOP, open=fmt.open), needs=fmt.open),
                            fixes=("multiline_answer", "length_cutoff", "empty_format"), keeps_layout=True))
    lib.append(Mutation("answer_trim", "The grader gives only part of the reward to answers near the gold; "
                        "submitting the answer without the punctuation, quotes and spaces around it gets full credit.",
                        wrap("answer_trim", fill(B.ANSWER_TRIM, open=fmt.open, close=fmt.close)),
                        fixes=("partial_credit",), keeps_layout=True))
    if fmt.choices:
        lib.append(Mutation("constrained_answer", f"The grader accepts only {list(fmt.choices)}; choosing among "
                            "them with llm(..., choices=...) makes every answer one of them, drawn from the model's "
                            "own preferences.", wrap("constrained_answer", fill(B.CONSTRAINED_ANSWER,
                                                                                 choices=fmt.choices)),
                            fixes=("format_mismatch", "empty_format", "length_cutoff"), keeps_layout=True))
    if fmt.choices or (fmt.open and fmt.close):
        lib.append(Mutation("answer_extraction", "Replies name the answer but not in the grader's format; "
                            "submitting the choice they name (or their last line in the format) lets the grader "
                            "read it.", wrap("answer_extraction", fill(B.ANSWER_EXTRACTION, choices=fmt.choices,
                                                                      open=fmt.open, close=fmt.close)),
                            fixes=("format_mismatch",), keeps_layout=True))
    if fmt.pattern or fmt.choices:
        lib.append(Mutation("format_repair", "When the submission does not match the grader's format, one short "
                            "follow-up call asking for the answer alone in it recovers a gradable answer.",
                            wrap("format_repair", fill(B.FORMAT_REPAIR, pattern=fmt.pattern, choices=fmt.choices,
                                                       open=fmt.open, close=fmt.close,
                                                       description=fmt.description)),
                            fixes=("format_mismatch", "empty_format", "length_cutoff", "no_submission"),
                            keeps_layout=True))
    if solved:
        lib.append(Mutation("few_shot", f"{len(solved)} solved harness-split episodes, shown as earlier turns, "
                            "teach the answer format and the kind of answer that scores.",
                            wrap("few_shot", fill(B.FEW_SHOT, examples=tuple(solved))),
                            fixes=("format_mismatch", "empty_format", "wrong_answer")))
    return lib


def mutations_for(domain: Any, cfg: Config, prompt_only: bool = False,
                  solved: list[tuple[str, str]] = ()) -> list[Mutation]:
    """The general mechanisms, then the domain's hints when `harness.domain_hints` is on; a hint that
    `replaces` a general mechanism (a domain's own prompts) takes its place."""
    hints = hints_in_use(domain, cfg.harness.domain_hints).mechanisms
    replaced = {r for m in hints for r in m.replaces}
    out = [m for m in general_library(domain.answer_format, cfg, solved) if m.name not in replaced] + list(hints)
    return [m for m in out if m.prompt_only or not prompt_only]


def relevance(mutation: Mutation, diagnosis: Diagnosis) -> float:
    """Share of the failed episodes showing a mode this mechanism addresses (the top mode counts double)."""
    top = diagnosis.dominant
    return sum(diagnosis.share(m) * (2.0 if m == top else 1.0) for m in mutation.fixes)


def mechanism_record(archive) -> dict[str, tuple[int, int]]:
    """{mechanism: (tries, wins)} over the whole run: a try is a candidate scored under weights its
    parent was also scored under; a win, one whose success rate beat the parent's there."""
    record: dict[str, list[int]] = {}
    for meta in archive.all_meta():
        name, parent = meta.get("mechanism"), meta.get("parent")
        if not name or name == "base" or not parent or meta.get("status") != "valid":
            continue
        for version, scores in archive.all_scores(meta["id"]).items():
            parent_scores = archive.scores(parent, version)
            if parent_scores is None or "success_rate" not in scores or "success_rate" not in parent_scores:
                continue
            tally = record.setdefault(name, [0, 0])
            tally[0] += 1
            tally[1] += int(scores["success_rate"] > parent_scores["success_rate"])
    return {name: (tries, wins) for name, (tries, wins) in record.items()}


def apply_mutation(mutation: Mutation, source: str, parent: str, rng: random.Random) -> str | None:
    """The mutated, docstring-stamped source, or None when the mutation does not apply."""
    if has_mutation(source, mutation.name) or any(has_mutation(source, c) for c in mutation.conflicts):
        return None
    try:
        new = mutation.apply(source, rng)
    except (SyntaxError, ValueError):
        return None
    if new is None:
        return None
    new = stamp_docstring(new, mutation.hypothesis, mutation.label, parent)
    if not mutation.prompt_only and MARK.format(mutation.name) not in new:
        new = new.rstrip("\n") + "\n\n" + MARK.format(mutation.name) + " (constants changed above)\n"
    return new


class MutationProposer:
    """Offline, seeded proposer; see the module docstring. `last_error` says why it came back short."""

    name = "mutation"

    def __init__(self, seed: int = 0, cfg: Config | None = None):
        self.seed = seed
        self.cfg = cfg or Config()
        self.last_error: str | None = None
        self.last_usage: dict[str, float] = {}
        self.exhausted = False

    def propose(self, archive, domain, n, workspace, context) -> list[Proposal]:
        """Diagnose the parent's traces, then apply the mechanisms that address its failure modes,
        most relevant first, except that under trained weights one that changes the layout of the
        model's context goes after every layout-preserving one (`Mutation.keeps_layout`), and within
        each group one already shown in this run not to beat its parent goes after those not shown to
        fail; then untried-under-these-weights first, then code before prompt text, seeded ties;
        mechanisms that address no diagnosed mode come last (library coverage). See `Mutation.fixes`.

        Code before prompt text, at equal relevance: a rewrite of the prompts was never accepted in
        our runs (search QA prompt-only, five seeds: no rewrite accepted on any; the general-search
        runs accepted only code mechanisms), while the chess search that ended empty had drawn two
        prompt rewrites and a vote over annotating the moves, which with the constrained choice it
        had already tried scores 0.367 on val (docs/results/cmp_chess/README.md)."""
        self.last_error, self.last_usage, self.exhausted = None, {}, False
        version = context.weights_version
        rng = random.Random(f"{self.seed}/{version}/{context.incoming_id}/{context.iteration}")
        use_hints = self.cfg.harness.domain_hints
        ranked = archive.ranking(version) or [context.incoming_id]
        # Code evaluated only under earlier weights may be proposed again: harness and weights are
        # coupled, so a fix that did not pay under the old weights can pay under the new ones.
        known = {m["code_hash"] for m in archive.all_meta()
                 if m["status"] in ("pending", "invalid") or archive.scores(m["id"], version) is not None}
        tried = {m.get("mechanism") for m in archive.all_meta() if archive.scores(m["id"], version) is not None}
        # Mechanisms that were tried in this run and never beat their parent (under any weights)
        # wait until every relevant mechanism not yet shown to fail has had its try.
        lost = {name for name, (tries, wins) in mechanism_record(archive).items() if tries and not wins}
        # weights trained in this run co-adapted with the harness: layout-preserving fixes first
        trained = version != "base"
        diagnoses: dict[str, tuple[Diagnosis, list[Mutation]]] = {}
        out: list[Proposal] = []
        for _ in range(4 * max(1, n)):
            if len(out) >= n:
                break
            # mostly the best harness (fix what fails there), sometimes another archive member
            parent = ranked[0] if len(ranked) == 1 or rng.random() < 0.75 else \
                rng.choices(ranked[1:], [1.0 / (i + 1) for i in range(len(ranked) - 1)])[0]
            if parent not in diagnoses:
                rows = harness_traces(archive, parent, version)
                diagnoses[parent] = (diagnose(rows, domain.answer_format, hints_in_use(domain, use_hints)),
                                     mutations_for(domain, self.cfg, context.prompt_only, solved_examples(rows)))
            diag, muts = diagnoses[parent]
            order = sorted(muts, key=lambda m: (relevance(m, diag) <= 0, trained and not m.keeps_layout,
                                                m.label in lost, -round(relevance(m, diag), 9),
                                                m.label in tried, m.prompt_only, rng.random()))
            for mutation in order:
                new = apply_mutation(mutation, archive.source(parent), parent, rng)
                if new is None:
                    continue
                reason = static_check(new, self.cfg, base_source=context.base_source or archive.source(parent),
                                      prompt_only=context.prompt_only)
                h = code_hash(new)
                if reason is not None or h in known:
                    continue
                known.add(h)
                tried.add(mutation.label)
                out.append(self._proposal(new, mutation, parent, diag))
                break
        if len(out) < n:
            counts = sorted({len(m) for _, m in diagnoses.values()})
            self.last_error = (f"only {len(out)} of {n} mutations applied (domain {domain.name!r}: "
                               f"{counts} mechanisms, hints {'on' if use_hints else 'off'}, parents {ranked[:5]})")
            self.exhausted = not out  # every edit it can make is in the archive already
        return out

    @staticmethod
    def _proposal(source: str, mutation: Mutation, parent: str, diag: Diagnosis) -> Proposal:
        addressed = [m for m in mutation.fixes if diag.counts.get(m)]
        why = (f"addresses {', '.join(addressed)} ({', '.join(f'{diag.counts[m]}/{diag.failures}' for m in addressed)} "
               "failed episodes)" if addressed else "not aimed at a diagnosed mode (library coverage)")
        hypothesis = f"Diagnosis of {parent}: {diag.text(top=2)} {mutation.label} {why}: {mutation.hypothesis}"
        return Proposal(source=source, hypothesis=hypothesis, mechanism=mutation.label,
                        notes=f"mutation {mutation.label} of {parent}; diagnosis {diag.to_json()}", parent=parent)
