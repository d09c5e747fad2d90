"""Chess verifier: replay the moves played against the puzzle line (full-line rule).

Reward 1.0 iff the solver plays the whole solution; a different move that checkmates solves the
puzzle at that point (Lichess accepts any mate). The opponent's replies come from the puzzle, so
the answer string holds only the solver's moves. Anything else (wrong, illegal, unparsable, too
short) scores 0. Used by the parent on what the environment recorded; never raises.
"""

from __future__ import annotations

from typing import Any

import chess


def parse_move(board: chess.Board, text: str) -> chess.Move | None:
    """A legal move from UCI (e2e4, e7e8q) or SAN (Nf3, exd5, O-O, Qxf7#), else None."""
    text = str(text).strip()
    if not text:
        return None
    try:
        move = chess.Move.from_uci(text.lower() if len(text) in (4, 5) else text)
        if move in board.legal_moves:
            return move
    except ValueError:
        pass
    try:
        move = board.parse_san(text)
    except ValueError:  # IllegalMoveError, InvalidMoveError, AmbiguousMoveError are ValueErrors
        return None
    return move if move and move in board.legal_moves else None  # refuse the null move "--"


def replay(fen: str, line: list[str], played: list[str]) -> float:
    board = chess.Board(fen)
    board.push(chess.Move.from_uci(line[0]))
    idx = 1  # index in `line` of the solver's next expected move
    for text in played:
        move = parse_move(board, text)
        if move is None:
            return 0.0
        board.push(move)
        if board.is_checkmate():
            return 1.0
        if move.uci() != line[idx]:
            return 0.0
        if idx + 1 >= len(line):
            return 1.0
        board.push(chess.Move.from_uci(line[idx + 1]))
        idx += 2
    return 0.0


def grade_chess(problem: Any, answer: Any) -> float:
    """Module-level (picklable) grader: `answer` is the space-separated moves the solver played."""
    try:
        if answer is None:
            return 0.0
        return replay(problem.meta["fen"], list(problem.answer), str(answer).split())
    except Exception:
        return 0.0
