"""Chess puzzles: 2,953 vendored CC0 Lichess puzzles, or the Lichess CSV / HF mirror for real runs.

Lichess semantics: `fen` is the position BEFORE the opponent's move; `moves[0]` (UCI) is that
move, the solver then plays moves[1], moves[3], ... and the opponent answers with moves[2], ...

Slices (domain.options.slice): "mateIn1" only mate-in-1; "easy" (offline default) mate-in-1
first, then mate-in-2, then other puzzles rated <= easy_rating (1200) — taken in that order until
the splits are full, so the default sizes are all mate-in-1, the only tactic a 135M model shows
any skill at (docs/domains.md); "all" every puzzle. `max_rating`, `min_rating`,
`themes` (any-of) and `max_plies` (solution plies, default 9 as in the paper) filter further.

Splits are disjoint by position, deterministic from the seed, and dealt test first. A position
is any one the solver faces along the line (after moves[0], moves[2], ...; board, side, castling,
en passant): a puzzle that starts where another one's line passes is the same exercise from its
second move, so puzzles sharing a solver position (transitively) form one group, dealt whole.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import heapq
import io
import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import chess

from whale.domains.base import DEAL_ORDER, SPLITS, DataError, Problem, content_groups, deal_groups

PUZZLE_FILE = Path(__file__).with_name("puzzles.jsonl")
SLICES = ("mateIn1", "easy", "all")
MATE_THEMES = ("mateIn1", "mateIn2", "mateIn3", "mateIn4", "mateIn5")


def puzzle_source(themes: Iterable[str]) -> str:
    """Per-source breakdown label: the mate-in-N theme, or "other"."""
    themes = set(themes)
    return next((t for t in MATE_THEMES if t in themes), "other")


def position_after_first_move(fen: str, moves: list[str]) -> chess.Board:
    board = chess.Board(fen)
    board.push(chess.Move.from_uci(moves[0]))
    return board


def question_text(board: chess.Board, opponent_move: str) -> str:
    side = "White" if board.turn == chess.WHITE else "Black"
    return (f"Chess puzzle. Position (FEN): {board.fen()}\n{side} to move. "
            f"Your opponent just played {opponent_move}. Find the best move.")


def make_problem(pid: str, fen: str, moves: list[str], rating: int, themes: list[str]) -> Problem:
    """A Problem whose gold (`answer`) is the UCI line and `meta["fen"]` the position before moves[0].

    The question shows the position after moves[0], as Lichess does.
    """
    if len(moves) < 2:
        raise DataError(f"puzzle {pid}: needs the opponent's move and at least one solution move")
    try:
        board = position_after_first_move(fen, moves)
    except ValueError as e:  # python-chess's invalid FEN / move errors are ValueErrors
        raise DataError(f"puzzle {pid}: cannot apply the first move {moves[0]!r} to {fen!r} ({e})") from None
    return Problem(
        id=f"lichess-{pid}",
        question=question_text(board, moves[0]),
        answer=list(moves),  # gold: the whole Lichess line, moves[0] being the opponent's move
        source=puzzle_source(themes),
        meta={"fen": fen, "rating": int(rating), "themes": list(themes), "plies": len(moves) - 1},
    )


def _row_to_record(row: dict[str, Any]) -> dict[str, Any]:
    """Vendored rows (id/fen/moves/rating/themes) and Lichess CSV rows (PuzzleId/FEN/Moves/...)."""
    def get(*names: str) -> Any:
        return next((row[n] for n in names if row.get(n) is not None), None)

    pid, fen, moves = get("id", "PuzzleId"), get("fen", "FEN"), get("moves", "Moves")
    if pid is None or fen is None or moves is None:
        raise DataError(f"puzzle row needs PuzzleId/FEN/Moves (or id/fen/moves); got fields {sorted(row)}")
    themes = get("themes", "Themes") or ""
    moves = moves.split() if isinstance(moves, str) else list(moves)
    themes = themes.split() if isinstance(themes, str) else list(themes)
    rating = get("rating", "Rating")
    try:
        rating = int(float(rating)) if rating not in (None, "") else 0
    except (TypeError, ValueError):
        raise DataError(f"puzzle {pid}: rating {rating!r} is not a number") from None
    return {"id": str(pid), "fen": str(fen).strip(), "moves": moves, "themes": themes, "rating": rating}


def name_looks_like_file(data_path: str) -> bool:
    return data_path.endswith((".csv", ".gz", ".zst", ".parquet", ".jsonl", ".json"))


def iter_vendored() -> Iterator[dict[str, Any]]:
    for line in PUZZLE_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if "id" in row:
                yield _row_to_record(row)


def iter_lichess(data_path: str, options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Rows of the Lichess puzzle CSV (.csv, .csv.gz, .csv.zst), a parquet file, or HF `Lichess/chess-puzzles`."""
    path = Path(data_path).expanduser()
    if path.is_file():
        name = path.name
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq  # not a dependency: only .parquet files need it

            for batch in pq.ParquetFile(path).iter_batches(batch_size=65536):
                yield from (_row_to_record(r) for r in batch.to_pylist())
            return
        if name.endswith(".csv.gz"):
            text = io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
        elif name.endswith(".csv.zst"):
            try:
                import zstandard  # not a dependency: only .csv.zst files need it
            except ImportError:
                raise DataError(f"{path} is zstd-compressed; `pip install zstandard` or decompress it "
                                "(zstd -d) first") from None
            raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
            text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        elif name.endswith(".csv"):
            text = open(path, encoding="utf-8", newline="")
        else:
            raise DataError(f"{path}: unsupported puzzle file (use .csv, .csv.gz, .csv.zst or .parquet)")
        with text:
            reader = csv.DictReader(text)
            if not reader.fieldnames or "FEN" not in reader.fieldnames or "Moves" not in reader.fieldnames:
                raise DataError(f"{path}: expected the Lichess header PuzzleId,FEN,Moves,Rating,...; "
                                f"got {reader.fieldnames}")
            yield from (_row_to_record(r) for r in reader)
        return
    if path.is_dir():
        raise DataError(f"{path} is a folder; point domain.data_path at the puzzle CSV or parquet file")
    if not name_looks_like_file(data_path) and re.fullmatch(r"[\w.-]+/[\w.-]+", data_path):
        try:
            import datasets  # optional extra: hub
        except ImportError:
            raise DataError(f"'{data_path}' is not a local file, and loading it from the HF hub needs "
                            "`pip install datasets`") from None
        ds = datasets.load_dataset(data_path, split=options.get("hf_split", "train"),
                                   revision=options.get("hf_revision"), streaming=True)
        yield from (_row_to_record(dict(r)) for r in ds)
        return
    raise DataError(f"domain.data_path '{data_path}' is neither a puzzle file nor an HF dataset id")


