"""ChessDomain: Lichess puzzle splits, the move environment, the full-line grader and h0."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from whale.config import Config, ConfigError
from whale.domains.base import DataError, Problem, Setting, refuse_unread_settings, split_sizes
from whale.domains.chess import data
from whale.domains.chess.env import ChessEnv
from whale.domains.chess.grading import grade_chess
from whale.domains.chess.hints import HINTS

SOURCES = ("offline", "lichess")

BRIEF = """\
Domain: Lichess chess puzzles ({slice_note}).
Episode: the opponent has just moved; you play the solution line move by move.
Readable state (refreshed after every tool call): env.question (str: FEN, side to move, the
opponent's last move), env.fen (str, current position), env.legal_moves (sorted list of legal
UCI moves, e.g. "e2e4", "e7e8q"), env.done (bool).
Tool: env.move(move: str) -> dict(done, fen, legal_moves, opponent_move, error, solved).
  - UCI or SAN is accepted. An illegal or unparsable move is refused (error set, position
    unchanged, episode goes on) and counts against a budget of {invalid} refusals; one more ends
    the episode.
  - A legal but wrong move ends the episode (reward 0).
  - A correct move advances: the environment plays the opponent's reply (opponent_move) and you
    move again, until the line ends (solved=True). Any checkmating move solves the puzzle.
No submit is needed: the moves played are the answer.
Grading: 1 iff the whole solution line is played (or a checkmate is delivered), else 0.
Puzzles: {plies} solver plies; per-source labels {sources}.
What helps a small model: choosing among env.legal_moves instead of free text (llm(...,
choices=[...]) samples exactly one of them), annotating moves that give check/mate or capture.
"""


GRADERS = ("default", "line")
LICHESS = "domain.source: lichess"


def _lichess(d) -> bool:
    return d.source == "lichess"


FIELDS = {
    "data_path": Setting("the Lichess puzzle CSV/parquet or an HF dataset id", LICHESS, _lichess),
    "budget.invalid_moves": Setting("refused moves before the episode ends"),
}
OPTIONS = {
    "slice": Setting("mateIn1 | easy (offline default: mate-in-1 first, then mate-in-2, then low-rated) | "
                     "all (lichess default)"),
    "max_rating": Setting("drop puzzles rated above this"),
    "min_rating": Setting("drop puzzles rated below this"),
    "easy_rating": Setting("easy slice: other puzzles up to this rating (default 1200)", "domain.options.slice: easy",
                           lambda d: d.options.get("slice", "easy" if d.source == "offline" else "all") == "easy"),
    "max_plies": Setting("most solution plies, counting both sides after the first move (default 9, as in the paper)"),
    "themes": Setting("keep puzzles with any of these Lichess themes (a name or a list)"),
    "hf_split": Setting("HF dataset split (default train)", LICHESS, _lichess),
    "hf_revision": Setting("HF dataset revision; pin it, the schema changed between versions", LICHESS, _lichess),
}


class ChessDomain:
    """The `chess` domain. Offline: 2,953 vendored CC0 Lichess puzzles; real: the Lichess CSV/HF data.

    domain.options: see OPTIONS.
    """

    name = "chess"
    answer_format = None  # graded on the moves played, not on a text answer
    hints = HINTS

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.options: dict[str, Any] = dict(cfg.domain.options)
        self.source = cfg.domain.source
        if self.source not in SOURCES:
            raise DataError(f"chess: unknown domain.source '{self.source}'; choose offline or lichess")
        if cfg.domain.grader not in GRADERS:
            raise ConfigError(f"chess: domain.grader must be one of {list(GRADERS)} (got {cfg.domain.grader!r})")
        refuse_unread_settings("chess", cfg.domain, FIELDS, OPTIONS)
        default_slice = "easy" if self.source == "offline" else "all"
        self.filter = data.PuzzleFilter(self.options, default_slice)
        slice_note = {"mateIn1": "mate-in-1 only", "easy": "easy slice: mate-in-1 first, then mate-in-2, "
                      "then low-rated", "all": "all puzzles"}[self.filter.slice]
        self.brief = BRIEF.format(slice_note=slice_note, invalid=cfg.domain.budget.invalid_moves,
                                  plies=f"1-{self.filter.max_plies}",
                                  sources="mateIn1, mateIn2, mateIn3, mateIn4, other")
        self._splits: dict[str, list[Problem]] | None = None

    def load_splits(self) -> dict[str, list[Problem]]:
        if self._splits is None:
            sizes = split_sizes(self.cfg.domain.splits)
            if self.source == "offline":
                records, where = data.iter_vendored(), "the offline puzzle set"
            else:
                if not self.cfg.domain.data_path:
                    raise DataError("chess: domain.source=lichess needs domain.data_path (the Lichess puzzle "
                                    "CSV, .csv.gz, .csv.zst, parquet, or the HF id Lichess/chess-puzzles)")
                records = data.iter_lichess(self.cfg.domain.data_path, self.options)
                where = f"the puzzles at {self.cfg.domain.data_path}"
            self._splits = data.build_splits(records, sizes, self.cfg.seed, self.filter, where)
        return self._splits

    def make_env(self, problem: Problem) -> ChessEnv:
        return ChessEnv(problem, invalid_moves=self.cfg.domain.budget.invalid_moves)

    def grade(self, problem: Problem, answer: str | None) -> float:
        return grade_chess(problem, answer)

    def grader(self) -> Callable[[Problem, str | None], float]:
        """A picklable grader (a module-level function) for worker processes."""
        return grade_chess

    def base_harness(self) -> str:
        return Path(__file__).with_name("h0.py").read_text(encoding="utf-8")
