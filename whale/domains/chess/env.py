"""The chess episode: the solver plays moves, the environment answers with the puzzle's replies."""

from __future__ import annotations

from typing import Any

import chess

from whale.domains.base import EpisodeEnv, Problem
from whale.domains.chess.data import question_text
from whale.domains.chess.grading import parse_move


class ChessEnv(EpisodeEnv):
    """`env.move(uci_or_san) -> dict(done, fen, legal_moves, opponent_move, error, solved)`.

    An illegal or unparsable move is refused (error set, position unchanged) and counts against
    `invalid_moves`; one refusal beyond that ends the episode. A legal wrong move ends it. A
    correct move (or any checkmate) advances, and the environment plays the opponent's reply.
    The graded answer is the solver's legal moves in UCI (`final_answer`); no submit is needed.
    Public state never includes the solution line.
    """

    tools = ("move",)

    def __init__(self, problem: Problem, invalid_moves: int = 3):
        super().__init__(problem)
        self._line: list[str] = list(problem.answer)
        self.board = chess.Board(problem.meta["fen"])
        self.board.push(chess.Move.from_uci(self._line[0]))
        self._idx = 1  # index in the line of the solver's next expected move
        self._start_question = question_text(self.board, self._line[0])
        self.invalid_budget = invalid_moves
        self.invalid = 0
        self.played: list[str] = []
        self.solved = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def legal_moves(self) -> list[str]:
        return sorted(m.uci() for m in self.board.legal_moves)

    def public_state(self) -> dict[str, Any]:
        return {"question": self._start_question, "fen": self.board.fen(),
                "legal_moves": [] if self._done else self.legal_moves(), "done": self._done}

    def _result(self, opponent_move: str | None = None, error: str | None = None) -> dict[str, Any]:
        return {"done": self._done, "fen": self.board.fen(),
                "legal_moves": [] if self._done else self.legal_moves(),
                "opponent_move": opponent_move, "error": error, "solved": self.solved}

    def move(self, uci: str) -> dict[str, Any]:
        if self._done:
            return self._result(error="the episode is over; no more moves are accepted")
        move = parse_move(self.board, uci) if isinstance(uci, str) else None
        if move is None:
            self.invalid += 1
            left = self.invalid_budget - self.invalid
            if left < 0:
                self._done = True
                return self._result(error=f"illegal or unparsable move {uci!r}; too many invalid moves, episode over")
            return self._result(error=f"illegal or unparsable move {uci!r} in this position "
                                      f"(use UCI like e2e4; {left} more invalid move(s) allowed)")
        self.board.push(move)
        self.played.append(move.uci())
        if self.board.is_checkmate() or (move.uci() == self._line[self._idx] and self._idx + 1 >= len(self._line)):
            self.solved = True
            self._done = True
            return self._result()
        if move.uci() != self._line[self._idx]:
            self._done = True  # a legal but wrong move ends the puzzle, as on Lichess
            return self._result()
        reply = self._line[self._idx + 1]
        self.board.push(chess.Move.from_uci(reply))
        self._idx += 2
        return self._result(opponent_move=reply)

    def final_answer(self) -> str:
        return " ".join(self.played)
