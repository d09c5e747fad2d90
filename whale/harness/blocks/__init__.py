"""Harness code that the mutation proposer (harness/mutation.py) splices into candidates.

Each block is plain harness code (standard library only, the harness contract). `__INNER__` is
replaced by the name of the renamed parent `run`, `__NAME__` by the name of a replaced base run.
Wrappers change one mechanism each and hand everything else through, so they compose. The blocks
here are domain-general; a domain's own blocks live with its hints (whale/domains/<name>/).
"""

from whale.harness.blocks.common import HELPERS, HELPERS_MARK, MAJORITY_VOTE, SYSTEM_PROMPTS
from whale.harness.blocks.generic import (
    ANSWER_EXTRACTION,
    ANSWER_LINE_STOP,
    ANSWER_PREFILL,
    ANSWER_TRIM,
    CONSTRAINED_ANSWER,
    FEW_SHOT,
    FORMAT_REPAIR,
    MORE_TOKENS,
)

__all__ = [
    "ANSWER_EXTRACTION",
    "ANSWER_LINE_STOP",
    "ANSWER_PREFILL",
    "ANSWER_TRIM",
    "CONSTRAINED_ANSWER",
    "FEW_SHOT",
    "FORMAT_REPAIR",
    "HELPERS",
    "HELPERS_MARK",
    "MAJORITY_VOTE",
    "MORE_TOKENS",
    "SYSTEM_PROMPTS",
]
