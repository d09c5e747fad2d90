"""Retrievers behind `env.search`: in-process BM25 (bm25s) or a Search-R1 `/retrieve` HTTP server.

Both return passages as `{"title", "text"}` dicts, best first. The HTTP client speaks Search-R1's
protocol (`search_r1/search/retrieval_server.py`): POST `{"queries": [q], "topk": k,
"return_scores": true}` and read `{"result": [[{"document": {"id", "contents"}, "score"}, ...]]}`,
where `contents` is `"Title"\\ntext` as in the wiki-18 corpus. That is how the paper's E5 index
over 2018 Wikipedia (~75 GB, on its own GPU server) plugs in without this package knowing it.

BM25 tokenisation is our own (accents folded, lower case, English stopwords, a light plural
stemmer) rather than bm25s's, so that "shilling" finds "shillings" and "Bogota" finds "Bogotá"
without the optional PyStemmer dependency. Indexing the Factbook (76k passages) takes ~3 s on
2 cores.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable

import bm25s
from bm25s.stopwords import STOPWORDS_EN

from whale.domains.base import DataError, EpisodeError, read_jsonl

_WORD = re.compile(r"\w\w+")


def _stopwords() -> frozenset[str]:
    return frozenset(STOPWORDS_EN)


def _stem(word: str) -> str:
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def tokenize(text: str, stopwords: frozenset[str]) -> list[str]:
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(c for c in text if not unicodedata.combining(c))
    return [_stem(w) for w in _WORD.findall(text) if w not in stopwords]


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1 / wiki-18 `contents` ('"Title"\\ntext') -> (title, text)."""
    contents = str(contents)
    first, sep, rest = contents.partition("\n")
    if sep and first.startswith('"') and first.endswith('"') and len(first) >= 2:
        return first[1:-1], rest.strip()
    return "", contents.strip()


class BM25Retriever:
    """bm25s over `title + text`; one index shared by all episodes (tool calls come from threads)."""

    def __init__(self, passages: Iterable[dict[str, str]]):
        self.passages = [{"title": p.get("title", ""), "text": p.get("text", "")} for p in passages]
        if not self.passages:
            raise DataError("searchqa: the BM25 corpus is empty")
        self._stopwords = _stopwords()
        tokens = [tokenize(f"{p['title']} {p['text']}", self._stopwords) for p in self.passages]
        self._bm25 = bm25s.BM25()
        self._bm25.index(tokens, show_progress=False)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int) -> list[dict[str, str]]:
        """Top-k passages by BM25; passages that share no term with the query are left out."""
        toks = tokenize(query, self._stopwords)
        if not toks:
            return []
        k = min(k, len(self.passages))
        with self._lock:
            docs, scores = self._bm25.retrieve([toks], k=k, show_progress=False, n_threads=0)
        return [dict(self.passages[int(d)]) for d, s in zip(docs[0], scores[0]) if s > 0]


class HTTPRetriever:
    """Client of a Search-R1 style `/retrieve` server (stdlib urllib, no extra dependency)."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise DataError(f"searchqa: retriever_url must start with http:// or https:// (got {url!r})")
        self.url = url
        self.timeout_s = timeout_s

    def search(self, query: str, k: int) -> list[dict[str, str]]:
        body = json.dumps({"queries": [query], "topk": k, "return_scores": True}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = json.loads(resp.read().decode("utf-8"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise EpisodeError(f"retriever at {self.url} failed: {e}") from None
        try:
            hits = payload["result"][0]
        except (KeyError, IndexError, TypeError):
            raise EpisodeError(f"retriever at {self.url} answered without result[0]: {str(payload)[:200]}") from None
        out = []
        for hit in hits[:k]:
            doc = hit.get("document", hit) if isinstance(hit, dict) else {}
            if "contents" in doc:
                title, text = split_contents(doc["contents"])
            else:
                title, text = str(doc.get("title", "")), str(doc.get("text", ""))
            out.append({"title": title, "text": text})
        return out


def load_corpus(path: str) -> list[dict[str, str]]:
    """A local passage corpus: jsonl (or parquet) rows with `contents` ('"Title"\\ntext') or title/text."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"searchqa: corpus_path {path!r} does not exist")
    files = sorted(f for f in p.iterdir() if f.suffix in (".jsonl", ".parquet")) if p.is_dir() else [p]
    if not files:
        raise DataError(f"searchqa: corpus folder {path!r} has no .jsonl or .parquet files")
    rows: list[dict[str, Any]] = []
    for f in files:
        if f.suffix == ".parquet":
            rows.extend(read_parquet(f))
        else:
            rows.extend(read_jsonl(f))
    passages = []
    for row in rows:
        if "contents" in row:
            title, text = split_contents(row["contents"])
        elif "text" in row:
            title, text = str(row.get("title", "")), str(row["text"])
        else:
            raise DataError(f"searchqa: corpus row needs 'contents' or 'text': {str(row)[:200]}")
        passages.append({"title": title, "text": text})
    return passages


def read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq  # not a dependency: only .parquet corpora need it
    except ImportError:
        raise DataError(f"searchqa: reading {path} needs pyarrow (pip install pyarrow)") from None
    return pq.read_table(path).to_pylist()
