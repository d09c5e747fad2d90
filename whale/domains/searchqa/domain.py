"""The search-QA domain: retrieval-augmented factual QA in the Search-R1 protocol.

`SearchQADomain(cfg)` reads `cfg.domain`:
- `source`: "offline" (CIA World Factbook questions and passages, no network) or "searchr1"
  (NQ/HotpotQA-style rows from `data_path`, optional `options.test_path`);
- retrieval: `retriever_url` (a Search-R1 `/retrieve` server) if set, else BM25 over
  `corpus_path` (wiki-18 style jsonl) if set, else over the Factbook passages (offline only);
- `grader`: "em" (default), "subspan" or "judge" (`judge_model`, `options.judge_base_url`);
- `options`: see OPTIONS; a setting the chosen source/grader/retriever does not read is an error.

The BM25 index is built lazily on the first `make_env`, once per domain object, and shared by
every episode's `search` tool (calls arrive from the runner's tool threads).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

from whale.config import Config, ConfigError
from whale.domains.base import (AnswerFormat, EpisodeEnv, EpisodeError, Problem, Setting, refuse_unread_settings,
                                split_sizes)
from whale.domains.searchqa import data, factbook, grading
from whale.domains.searchqa.hints import HINTS
from whale.domains.searchqa.retrieval import BM25Retriever, HTTPRetriever, load_corpus

MAX_K = 10
MAX_QUERY_CHARS = 2000

BRIEF = """\
Search QA (Search-R1 protocol). Each episode is one factual question, read as `env.question`.
Tools: `env.search(query: str, k: int = 3) -> list[{{"title", "text"}}]` returns up to k passages
(k is clamped to 1..10), best first, from {corpus}; `env.submit(answer: str)` ends the episode
(call it exactly once). Grader: {grader}. {grader_detail}
Answers are short entities (a name, a city, a currency). Questions come from {questions}; some
need two hops (first find the bridge entity, then search again for the asked fact).
Harness code may use only the standard library, `env` and `llm`."""

GRADER_DETAIL = {
    "em": "The submitted text's last <answer>...</answer> (or the whole text when it has no tag) must "
          "equal a gold alias after lower-casing and removing punctuation, articles and extra spaces.",
    "subspan": "The submitted text's last <answer>...</answer> (or the whole text) must contain a gold "
               "alias as whole words and be at most 5 words long (longer only if the alias is).",
    "judge": "An LLM judge decides whether the last <answer>...</answer> names the gold entity "
             "(exact match when the judge is unreachable).",
}


def _judging(d) -> bool:
    return d.grader == "judge"


FIELDS = {
    "data_path": Setting("Search-R1 style rows", "domain.source: searchr1", lambda d: d.source == "searchr1"),
    "corpus_path": Setting("passages for BM25 (instead of the Factbook's)", "no domain.retriever_url",
                           lambda d: not d.retriever_url),
    "retriever_url": Setting("a Search-R1 /retrieve server"),
    "judge_model": Setting("the judge's model name", "domain.grader: judge", _judging),
}
OPTIONS = {
    "templates": Setting("a subset of the Factbook templates, e.g. [capital, currency]", "domain.source: offline",
                         lambda d: d.source == "offline"),
    "test_path": Setting("held-out rows for val and test (the 7 test sets)", "domain.source: searchr1",
                         lambda d: d.source == "searchr1"),
    "hf_split": Setting("HF dataset split of data_path", "domain.source: searchr1", lambda d: d.source == "searchr1"),
    "hf_test_split": Setting("HF dataset split of test_path", "domain.options.test_path",
                             lambda d: d.source == "searchr1" and bool(d.options.get("test_path"))),
    "retriever_timeout_s": Setting("seconds per /retrieve call (default 30)", "domain.retriever_url",
                                   lambda d: bool(d.retriever_url)),
    "judge_base_url": Setting("the judge's OpenAI-compatible endpoint", "domain.grader: judge", _judging),
    "judge_api_key_env": Setting("env var with the judge's key", "domain.grader: judge", _judging),
    "judge_timeout_s": Setting("seconds per judge call", "domain.grader: judge", _judging),
}


class SearchQAEnv(EpisodeEnv):
    """One episode: the question, a search tool over the shared retriever, and submit."""

    tools = ("search", "submit")

    def __init__(self, problem: Problem, retriever: Any):
        super().__init__(problem)
        self._retriever = retriever

    def public_state(self) -> dict[str, Any]:
        return {"question": self.problem.question}

    def search(self, query: str, k: int = 3) -> list[dict[str, str]]:
        if not isinstance(query, str) or not query.strip():
            raise EpisodeError("env.search needs a non-empty query string")
        if isinstance(k, bool) or not isinstance(k, (int, float)):
            raise EpisodeError(f"env.search: k must be an integer (got {k!r})")
        k = max(1, min(MAX_K, int(k)))
        return self._retriever.search(query.strip()[:MAX_QUERY_CHARS], k)


class SearchQADomain:
    name = "searchqa"
    answer_format = AnswerFormat("a short entity inside <answer></answer>", pattern=r"<answer>(.*?)</answer>",
                                 open="<answer>", close="</answer>")
    hints = HINTS

    def __init__(self, cfg: Config):
        self.cfg = cfg
        d = cfg.domain
        if d.source not in data.SOURCES:
            raise ConfigError(f"domain.source for searchqa must be one of {list(data.SOURCES)} (got {d.source!r})")
        self.grader_name = "em" if d.grader in ("default", "") else d.grader
        if self.grader_name not in grading.GRADERS:
            raise ConfigError(f"domain.grader for searchqa must be one of {list(grading.GRADERS)} (got {d.grader!r})")
        if d.source == "searchr1":
            if not d.data_path:
                raise ConfigError("domain.source 'searchr1' needs domain.data_path (file, folder or HF dataset id)")
            if not d.retriever_url and not d.corpus_path:
                raise ConfigError("domain.source 'searchr1' needs domain.retriever_url or domain.corpus_path")
        refuse_unread_settings("searchqa", d, FIELDS, OPTIONS)
        if d.corpus_path and not d.retriever_url and not Path(d.corpus_path).exists():
            raise ConfigError(f"domain.corpus_path {d.corpus_path!r} does not exist")
        try:
            self._grader = self._make_grader()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.grade = self._grader  # picklable (a module-level function or a partial of one)
        self._retriever: BM25Retriever | HTTPRetriever | None = None
        self.brief = BRIEF.format(
            corpus=self._corpus_label(), grader=self.grader_name, grader_detail=GRADER_DETAIL[self.grader_name],
            questions="the CIA World Factbook (capital, currency, highest point, national anthem of a country)"
            if d.source == "offline" else "Search-R1 style QA data (NQ, HotpotQA, ...)")

    # ------------------------------------------------------------ Domain protocol

    def load_splits(self) -> dict[str, list[Problem]]:
        d = self.cfg.domain
        sizes = split_sizes(d.splits)
        if d.source == "offline":
            return data.make_splits(self._offline_questions(), sizes, self.cfg.seed, "the offline Factbook set",
                                    mix_sources=False)
        problems = data.load_searchr1(d.data_path, d.options.get("hf_split"))
        held_out = None
        if d.options.get("test_path"):
            held_out = data.load_searchr1(d.options["test_path"], d.options.get("hf_test_split"))
        return data.make_splits(problems, sizes, self.cfg.seed, f"data_path {d.data_path!r}", held_out)

    def make_env(self, problem: Problem) -> SearchQAEnv:
        return SearchQAEnv(problem, self.retriever)

    def grader(self) -> Callable[[Problem, str | None], float]:
        return self._grader

    def base_harness(self) -> str:
        return (Path(__file__).parent / "h0.py").read_text(encoding="utf-8")

    # ------------------------------------------------------------ internals

    @property
    def retriever(self) -> BM25Retriever | HTTPRetriever:
        if self._retriever is None:
            d = self.cfg.domain
            if d.retriever_url:
                self._retriever = HTTPRetriever(d.retriever_url, float(d.options.get("retriever_timeout_s", 30.0)))
            elif d.corpus_path:
                self._retriever = BM25Retriever(load_corpus(d.corpus_path))
            else:
                self._retriever = BM25Retriever(factbook.load_passages())
        return self._retriever

    def _offline_questions(self) -> list[Problem]:
        """Factbook questions, optionally only the templates in `domain.options.templates`."""
        chosen = self.cfg.domain.options.get("templates")
        if chosen is None:
            return list(factbook.build_questions())
        if isinstance(chosen, str):
            chosen = [chosen]
        unknown = sorted(set(chosen) - set(factbook.TEMPLATES))
        if unknown or not chosen:
            raise ConfigError(f"domain.options.templates: unknown {unknown or 'empty list'}; "
                              f"choose from {list(factbook.TEMPLATES)}")
        return [p for p in factbook.build_questions() if p.source in chosen]

    def _corpus_label(self) -> str:
        d = self.cfg.domain
        if d.retriever_url:
            return f"the retrieval server at {d.retriever_url}"
        if d.corpus_path:
            return f"BM25 over the passages in {d.corpus_path}"
        return ('BM25 over CIA World Factbook fields, one passage per field, titled like '
                '"Kenya: Government > Capital > name" with the value as text')

    def _make_grader(self) -> Callable[[Problem, str | None], float]:
        if self.grader_name == "em":
            return grading.grade_em
        if self.grader_name == "subspan":
            return grading.grade_subspan
        settings = grading.judge_settings(self.cfg.domain.judge_model, self.cfg.domain.options)
        return functools.partial(grading.grade_judge, **settings)
