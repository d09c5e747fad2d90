"""Chess's hints: what we learned about tactics puzzles, declared for the harness search.

Used only with `harness.domain_hints: on` (the default, so the published chess runs repeat); shown
in the archive and the report as "hint: <name>". Mechanisms splice the blocks of hint_blocks.py.
"""

from __future__ import annotations

from typing import Any

from whale.domains.chess import hint_blocks as B
from whale.harness.mechanism import REWRITE_FIXES, Hints, Mutation, append_user_prompt, rewrite_system_prompt, wrap

SYSTEM_PROMPTS = (
    "You are a chess grandmaster solving a tactics puzzle. Look for checks, captures and threats, in "
    "that order, and answer with exactly one move in UCI notation inside <move></move>.",
    "You solve chess puzzles. The solution is forcing: consider every check first, then captures. "
    "Reply with one move as <move>uci</move>, for example <move>e2e4</move>.",
)

TEXT = """\
What helps a small model here: showing `env.legal_moves` (or choosing among them with
llm(..., choices=...)), annotating moves with checks, captures and mates, and re-choosing right
away after a refused move."""

MECHANISMS = (
    Mutation("system_prompt_rewrite_chess", "A system prompt that states the strategy and the answer format "
             "keeps a small model on task.", rewrite_system_prompt(SYSTEM_PROMPTS), prompt_only=True,
             fixes=REWRITE_FIXES, hint=True, replaces=("system_prompt_rewrite",)),
    Mutation("legal_move_list", "Free-text moves are often illegal; listing the legal moves lets the "
             "model copy one.", wrap("legal_move_list", B.LEGAL_MOVE_LIST), conflicts=("annotate_moves",),
             fixes=("illegal_move", "unused_tool", "no_submission"), hint=True),
    Mutation("annotate_moves", "Tactics start with checks, captures and mates; annotating each legal "
             "move with them (computed from the FEN) points the model at the forcing moves.",
             wrap("annotate_moves", B.ANNOTATE_MOVES), conflicts=("legal_move_list",),
             fixes=("wrong_answer", "illegal_move"), hint=True),
    Mutation("constrained_choice", "Choosing among env.legal_moves with llm(..., choices=...) makes "
             "every move legal and draws it from the model's own preferences.",
             wrap("constrained_choice", B.CONSTRAINED_CHOICE),
             fixes=("illegal_move", "unused_tool", "no_submission", "length_cutoff"), keeps_layout=True, hint=True),
    Mutation("illegal_retry", "A refused move wastes a turn; re-choosing among the legal moves right "
             "away keeps the line going.", wrap("illegal_retry", B.ILLEGAL_RETRY),
             fixes=("illegal_move", "tool_error"), keeps_layout=True, hint=True),
    Mutation("chess_hint", "Reminding the model to look for checks and captures first focuses it on "
             "forcing moves.", append_user_prompt(B.CHESS_HINT), prompt_only=True, fixes=("wrong_answer",),
             hint=True),
)

MODES = {"illegal_move": "a move was refused as illegal or unparsable"}


def episode_modes(row: dict[str, Any], tools: list[dict], answer: str | None) -> list[str]:
    illegal = any(isinstance(t.get("result"), dict) and "illegal" in str(t["result"].get("error") or "")
                  for t in tools if t.get("name") == "move")
    return ["illegal_move"] if illegal else []


HINTS = Hints(mechanisms=MECHANISMS, modes=MODES, episode_modes=episode_modes, main_tool="move", text=TEXT)
