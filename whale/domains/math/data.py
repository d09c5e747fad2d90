"""Math problems: a seeded generator of easy arithmetic, 100 vendored GSM8K originals, real loaders.

Why a generator: SmolLM2-135M solves GSM8K ≈0% of the time (docs/domains.md),
so RSFT on GSM8K alone would accept nothing. Arithmetic a small model can sometimes get right,
especially with a Python tool, gives the weight phase a signal. GSM8K stays in the mix (default 5%)
so per-source breakdowns show the harder task too.

Splits are disjoint by content, deterministic from the seed, and dealt test first, then val,
harness, weight: growing the weight split never changes the test set. Content is the CANONICAL
EXPRESSION for generated problems, not the phrasing: "What is 7 * 8?", "Compute 8 times 7." and
"A box holds 7 cards. How many cards are in 8 boxes?" are one problem (`(7*8)`), so the generator
keeps one problem per expression and no product reaches two splits in other words. Operands of
+ and * are sorted, so a + b*c and c*b + a agree; - and / keep their order. Vendored GSM8K and
real data have no expression: their key is the normalised question text.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from whale.domains.base import DEAL_ORDER, SPLITS, DataError, Problem, read_jsonl

GSM8K_FILE = Path(__file__).with_name("gsm8k_test100.jsonl")
GENERATED = ("arith_add", "arith_mul", "arith_mixed", "word")
OFFLINE_SOURCES = GENERATED + ("gsm8k",)
DEFAULT_MIX = {"arith_add": 0.3, "arith_mul": 0.2, "arith_mixed": 0.25, "word": 0.2, "gsm8k": 0.05}
REAL_SOURCES = ("gsm8k", "dapo", "aime")


def normalize_question(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def content_key(problem: Problem) -> str:
    """What makes two problems the same: the canonical expression, else the normalised text."""
    return problem.meta.get("expression") or normalize_question(problem.question)


def shuffle_key(seed: int, problem: Problem) -> str:
    """A seeded, content-derived sort key: the same problem always lands in the same place."""
    return hashlib.sha256(f"{seed}\x00{content_key(problem)}".encode()).hexdigest()


def _problem(source: str, question: str, answer: str, **meta: Any) -> Problem:
    digest = hashlib.sha1(normalize_question(question).encode()).hexdigest()[:12]
    return Problem(id=f"{source}-{digest}", question=question, answer=str(answer), source=source, meta=meta)


# ---------------------------------------------------------------------------------------------
# Generator. Each function draws one (question, answer, canonical expression) from `rng`;
# integers stay small.
# ---------------------------------------------------------------------------------------------

def add(*terms: Any) -> str:
    return "(" + "+".join(sorted(map(str, terms))) + ")"


def mul(*factors: Any) -> str:
    return "(" + "*".join(sorted(map(str, factors))) + ")"


def sub(a: Any, b: Any) -> str:
    return f"({a}-{b})"


def div(a: Any, b: Any) -> str:
    return f"({a}/{b})"


NAMES = ["Tom", "Sara", "Ben", "Mia", "Leo", "Ana", "Sam", "Eva", "Max", "Lily", "Omar", "Zoe"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "cookies", "cards", "shells", "coins"]


def _arith_add(rng: random.Random) -> tuple[str, int, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if rng.random() < 0.5:
        q = rng.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Calculate {a} plus {b}."])
        return q.format(a=a, b=b), a + b, add(a, b)
    a, b = max(a, b), min(a, b)
    q = rng.choice(["What is {a} - {b}?", "Compute {a} - {b}.", "Calculate {a} minus {b}."])
    return q.format(a=a, b=b), a - b, sub(a, b)


def _arith_mul(rng: random.Random) -> tuple[str, int, str]:
    a, b = rng.randint(2, 19), rng.randint(2, 12)
    if rng.random() < 0.6:
        q = rng.choice(["What is {a} * {b}?", "Compute {a} times {b}.", "Calculate {a} * {b}."])
        return q.format(a=a, b=b), a * b, mul(a, b)
    q = rng.choice(["What is {p} / {b}?", "Compute {p} divided by {b}.", "Calculate {p} / {b}."])
    return q.format(p=a * b, b=b), a, div(a * b, b)


def _arith_mixed(rng: random.Random) -> tuple[str, int, str]:
    a, b, c = rng.randint(2, 20), rng.randint(2, 12), rng.randint(1, 30)
    form = rng.randrange(4)
    if form == 0:
        expr, value, key = f"{a} * {b} + {c}", a * b + c, add(mul(a, b), c)
    elif form == 1:
        expr, value, key = f"{a} * {b} - {c}", a * b - c, sub(mul(a, b), c)
    elif form == 2:
        expr, value, key = f"({a} + {c}) * {b}", (a + c) * b, mul(add(a, c), b)
    else:
        expr, value, key = f"{a} + {b} * {c}", a + b * c, add(a, mul(b, c))
    q = rng.choice(["What is {e}?", "Compute {e}.", "Calculate the value of {e}."])
    return q.format(e=expr), value, key


def _word(rng: random.Random) -> tuple[str, int, str]:
    n, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 30), rng.randint(2, 20), rng.randint(2, 9)
    form = rng.randrange(6)
    if form == 0:
        return f"{n} has {a} {item}. {n} gets {b} more. How many {item} does {n} have now?", a + b, add(a, b)
    if form == 1:
        a = a + b
        return f"{n} had {a} {item} and gave away {b}. How many {item} are left?", a - b, sub(a, b)
    if form == 2:
        return f"A box holds {b} {item}. How many {item} are in {c} boxes?", b * c, mul(b, c)
    if form == 3:
        return (f"{c} friends share {b * c} {item} equally. How many {item} does each friend get?", b,
                div(b * c, c))
    if form == 4:
        return f"One pen costs {c} dollars. How many dollars do {b} pens cost?", b * c, mul(c, b)
    lost = rng.randint(1, b * c - 1)
    return (f"There are {c} bags with {b} {item} in each bag. {lost} {item} are lost. "
            f"How many {item} are left?"), b * c - lost, sub(mul(c, b), lost)


GENERATORS: dict[str, Callable[[random.Random], tuple[str, int, str]]] = {
    "arith_add": _arith_add, "arith_mul": _arith_mul, "arith_mixed": _arith_mixed, "word": _word,
}


GIVE_UP_AFTER = 5000  # draws in a row without a new expression: the generator is exhausted


def expression_stream(source: str, seed: int, taken: set[str]) -> Iterator[Problem]:
    """Problems of one generator with expressions not in `taken` (which grows), in a fixed order for (source, seed)."""
    if source not in GENERATORS:
        raise DataError(f"unknown math generator '{source}'; choose from {', '.join(GENERATORS)}")
    rng = random.Random(f"whale-math:{seed}:{source}")
    misses = 0
    while misses < GIVE_UP_AFTER:
        question, answer, expression = GENERATORS[source](rng)
        if expression in taken:
            misses += 1
            continue
        taken.add(expression)
        misses = 0
        yield _problem(source, question, str(answer), expression=expression)


def take(stream: Iterator[Problem], count: int, source: str, have: int = 0) -> list[Problem]:
    out = list(itertools.islice(stream, count))
    if len(out) < count:
        raise DataError(f"math generator '{source}' found only {have + len(out)} problems with distinct "
                        f"expressions of the {have + count} asked; lower the split sizes or its mix share")
    return out


def generate(source: str, count: int, seed: int, exclude: set[str] | None = None) -> list[Problem]:
    """`count` problems from one generator, each with its own canonical expression."""
    return take(expression_stream(source, seed, set() if exclude is None else exclude), count, source)


def load_gsm8k_vendored() -> list[Problem]:
    rows = [json.loads(line) for line in GSM8K_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [_problem("gsm8k", r["question"], r["answer"], gsm8k_test_index=r["id"]) for r in rows if "id" in r]


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------

def allocate(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Largest-remainder apportionment: counts that sum to `total` and follow `weights`."""
    norm = sum(weights.values())
    exact = {k: total * w / norm for k, w in weights.items()}
    counts = {k: int(v) for k, v in exact.items()}
    rest = sorted(weights, key=lambda k: (-(exact[k] - counts[k]), k))
    for k in rest[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


def parse_mix(options: dict[str, Any]) -> dict[str, float]:
    mix = options.get("mix", DEFAULT_MIX)
    if not isinstance(mix, dict) or not mix:
        raise DataError("domain.options.mix must be a mapping source -> share, e.g. {arith_add: 0.5, word: 0.5}")
    unknown = [k for k in mix if k not in OFFLINE_SOURCES]
    if unknown:
        raise DataError(f"domain.options.mix has unknown source(s) {unknown}; known: {', '.join(OFFLINE_SOURCES)}")
    try:
        mix = {k: float(v) for k, v in mix.items()}
    except (TypeError, ValueError):
        raise DataError(f"domain.options.mix shares must be numbers (got {mix})") from None
    if any(v < 0 for v in mix.values()) or sum(mix.values()) <= 0:
        raise DataError(f"domain.options.mix shares must be >= 0 with a positive sum (got {mix})")
    return {k: v for k, v in mix.items() if v > 0}


def offline_splits(sizes: dict[str, int], seed: int, options: dict[str, Any]) -> dict[str, list[Problem]]:
    """Every split gets the same source mix, drawn split by split in DEAL_ORDER.

    The generators' streams share one set of taken expressions (a word problem and an arith
    problem with the same product are one problem), so drawing test first is what keeps the test
    set independent of the sizes of the splits dealt after it.
    """
    mix = parse_mix(options)
    per_split = {split: allocate(sizes[split], mix) for split in DEAL_ORDER}
    taken: set[str] = set()
    gsm: list[Problem] = []
    if "gsm8k" in mix:
        gsm = sorted(load_gsm8k_vendored(), key=lambda p: shuffle_key(seed, p))
        needed = sum(per_split[s]["gsm8k"] for s in DEAL_ORDER)
        if needed > len(gsm):
            raise DataError(f"the offline GSM8K set has {len(gsm)} problems but the splits ask for "
                            f"{needed}; lower domain.options.mix.gsm8k or the split sizes")
        taken.update(content_key(p) for p in gsm)
    streams = {src: expression_stream(src, seed, taken) for src in GENERATED if src in mix}
    drawn = {src: 0 for src in mix}
    out: dict[str, list[Problem]] = {}
    for split in DEAL_ORDER:
        items: list[Problem] = []
        for src, count in per_split[split].items():
            if src == "gsm8k":
                items += gsm[drawn[src] : drawn[src] + count]
            else:
                items += take(streams[src], count, src, have=drawn[src])
            drawn[src] += count
        random.Random(f"whale-math:{seed}:{split}:order").shuffle(items)
        out[split] = items
    return {split: out[split] for split in SPLITS}


# ---------------------------------------------------------------------------------------------
# Real data: GSM8K, DAPO-Math-17k, AIME 2024/2025 from local files or the HF hub
# ---------------------------------------------------------------------------------------------

_HF_ID = re.compile(r"[\w.-]+/[\w.-]+")
_DAPO_PREFIX = re.compile(r"^.*?where \$Answer is the answer to the problem\.\s*", re.S)
_DAPO_SUFFIX = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$", re.S)


def read_rows(data_path: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows from a local .jsonl/.json/.parquet file or a folder of them, else an HF dataset id."""
    path = Path(data_path).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise DataError(f"no .jsonl, .json or .parquet files under {path}")
        return [row for f in files for row in read_rows(str(f), options)]
    if path.is_file():
        if path.suffix == ".jsonl":
            return read_jsonl(path)
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of rows")
            return data
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # not a dependency: only .parquet files need it

            return pq.read_table(path).to_pylist()
        raise DataError(f"{path}: unsupported file type (use .jsonl, .json or .parquet)")
    if path.suffix in (".jsonl", ".json", ".parquet", ".csv", ".gz") or not _HF_ID.fullmatch(data_path):
        raise DataError(f"domain.data_path '{data_path}' is neither a file, a folder nor an HF dataset id")
    try:
        import datasets  # optional extra: hub
    except ImportError:
        raise DataError(f"'{data_path}' is not a local path, and loading it from the HF hub needs "
                        "`pip install datasets`") from None
    ds = datasets.load_dataset(data_path, options.get("hf_config"), split=options.get("hf_split", "train"))
    return [dict(r) for r in ds]


def _gsm8k_answer(text: str) -> str:
    m = re.search(r"####\s*(.+?)\s*$", str(text))
    if m is None:
        raise DataError(f"GSM8K answer without a '#### N' line: {str(text)[-80:]!r}")
    return m.group(1).replace(",", "").replace("$", "").strip()


def row_to_problem(kind: str, row: dict[str, Any]) -> Problem:
    if kind == "gsm8k":
        return _problem("gsm8k", str(row["question"]).strip(), _gsm8k_answer(row["answer"]))
    if kind == "dapo":
        prompt = row.get("prompt")
        if isinstance(prompt, (list, tuple)):  # verl format: chat messages; take the user turn
            users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"] or list(prompt)
            prompt = users[-1]["content"]
        question = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", str(prompt))).strip()
        reward = row.get("reward_model") or {}
        answer = reward.get("ground_truth") if isinstance(reward, dict) else None
        if answer is None:
            answer = row.get("solution", row.get("answer"))
        if answer is None:
            raise DataError(f"DAPO row without reward_model.ground_truth or solution: {list(row)}")
        return _problem("dapo", question, str(answer).strip())
    if kind == "aime":
        question = row.get("problem", row.get("question"))
        if question is None or row.get("answer") is None:
            raise DataError(f"AIME row needs 'problem' (or 'question') and 'answer' fields: {list(row)}")
        year = row.get("year") or next(iter(re.findall(r"20\d\d", str(row.get("id", row.get("url", ""))))), "")
        source = f"aime{year}" if year else "aime"
        return _problem(source, str(question).strip(), str(row["answer"]).strip())
    raise DataError(f"unknown math source '{kind}'; choose offline, {', '.join(REAL_SOURCES)}")


def load_real(kind: str, data_path: str | None, options: dict[str, Any]) -> list[Problem]:
    if not data_path:
        raise DataError(f"domain.source={kind} needs domain.data_path (a local file/folder or an HF dataset id)")
    problems = []
    for row in read_rows(data_path, options):
        try:
            problems.append(row_to_problem(kind, row))
        except (KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{data_path}: a row does not look like {kind} data ({type(e).__name__}: {e}); "
                            f"fields: {sorted(row) if isinstance(row, dict) else type(row).__name__}") from None
    if not problems:
        raise DataError(f"no problems found in {data_path}")
    return problems


def _dedupe_sorted(problems: Iterable[Problem], seed: int, exclude: set[str]) -> list[Problem]:
    unique: dict[str, Problem] = {}
    for p in problems:
        key = content_key(p)
        if key not in exclude:
            unique.setdefault(key, p)
    return sorted(unique.values(), key=lambda p: shuffle_key(seed, p))


def real_splits(kind: str, data_path: str | None, sizes: dict[str, int], seed: int,
                options: dict[str, Any]) -> dict[str, list[Problem]]:
    """All four splits from one data set, or val+test from `options.eval_path` (e.g. AIME, as in the paper)."""
    main = load_real(kind, data_path, options)
    groups: list[tuple[list[Problem], tuple[str, ...], str]] = []
    eval_path = options.get("eval_path")
    exclude: set[str] = set()
    if eval_path:
        eval_kind = options.get("eval_source", "aime")
        held_out = _dedupe_sorted(load_real(eval_kind, eval_path, options), seed, set())
        exclude = {content_key(p) for p in held_out}
        groups.append((held_out, ("test", "val"), f"{eval_kind} data at {eval_path}"))
        groups.append((_dedupe_sorted(main, seed, exclude), ("harness", "weight"), f"{kind} data at {data_path}"))
    else:
        groups.append((_dedupe_sorted(main, seed, exclude), DEAL_ORDER, f"{kind} data at {data_path}"))
    out: dict[str, list[Problem]] = {}
    for pool, names, where in groups:
        needed = sum(sizes[n] for n in names)
        if needed > len(pool):
            raise DataError(f"{where} has {len(pool)} distinct problems but splits {'+'.join(names)} "
                            f"ask for {needed}; lower domain.splits")
        start = 0
        for n in names:
            out[n] = pool[start : start + sizes[n]]
            start += sizes[n]
    return {split: out[split] for split in SPLITS}
