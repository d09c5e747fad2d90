"""Search-QA problems and their splits: the offline Factbook set, or Search-R1 style real data.

Splits are deterministic from the config seed and disjoint by question text. Sources (templates
offline; `data_source` such as nq / hotpotqa for real data) are interleaved after a seeded
shuffle within each source, and the splits are cut in the order test, val, harness, weight: the
test set has an even mix of sources (the paper evaluates 100 per Search-R1 test set) and does
not change when the weight split is resized.

Real data (`domain.source: searchr1`): rows of jsonl/json/parquet files (FlashRAG / Search-R1
layout) with `question` and `golden_answers` (or Search-R1's `reward_model.ground_truth.target`),
`data_source` (else the file name) and `id`. `domain.data_path` is a file, a folder of such
files, or an HF dataset id (loaded with `datasets`, only when it is not a local path).
`domain.options.test_path` optionally names separate held-out data (the 7 test sets): val and
test are then drawn from it and weight/harness from `data_path`, with test questions removed
from the training pool.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterable

from whale.domains.base import SPLITS, Problem, read_jsonl
from whale.domains.searchqa.retrieval import read_parquet

SOURCES = ("offline", "searchr1")
_ORDER = ("test", "val", "harness", "weight")  # cut order: held-out splits first


def interleave(problems: Iterable[Problem], seed: int) -> list[Problem]:
    """Seeded shuffle within each source, then round-robin over sources (sorted by name)."""
    by_source: dict[str, list[Problem]] = {}
    for p in sorted(problems, key=lambda p: p.id):
        by_source.setdefault(p.source, []).append(p)
    rng = random.Random(f"searchqa-splits-{seed}")
    queues = []
    for source in sorted(by_source):
        items = by_source[source]
        rng.shuffle(items)
        queues.append(items)
    out: list[Problem] = []
    depth = max((len(q) for q in queues), default=0)
    for i in range(depth):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def dedupe(problems: Iterable[Problem]) -> list[Problem]:
    """One problem per question text (case/space-insensitive); the first by id wins."""
    seen: set[str] = set()
    out = []
    for p in sorted(problems, key=lambda p: p.id):
        key = " ".join(p.question.lower().split())
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def cut_splits(pool: list[Problem], sizes: dict[str, int], seed: int, what: str,
               names: tuple[str, ...] = _ORDER) -> dict[str, list[Problem]]:
    need = sum(sizes[n] for n in names)
    if need > len(pool):
        detail = ", ".join(f"{n}={sizes[n]}" for n in names)
        raise ValueError(f"searchqa: {what} has {len(pool)} distinct questions but the splits ask for {need} "
                         f"({detail}); lower domain.splits.* or add data")
    ordered = interleave(pool, seed)
    out, start = {}, 0
    for n in names:
        out[n] = ordered[start:start + sizes[n]]
        start += sizes[n]
    return out


def make_splits(problems: list[Problem], sizes: dict[str, int], seed: int, what: str,
                held_out: list[Problem] | None = None) -> dict[str, list[Problem]]:
    """All four splits; with `held_out`, val/test come from it and weight/harness from `problems`."""
    if held_out is None:
        splits = cut_splits(dedupe(problems), sizes, seed, what)
    else:
        held = dedupe(held_out)
        splits = cut_splits(held, sizes, seed, f"{what} (test_path)", ("test", "val"))
        taken = {" ".join(p.question.lower().split()) for p in held}
        train = [p for p in dedupe(problems) if " ".join(p.question.lower().split()) not in taken]
        splits.update(cut_splits(train, sizes, seed, what, ("harness", "weight")))
    return {n: splits[n] for n in SPLITS}


# ---------------------------------------------------------------- Search-R1 style rows


def _gold(row: dict[str, Any]) -> list[str]:
    gold: Any = row.get("golden_answers")
    if gold is None:
        gold = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if gold is None:
        gold = row.get("answers", row.get("answer"))
    if gold is None:
        return []
    if isinstance(gold, str):
        return [gold]
    return [str(g) for g in list(gold) if str(g).strip()]


def rows_to_problems(rows: Iterable[dict[str, Any]], default_source: str) -> list[Problem]:
    out = []
    for i, row in enumerate(rows):
        question = str(row.get("question") or "").strip()
        gold = _gold(row)
        if not question or not gold:
            raise ValueError(f"searchqa: row {i} of {default_source!r} needs 'question' and 'golden_answers' "
                             f"(got keys {sorted(row)})")
        source = str(row.get("data_source") or default_source)
        rid = str(row.get("id", i))
        out.append(Problem(id=f"{source}:{rid}", question=question, answer=gold, source=source))
    return out


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return read_parquet(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, list) else list(data.get("data", []))
    return read_jsonl(path)


def load_searchr1(data_path: str, hf_split: str | None = None) -> list[Problem]:
    """Problems from a local file/folder, or from the HF hub when `data_path` is not a local path."""
    p = Path(data_path).expanduser()
    if p.exists():
        files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise ValueError(f"searchqa: {data_path!r} has no .jsonl/.json/.parquet files")
        problems = []
        for f in files:
            problems.extend(rows_to_problems(_read_rows(f), f.stem.split(".")[0]))
        return problems
    try:
        import datasets
    except ImportError:
        raise ValueError(f"searchqa: data_path {data_path!r} is not a local path, and loading it from the HF hub "
                         "needs `pip install datasets`") from None
    try:
        ds = datasets.load_dataset(data_path, split=hf_split)
    except Exception as e:  # noqa: BLE001 - offline mode, unknown id, ...: one readable message
        raise ValueError(f"searchqa: could not load {data_path!r} as a local path or HF dataset: {e}") from None
    parts = [ds] if hf_split else [ds[name] for name in sorted(ds)]
    problems = []
    for part in parts:
        problems.extend(rows_to_problems(part, data_path.rsplit("/", 1)[-1]))
    return problems