class PuzzleFilter:
    """The slice and filters from domain.options, with one clear error for a bad value."""

    def __init__(self, options: dict[str, Any], default_slice: str):
        self.slice = options.get("slice", default_slice)
        if self.slice not in SLICES:
            raise DataError(f"domain.options.slice must be one of {', '.join(SLICES)} (got {self.slice!r})")
        try:
            self.max_rating = int(options["max_rating"]) if options.get("max_rating") is not None else None
            self.min_rating = int(options["min_rating"]) if options.get("min_rating") is not None else None
            self.easy_rating = int(options.get("easy_rating", 1200))
            self.max_plies = int(options.get("max_plies", 9))
        except (TypeError, ValueError):
            raise DataError("domain.options max_rating/min_rating/easy_rating/max_plies must be integers") from None
        themes = options.get("themes")
        self.themes = set([themes] if isinstance(themes, str) else themes or [])

    def tier(self, rec: dict[str, Any]) -> int | None:
        """None: excluded; otherwise the priority tier (lower fills the splits first)."""
        plies = len(rec["moves"]) - 1
        themes = set(rec["themes"])
        if not 1 <= plies <= self.max_plies:
            return None
        if self.max_rating is not None and rec["rating"] > self.max_rating:
            return None
        if self.min_rating is not None and rec["rating"] < self.min_rating:
            return None
        if self.themes and not (self.themes & themes):
            return None
        if self.slice == "all":
            return 0
        if "mateIn1" in themes:
            return 0
        if self.slice == "mateIn1":
            return None
        if "mateIn2" in themes:
            return 1
        return 2 if rec["rating"] <= self.easy_rating else None


def position_key(seed: int, fen: str) -> int:
    """Seeded hash of the position (board, side, castling, en passant; not the move counters)."""
    digest = hashlib.sha256(f"{seed}\x00{' '.join(fen.split()[:4])}".encode()).hexdigest()
    return int(digest[:16], 16)


def select(records: Iterable[dict[str, Any]], filt: PuzzleFilter, total: int, seed: int) -> list[dict]:
    """The `total` eligible puzzles with the smallest (tier, seeded position hash), each position once.

    Streams through a bounded heap, so a 4M-row Lichess CSV needs memory for `total` puzzles only.
    The result is sorted by position hash (tiers mixed).
    """
    heap: list[tuple[int, int, dict]] = []  # (-tier, -key, record): the root is the worst kept puzzle
    kept: set[int] = set()
    for rec in records:
        tier = filt.tier(rec)
        if tier is None or total == 0:
            continue
        key = position_key(seed, rec["fen"])
        if key in kept:  # the same position twice: keep the first
            continue
        item = (-tier, -key, rec)
        if len(heap) < total:
            heapq.heappush(heap, item)
            kept.add(key)
        elif item[:2] > heap[0][:2]:
            dropped = heapq.heapreplace(heap, item)
            kept.discard(-dropped[1])
            kept.add(key)
    return [rec for _, _, rec in sorted(heap, key=lambda it: -it[1])]


def solver_positions(rec: dict[str, Any]) -> list[str]:
    """The positions the solver moves in (move counters dropped); a move that does not apply ends the list."""
    board, out = chess.Board(rec["fen"]), []
    for i, uci in enumerate(rec["moves"]):
        try:
            board.push_uci(uci)
        except ValueError:
            break
        if i % 2 == 0:
            out.append(" ".join(board.fen().split()[:4]))
    return out


def build_splits(records: Iterable[dict[str, Any]], sizes: dict[str, int], seed: int,
                 filt: PuzzleFilter, where: str) -> dict[str, list[Problem]]:
    total = sum(sizes.values())
    chosen = select(records, filt, total, seed)
    if len(chosen) < total:
        raise DataError(f"{where}: only {len(chosen)} distinct puzzles match slice={filt.slice!r} and the "
                        f"rating/theme/ply filters, but the splits ask for {total}; lower domain.splits "
                        "or widen domain.options (slice: all, max_rating)")
    # `chosen` is in seeded hash order with the tiers mixed; dealing test first keeps the test set
    # unchanged when only the weight split grows (unless that pulls in puzzles of a later tier).
    groups = content_groups(chosen, solver_positions)
    dealt = deal_groups(groups, sizes, DEAL_ORDER, where)
    return {split: [make_problem(r["id"], r["fen"], r["moves"], r["rating"], r["themes"]) for r in dealt[split]]
            for split in SPLITS}
