"""Search QA's hints: what we learned about this task, declared for the harness search.

Used only with `harness.domain_hints: on` (the default, so the published search-QA runs repeat);
shown in the archive and the report as "hint: <name>". Mechanisms splice the blocks of
hint_blocks.py; `episode_modes` names the retrieval and answer failures the diagnosis counts
(harness/diagnose.py) and the mechanisms aim at. Why word overlap for "off-topic": the question's
entity (its capitalised words) and its other content words are what BM25 needs to match; a
passage that names neither cannot contain the answer. Comparing stems (the first max(4, len - 2)
letters) tolerates "Kenya"/"Kenyan".

A reranker of passages by title overlap (`rerank_passages`) was in this library until 2026-12-06
and was removed: it was written after reading the comparison's own test traces.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from typing import Any

from whale.domains.searchqa import hint_blocks as B
from whale.harness.blocks import ANSWER_LINE_STOP
from whale.harness.mechanism import (REWRITE_FIXES, Hints, Mutation, append_user_prompt, fill, rewrite_system_prompt,
                                   wrap)
from whale.harness.source_edit import bump_constants, module_assign, prompt_fields, replace_base_run

SYSTEM_PROMPTS = (
    "You answer factual questions with a search engine. Search for the main entity of the question "
    "first, read the passage, then reply with only the short answer inside <answer></answer>.",
    "You are a precise research assistant. Use <search>query</search> to look facts up instead of "
    "guessing. The final answer is a short entity (a name, place or number) inside <answer></answer>.",
)

TEXT = """\
What tends to help a small model here: always searching (not only when it asks), short queries that
name the entity (the question itself retrieves the right passage most of the time with BM25),
putting few and short passages in the prompt, a second search for two-hop questions, prefilling the
assistant turn with "<answer>" and stopping at "</answer>", and cleaning the answer (no sentence,
no elevation or code unless asked)."""


def _more_search_turns(source, rng):
    tree = ast.parse(source)
    node = module_assign(tree, "USER_PROMPT")
    if node is None or "env.search(" not in source or not isinstance(node.value, ast.Constant) \
            or prompt_fields(node.value.value) != {"question"}:
        return None
    return replace_base_run(source, "more_search_turns", B.SEARCH_TURNS_RUN)


def _longer_passages(source, rng):
    return bump_constants(source, r"^(MAX_)?PASSAGE_(WORDS|CHARS|TOKENS)$", lambda v: v * 2)


MECHANISMS = (
    Mutation("system_prompt_rewrite_searchqa", "A system prompt that states the strategy and the answer format "
             "keeps a small model on task.", rewrite_system_prompt(SYSTEM_PROMPTS), prompt_only=True,
             fixes=REWRITE_FIXES, hint=True, replaces=("system_prompt_rewrite",)),
    Mutation("more_passages", "The top-1 passage often misses the answer; the top 3 passages, "
             "shortened, contain it more often.", wrap("more_passages", B.MORE_PASSAGES, needs="env.search("),
             fixes=("missing_relation", "off_topic_retrieval"), hint=True),
    Mutation("longer_passages", "Passages are cut before the sentence with the answer; twice the "
             "length keeps it.", _longer_passages, fixes=("missing_relation",), hint=True),
    Mutation("query_rewrite", "BM25 matches content words; dropping question words and punctuation "
             "from queries retrieves the right passage more often.",
             wrap("query_rewrite", B.QUERY_REWRITE, needs="env.search("),
             fixes=("off_topic_retrieval", "empty_retrieval", "missing_relation"), keeps_layout=True, hint=True),
    Mutation("force_retrieval", "The model often answers without searching; retrieving for the "
             "question up front puts evidence in every prompt.", wrap("force_retrieval", B.FORCE_RETRIEVAL),
             fixes=("unused_tool", "off_topic_query", "empty_retrieval"), hint=True),
    Mutation("retrieved_titles", "A line listing the titles retrieved so far tells the model which "
             "entities it already has evidence for.", wrap("retrieved_titles", B.RETRIEVED_TITLES),
             fixes=("wrong_answer",), hint=True),
    Mutation("final_format_reminder", "Answers fail exact match when they are sentences; asking for "
             "only the short entity fixes the format.", append_user_prompt(B.SEARCHQA_REMINDER), prompt_only=True,
             fixes=("long_answer", "no_answer_tag", "length_cutoff"), hint=True),
    # the question always names what is asked, so it also fixes a query that drops the relation
    Mutation("question_as_query", "The model writes poor queries (often an unrelated name); the "
             "question itself retrieves the right passage ~95% of the time with BM25.",
             wrap("question_as_query", B.QUESTION_AS_QUERY, needs="env.search("), conflicts=("query_rewrite",),
             fixes=("off_topic_query", "empty_retrieval", "unused_tool", "tool_error", "missing_relation"),
             keeps_layout=True, hint=True),
    Mutation("answer_first_line", "After the right entity the model keeps writing (explanations, "
             "new lines), which fails exact match; ending the answer at the first line keeps just the entity.",
             wrap("answer_first_line", fill(ANSWER_LINE_STOP, open="<answer>"), needs="<answer>"),
             fixes=("long_answer", "length_cutoff", "empty_answer"), keeps_layout=True, hint=True),
    Mutation("more_search_turns", "Two-hop questions need a second search; up to three search turns "
             "let the model find the bridge entity first.", _more_search_turns, fixes=("missing_relation",),
             hint=True),
)

MODES = {
    "empty_retrieval": "every search returned no passage",
    "off_topic_query": "the search queries do not mention the question's entity (so neither do the passages)",
    "off_topic_retrieval": "no retrieved passage (title or text) mentions the question's entity",
    "missing_relation": "the passages name the entity but not what is asked",
    "no_answer_tag": "the submission has no complete <answer>...</answer>",
    "empty_answer": "the answer tag is empty (the model opened with a line break or stop string)",
    "long_answer": "the answer is a sentence (more than 5 words), not a short entity",
}

ANSWER_WORDS = 5
_STOP = set("""a an the of in on at to for from by with and or is are was were be been do does did what which who
whom whose where when why how name named called this that these those it its their there here as into than
then about country""".split())
_ANSWER = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)


def episode_modes(row: dict[str, Any], tools: list[dict], answer: str | None) -> list[str]:
    """Retrieval and answer-format failures of one failed search-QA episode."""
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


HINTS = Hints(mechanisms=MECHANISMS, modes=MODES, episode_modes=episode_modes, main_tool="search", text=TEXT)
