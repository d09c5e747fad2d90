"""The offline mutation proposer: a fixed library of real code transformations, chosen by diagnosis.

It reads the archive the way a person would start: the parent's raw traces are sorted by why
episodes failed (diagnose.py: off-topic retrieval, sentence answers, cut-off calls, illegal moves,
...), and the mechanisms that address the dominant failure mode (FIXES) are tried first, untried
ones before tried ones; the diagnosis goes into the candidate's hypothesis (meta.json). It also
reads the archive's scores: a mechanism that was tried in this run and never beat its parent
(under any weights) waits until every relevant mechanism not yet shown to fail has had its try,
so a phase does not spend its candidates on the fixes earlier phases already refuted (measured:
a seed-1 search QA run spent 12 of 18 candidates over three phases on three such mechanisms and
never tried question-as-query). It can come back after that: harness and weights are coupled.
Under weights trained in this run, mechanisms that keep the layout of the model's context (vote,
parsing, which passage is retrieved) go before those that change it (prompt text, passage
format): trained weights co-adapt with the harness they were trained under (KEEPS_LAYOUT). The
parent is the best archive member most of the time, another one sometimes. It is still a library,
not a reasoner: it exists so the whole WHALE loop runs offline, in tests and on a laptop without
an agent CLI or an API key; real searches should use `agent_cli` or `chat` (whose brief carries
the same diagnosis).

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
lineage, and every result passes the same static checks as any candidate. The code blocks live in
search/blocks/, one module per domain; the source edits that splice them in, in
search/source_edit.py.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from typing import Callable

from whale.config import Config
from whale.search import blocks as B
from whale.search.archive import code_hash
from whale.search.diagnose import Diagnosis, diagnose_harness
from whale.search.proposal import Proposal
from whale.search.source_edit import (MARK, bump_constants, edit_prompt, escape_braces, has_mutation, module_assign,
                                      prompt_fields, replace_base_run, stamp_docstring, wrap_run)
from whale.search.validate import static_check

# ----- the library -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    name: str
    domains: tuple[str, ...]  # domain names, or ("*",) for every domain
    hypothesis: str
    apply: Callable[[str, random.Random], str | None]
    prompt_only: bool = False  # changes only SYSTEM_PROMPT / USER_PROMPT
    conflicts: tuple[str, ...] = ()

    def applies_to(self, domain: str) -> bool:
        return "*" in self.domains or domain in self.domains


def _append_user_prompt(text: str) -> Callable[[str, random.Random], str | None]:
    def apply(source, rng):
        return edit_prompt(source, "USER_PROMPT",
                           lambda old, fmt: None if escape_braces(text, fmt).strip() in old
                           else old.rstrip() + "\n" + escape_braces(text, fmt))
    return apply


def _rewrite_system_prompt(domain: str) -> Callable[[str, random.Random], str | None]:
    def apply(source, rng):
        options = B.SYSTEM_PROMPTS.get(domain, B.SYSTEM_PROMPTS["*"])
        choice = rng.choice(options)
        return edit_prompt(source, "SYSTEM_PROMPT", lambda old, fmt: escape_braces(choice, fmt))
    return apply


def _wrap(name: str, block: str, *, needs: str = "", imports: tuple[str, ...] = ()):
    def apply(source, rng):
        if needs and needs not in source:
            return None
        return wrap_run(source, name, block, imports)
    return apply


def _more_search_turns(source, rng):
    tree = ast.parse(source)
    node = module_assign(tree, "USER_PROMPT")
    if node is None or "env.search(" not in source or not isinstance(node.value, ast.Constant) \
            or prompt_fields(node.value.value) != {"question"}:
        return None
    return replace_base_run(source, "more_search_turns", B.SEARCH_TURNS_RUN)


def _longer_passages(source, rng):
    return bump_constants(source, r"^(MAX_)?PASSAGE_(WORDS|CHARS|TOKENS)$", lambda v: v * 2)


LIBRARY: list[Mutation] = [
    # generic
    Mutation("majority_vote", ("*",), "Sampling several completions and keeping the most common answer removes "
             "one-off sampling errors at temperature 1.", _wrap("majority_vote", B.MAJORITY_VOTE)),
    *[Mutation(f"system_prompt_rewrite_{d}", (d,), "A system prompt that states the strategy and the answer format "
               "keeps a small model on task.", _rewrite_system_prompt(d), prompt_only=True)
      for d in ("searchqa", "math", "chess")],
    Mutation("system_prompt_rewrite", ("*",), "A system prompt that asks for care and the exact answer format "
             "keeps a small model on task.", _rewrite_system_prompt("*"), prompt_only=True),
    # search QA
    Mutation("more_passages", ("searchqa",), "The top-1 passage often misses the answer; the top 3 passages, "
             "shortened, contain it more often.", _wrap("more_passages", B.MORE_PASSAGES, needs="env.search(")),
    Mutation("longer_passages", ("searchqa",), "Passages are cut before the sentence with the answer; twice the "
             "length keeps it.", _longer_passages),
    Mutation("query_rewrite", ("searchqa",), "BM25 matches content words; dropping question words and punctuation "
             "from queries retrieves the right passage more often.",
             _wrap("query_rewrite", B.QUERY_REWRITE, needs="env.search(")),
    Mutation("force_retrieval", ("searchqa",), "The model often answers without searching; retrieving for the "
             "question up front puts evidence in every prompt.", _wrap("force_retrieval", B.FORCE_RETRIEVAL)),
    Mutation("retrieved_titles", ("searchqa",), "A line listing the titles retrieved so far tells the model which "
             "entities it already has evidence for.", _wrap("retrieved_titles", B.RETRIEVED_TITLES)),
    Mutation("final_format_reminder", ("searchqa",), "Answers fail exact match when they are sentences; asking for "
             "only the short entity fixes the format.", _append_user_prompt(B.SEARCHQA_REMINDER), prompt_only=True),
    Mutation("question_as_query", ("searchqa",), "The model writes poor queries (often an unrelated name); the "
             "question itself retrieves the right passage ~95% of the time with BM25.",
             _wrap("question_as_query", B.QUESTION_AS_QUERY, needs="env.search("), conflicts=("query_rewrite",)),
    Mutation("rerank_passages", ("searchqa",), "BM25's top passage is often another field of the right entity "
             "(a short one that repeats its name); drawing ten and putting first those whose titles name what "
             "the question asks keeps one passage, now the one with the answer.",
             _wrap("rerank_passages", B.RERANK_PASSAGES, needs="env.search(", imports=("unicodedata",))),
    Mutation("answer_first_line", ("searchqa",), "After the right entity the model keeps writing (explanations, "
             "new lines), which fails exact match; ending the answer at the first line keeps just the entity.",
             _wrap("answer_first_line", B.ANSWER_FIRST_LINE, needs="<answer>")),
    Mutation("more_search_turns", ("searchqa",), "Two-hop questions need a second search; up to three search turns "
             "let the model find the bridge entity first.", _more_search_turns),
    # math
    Mutation("python_first", ("math",), "Small models make arithmetic slips; a Python program run before solving "
             "gives the model a computed result to rely on.", _wrap("python_first", B.PYTHON_FIRST)),
    Mutation("boxed_reminder", ("math",), "Many replies never reach a boxed answer; a firm reminder to end with it "
             "raises the parse rate.", _append_user_prompt(B.BOXED_REMINDER), prompt_only=True),
    Mutation("retry_parse_failure", ("math",), "When the submission has no boxed answer, one short prefilled "
             "follow-up call recovers a gradable answer.", _wrap("retry_parse_failure", B.RETRY_PARSE)),
    Mutation("self_check", ("math",), "Asking the model to check its solution before submitting catches some "
             "wrong answers.", _wrap("self_check", B.SELF_CHECK)),
    # chess
    Mutation("legal_move_list", ("chess",), "Free-text moves are often illegal; listing the legal moves lets the "
             "model copy one.", _wrap("legal_move_list", B.LEGAL_MOVE_LIST), conflicts=("annotate_moves",)),
    Mutation("annotate_moves", ("chess",), "Tactics start with checks, captures and mates; annotating each legal "
             "move with them (computed from the FEN) points the model at the forcing moves.",
             _wrap("annotate_moves", B.ANNOTATE_MOVES), conflicts=("legal_move_list",)),
    Mutation("constrained_choice", ("chess",), "Choosing among env.legal_moves with llm(..., choices=...) makes "
             "every move legal and draws it from the model's own preferences.",
             _wrap("constrained_choice", B.CONSTRAINED_CHOICE)),
    Mutation("illegal_retry", ("chess",), "A refused move wastes a turn; re-choosing among the legal moves right "
             "away keeps the line going.", _wrap("illegal_retry", B.ILLEGAL_RETRY)),
    Mutation("chess_hint", ("chess",), "Reminding the model to look for checks and captures first focuses it on "
             "forcing moves.", _append_user_prompt(B.CHESS_HINT), prompt_only=True),
]


# Which failure modes (diagnose.py) each mechanism addresses: the proposer tries mechanisms for
# the dominant mode of the parent's traces first. A mechanism with no listed mode is still tried,
# after the relevant ones, so a small library is covered in the end.
FIXES: dict[str, tuple[str, ...]] = {
    "majority_vote": ("wrong_answer", "empty_answer"),
    "system_prompt_rewrite": ("wrong_answer", "long_answer", "no_answer_tag", "no_boxed_answer"),
    "more_passages": ("missing_relation", "off_topic_retrieval"),
    "longer_passages": ("missing_relation",),
    "query_rewrite": ("off_topic_retrieval", "empty_retrieval", "missing_relation"),
    "force_retrieval": ("unused_tool", "off_topic_query", "empty_retrieval"),
    "retrieved_titles": ("wrong_answer",),
    "final_format_reminder": ("long_answer", "no_answer_tag", "length_cutoff"),
    # the question always names what is asked, so it also fixes a query that drops the relation
    "question_as_query": ("off_topic_query", "empty_retrieval", "unused_tool", "tool_error", "missing_relation"),
    "answer_first_line": ("long_answer", "length_cutoff", "empty_answer"),
    "more_search_turns": ("missing_relation",),
    "rerank_passages": ("missing_relation", "off_topic_retrieval"),
    "python_first": ("unused_tool", "wrong_answer", "tool_error"),
    "boxed_reminder": ("no_boxed_answer", "length_cutoff"),
    "retry_parse_failure": ("no_boxed_answer", "length_cutoff", "no_submission"),
    "self_check": ("wrong_answer",),
    "legal_move_list": ("illegal_move", "unused_tool", "no_submission"),
    "annotate_moves": ("wrong_answer", "illegal_move"),
    "constrained_choice": ("illegal_move", "unused_tool", "no_submission", "length_cutoff"),
    "illegal_retry": ("illegal_move", "tool_error"),
    "chess_hint": ("wrong_answer",),
}


# Mechanisms that leave the layout of what the model reads as it was: they change which passage
# it gets, how many samples are drawn or how a reply is parsed, not the prompt text or the format
# of the context. Under weights trained in this run they go before the others (relevance ties
# within each group), because RSFT weights co-adapt with the harness they were trained under:
# measured on search QA (docs/results/headroom_after_weights), on weight-only's trained weights
# three passages instead of one cost -0.52 [-0.60, -0.44] test mean@2, while majority vote gained
# +0.023 [+0.008, +0.043] and question-as-query was neutral; under the base weights the same three
# passages are a fix. A layout change can still come, after the layout-preserving fixes, even
# after those that lost under earlier weights: in the seed-0 `gain_v2` run's second harness phase
# (weights w11, h4 at ~0.88) the layout changes scored 0.06 (more search turns), 0.22 (three
# passages) and 0.50 (retrieved titles) on 32 problems, while the layout-preserving ones held 0.875.
KEEPS_LAYOUT = frozenset({"majority_vote", "question_as_query", "query_rewrite", "rerank_passages", "answer_first_line",
                          "retry_parse_failure", "illegal_retry", "constrained_choice"})


def keeps_layout(mutation: "Mutation") -> bool:
    return mutation.name in KEEPS_LAYOUT


def fixes_of(mutation: "Mutation") -> tuple[str, ...]:
    base = "system_prompt_rewrite" if mutation.name.startswith("system_prompt_rewrite") else mutation.name
    return FIXES.get(base, ())


def relevance(mutation: "Mutation", diagnosis: Diagnosis) -> float:
    """Share of the failed episodes showing a mode this mechanism addresses (the top mode counts double)."""
    modes = fixes_of(mutation)
    top = diagnosis.dominant
    return sum(diagnosis.share(m) * (2.0 if m == top else 1.0) for m in modes)


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


def mutations_for(domain: str, prompt_only: bool = False) -> list[Mutation]:
    out = [m for m in LIBRARY if m.applies_to(domain) and (m.prompt_only or not prompt_only)]
    if any(m.name.startswith("system_prompt_rewrite_") for m in out):
        out = [m for m in out if m.name != "system_prompt_rewrite"]
    return out


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
    new = stamp_docstring(new, mutation.hypothesis, mutation.name, parent)
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

    def propose(self, archive, domain, n, workspace, context) -> list[Proposal]:
        """Diagnose the parent's traces, then apply the mechanisms that address its failure modes,
        most relevant first, except that under trained weights one that changes the layout of the
        model's context goes after every layout-preserving one (KEEPS_LAYOUT), and within each group
        one already shown in this run not to beat its parent goes after those not shown to fail;
        then untried-under-these-weights first, seeded ties; mechanisms that address no diagnosed
        mode come last (library coverage). See FIXES."""
        self.last_error, self.last_usage = None, {}
        version = context.weights_version
        rng = random.Random(f"{self.seed}/{version}/{context.incoming_id}/{context.iteration}")
        muts = mutations_for(domain.name, context.prompt_only)
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
        diagnoses: dict[str, Diagnosis] = {}
        out: list[Proposal] = []
        for _ in range(4 * max(1, n)):
            if len(out) >= n or not muts:
                break
            # mostly the best harness (fix what fails there), sometimes another archive member
            parent = ranked[0] if len(ranked) == 1 or rng.random() < 0.75 else \
                rng.choices(ranked[1:], [1.0 / (i + 1) for i in range(len(ranked) - 1)])[0]
            if parent not in diagnoses:
                diagnoses[parent] = diagnose_harness(archive, parent, version, domain.name)
            diag = diagnoses[parent]
            order = sorted(muts, key=lambda m: (relevance(m, diag) <= 0, trained and not keeps_layout(m),
                                                m.name in lost, -round(relevance(m, diag), 9),
                                                m.name in tried, rng.random()))
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
                tried.add(mutation.name)
                out.append(self._proposal(new, mutation, parent, diag))
                break
        if len(out) < n:
            self.last_error = (f"only {len(out)} of {n} mutations applied (domain {domain.name!r}: "
                               f"{len(muts)} mechanisms, parents {ranked[:5]})")
        return out

    @staticmethod
    def _proposal(source: str, mutation: Mutation, parent: str, diag: Diagnosis) -> Proposal:
        addressed = [m for m in fixes_of(mutation) if diag.counts.get(m)]
        why = (f"addresses {', '.join(addressed)} ({', '.join(f'{diag.counts[m]}/{diag.failures}' for m in addressed)} "
               "failed episodes)" if addressed else "not aimed at a diagnosed mode (library coverage)")
        hypothesis = f"Diagnosis of {parent}: {diag.text(top=2)} {mutation.name} {why}: {mutation.hypothesis}"
        return Proposal(source=source, hypothesis=hypothesis, mechanism=mutation.name,
                        notes=f"mutation {mutation.name} of {parent}; diagnosis {diag.to_json()}", parent=parent)
