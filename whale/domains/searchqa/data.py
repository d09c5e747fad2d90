"""Search-QA problems and their splits: the offline Factbook set, or Search-R1 style real data.

Splits are deterministic from the config seed and disjoint by ENTITY, not only by question text:
"What is the currency of France?" and "What is the currency of the country whose capital is
Paris?" share a gold answer, so a model fine-tuned on one has seen the other's answer. Every
question about one entity, whatever its template or phrasing, lands in exactly one split:
- offline (Factbook): the entity is the country;
- real data: rows name no entity, so questions are linked by their gold answers (normalised as
  the EM grader does; "yes"/"no" name no entity and link nothing) and by their text; linked
  questions (transitively) form one group.
Groups are shuffled with the seed (real data: within each `data_source`, then round-robin over
sources, so the test set has an even mix) and dealt whole in the order test, val, harness,
weight (base.deal_groups): the test set does not change when the weight split is resized.

Real data (`domain.source: searchr1`): rows of jsonl/json/parquet files (FlashRAG / Search-R1
layout) with `question` and `golden_answers` (or Search-R1's `reward_model.ground_truth.target`),
`data_source` (else the file name) and `id`. `domain.data_path` is a file, a folder of such
files, or an HF dataset id (loaded with `datasets`, only when it is not a local path).
`domain.options.test_path` optionally names separate held-out data (the 7 test sets): val and
test are then drawn from it and weight/harness from `data_path`, with every training question
linked to a held-out one (same text or a shared gold answer) removed from the training pool.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterable

from whale.domains.base import DEAL_ORDER, SPLITS, DataError, Problem, content_groups, deal_groups, read_jsonl
from whale.domains.searchqa.grading import gold_aliases
from whale.domains.searchqa.retrieval import read_parquet

SOURCES = ("offline", "searchr1")
NO_ENTITY_ANSWERS = frozenset({"yes", "no"})  # HotpotQA comparison answers: shared by thousands, about nothing


def question_key(p: Problem) -> str:
    return " ".join(p.question.lower().split())


def entity_keys(p: Problem) -> list[tuple[str, str]]:
    """What links two questions for splitting: the same text, and the entity (or gold answer)."""
    keys = [("question", question_key(p))]
    if p.meta.get("entity"):
        return keys + [("entity", str(p.meta["entity"]))]
    return keys + [("gold", a) for a in gold_aliases(p) if a not in NO_ENTITY_ANSWERS]


def order_groups(groups: list[list[Problem]], seed: int, mix_sources: bool) -> list[list[Problem]]:
    """Seeded shuffle; with `mix_sources`, within each source (of the group's first question), then round-robin."""
    rng = random.Random(f"searchqa-splits-{seed}")
    queues: dict[str, list[list[Problem]]] = {}
    for g in groups:
        queues.setdefault(g[0].source if mix_sources else "", []).append(g)
    for source in sorted(queues):
        rng.shuffle(queues[source])
    ordered = [queues[s] for s in sorted(queues)]
    out: list[list[Problem]] = []
    for i in range(max((len(q) for q in ordered), default=0)):
        out.extend(q[i] for q in ordered if i < len(q))
    return out


def dedupe(problems: Iterable[Problem]) -> list[Problem]:
    """One problem per question text (case/space-insensitive); the first by id wins."""
    seen: set[str] = set()
    out = []
    for p in sorted(problems, key=lambda p: p.id):
        key = question_key(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def cut_splits(pool: list[Problem], sizes: dict[str, int], seed: int, what: str, mix_sources: bool,
               names: tuple[str, ...] = DEAL_ORDER) -> dict[str, list[Problem]]:
    need = sum(sizes[n] for n in names)
    if need > len(pool):
        detail = ", ".join(f"{n}={sizes[n]}" for n in names)
        raise DataError(f"searchqa: {what} has {len(pool)} distinct questions but the splits ask for {need} "
                        f"({detail}); lower domain.splits.* or add data")
    groups = order_groups(content_groups(pool, entity_keys), seed, mix_sources)
    return deal_groups(groups, sizes, names, f"searchqa: {what}", seed=f"searchqa-order-{seed}")


def make_splits(problems: list[Problem], sizes: dict[str, int], seed: int, what: str,
                held_out: list[Problem] | None = None, mix_sources: bool = True) -> dict[str, list[Problem]]:
    """All four splits; with `held_out`, val/test come from it and weight/harness from `problems`."""
    if held_out is None:
        splits = cut_splits(dedupe(problems), sizes, seed, what, mix_sources)
    else:
        held = dedupe(held_out)
        splits = cut_splits(held, sizes, seed, f"{what} (test_path)", mix_sources, ("test", "val"))
        taken = {k for p in held for k in entity_keys(p)}
        train = [p for p in dedupe(problems) if not taken.intersection(entity_keys(p))]
        splits.update(cut_splits(train, sizes, seed, what, mix_sources, ("harness", "weight")))
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
        if not isinstance(row, dict):
            raise DataError(f"searchqa: row {i + 1} of {default_source!r} is a {type(row).__name__}, not an object "
                            "with 'question' and 'golden_answers'")
        question = str(row.get("question") or "").strip()
        gold = _gold(row)
        if not question or not gold:
            raise DataError(f"searchqa: row {i + 1} of {default_source!r} needs 'question' and 'golden_answers' "
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
            raise DataError(f"searchqa: {data_path!r} has no .jsonl/.json/.parquet files")
        problems = []
        for f in files:
            problems.extend(rows_to_problems(_read_rows(f), f.stem.split(".")[0]))
        return problems
    try:
        import datasets  # optional extra: hub
    except ImportError:
        raise DataError(f"searchqa: data_path {data_path!r} is not a local path, and loading it from the HF hub "
                        "needs `pip install datasets`") from None
    try:
        ds = datasets.load_dataset(data_path, split=hf_split)
    except Exception as e:  # noqa: BLE001 - offline mode, unknown id, ...: one readable message
        raise DataError(f"searchqa: could not load {data_path!r} as a local path or HF dataset: {e}") from None
    parts = [ds] if hf_split else [ds[name] for name in sorted(ds)]
    problems = []
    for part in parts:
        problems.extend(rows_to_problems(part, data_path.rsplit("/", 1)[-1]))
    return problems
