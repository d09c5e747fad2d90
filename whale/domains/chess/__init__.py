"""The chess domain: see domain.py (ChessDomain), data.py (puzzles and splits), grading.py (verifier)."""

from whale.domains.chess.domain import ChessDomain

__all__ = ["ChessDomain"]
