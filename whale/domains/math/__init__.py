"""The math domain: see domain.py (MathDomain), data.py (sources and splits), grading.py (verifier)."""

from whale.domains.math.domain import MathDomain

__all__ = ["MathDomain"]
