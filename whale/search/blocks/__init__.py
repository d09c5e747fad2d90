"""Harness code that the mutation proposer (search/mutation.py) splices into candidates, one module
per domain.

Each block is plain harness code (standard library only, contract of DESIGN §4). `__INNER__` is
replaced by the name of the renamed parent `run`, `__NAME__` by the name of a replaced base run.
Wrappers change one mechanism each and hand everything else through, so they compose.
"""

from whale.search.blocks.chess import (
    ANNOTATE_MOVES,
    CHESS_HINT,
    CONSTRAINED_CHOICE,
    ILLEGAL_RETRY,
    LEGAL_MOVE_LIST,
)
from whale.search.blocks.common import (
    HELPERS,
    HELPERS_MARK,
    MAJORITY_VOTE,
    SYSTEM_PROMPTS,
)
from whale.search.blocks.math import (
    BOXED_REMINDER,
    PYTHON_FIRST,
    RETRY_PARSE,
    SELF_CHECK,
)
from whale.search.blocks.searchqa import (
    ANSWER_FIRST_LINE,
    FORCE_RETRIEVAL,
    MORE_PASSAGES,
    QUERY_REWRITE,
    QUESTION_AS_QUERY,
    RERANK_PASSAGES,
    RETRIEVED_TITLES,
    SEARCH_TURNS_RUN,
    SEARCHQA_REMINDER,
)

__all__ = [
    "ANNOTATE_MOVES",
    "ANSWER_FIRST_LINE",
    "BOXED_REMINDER",
    "CHESS_HINT",
    "CONSTRAINED_CHOICE",
    "FORCE_RETRIEVAL",
    "HELPERS",
    "HELPERS_MARK",
    "ILLEGAL_RETRY",
    "LEGAL_MOVE_LIST",
    "MAJORITY_VOTE",
    "MORE_PASSAGES",
    "PYTHON_FIRST",
    "QUERY_REWRITE",
    "QUESTION_AS_QUERY",
    "RERANK_PASSAGES",
    "RETRIEVED_TITLES",
    "RETRY_PARSE",
    "SEARCHQA_REMINDER",
    "SEARCH_TURNS_RUN",
    "SELF_CHECK",
    "SYSTEM_PROMPTS",
]
