"""Hypothesis: Choosing among env.legal_moves with llm(..., choices=...) makes every move legal and draws it from the model's own preferences.
Mechanism: constrained_choice
Parent: h0

Base harness h0 for chess: the paper's plain move loop.

Shows the position as FEN, asks for exactly one move as <move>uci</move>, and plays it. Per move it
allows one format retry (no well-formed <move> tag) and one illegal-move retry; at most 9 model
calls per episode. No legal-move list, no engine: parsing, format and legality handling only.
"""

import re

SYSTEM_PROMPT = "You are a chess player solving a tactics puzzle."
USER_PROMPT = (
    "Position (FEN): {fen}\n{side} to move.\n"
    "Reply with exactly one move in UCI notation inside tags, for example <move>e2e4</move>."
)
NEXT_PROMPT = (
    "Correct. Your opponent replied {opponent}.\nPosition (FEN): {fen}\n{side} to move.\n"
    "Reply with exactly one move as <move>uci</move>."
)
FORMAT_RETRY = "I could not read a move. Reply with exactly one move as <move>uci</move>, for example <move>e2e4</move>."
ILLEGAL_RETRY = "{move} is not a legal move in this position. Reply with exactly one legal move as <move>uci</move>."
MAX_TURNS = 9

MOVE_TAG = re.compile(r"<move>\s*([^<]*?)\s*</move>", re.S)
UCI = re.compile(r"[a-h][1-8][a-h][1-8][qrbn]?")


def side_to_move(fen):
    return "White" if fen.split()[1] == "w" else "Black"


def parse_move(text):
    """The first <move>...</move> whose content is a UCI move, else None (a format error)."""
    for content in MOVE_TAG.findall(text):
        content = content.strip().lower()
        if UCI.fullmatch(content):
            return content
    return None


def _run_before_constrained_choice(env, llm):
    messages = []
    if SYSTEM_PROMPT:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": USER_PROMPT.format(fen=env.fen, side=side_to_move(env.fen))})
    format_retry, illegal_retry = 1, 1
    for _ in range(MAX_TURNS):
        if env.done:
            return
        try:
            reply = llm(messages)
        except Exception:  # a budget ran out: the moves played so far are the answer
            return
        messages.append({"role": "assistant", "content": str(reply)})
        move = parse_move(reply)
        if move is None:
            if format_retry == 0:
                return
            format_retry -= 1
            messages.append({"role": "user", "content": FORMAT_RETRY})
            continue
        result = env.move(move)
        if result["done"]:
            return
        if result["error"]:
            if illegal_retry == 0:
                return
            illegal_retry -= 1
            messages.append({"role": "user", "content": ILLEGAL_RETRY.format(move=move)})
            continue
        format_retry, illegal_retry = 1, 1
        fen = result["fen"]
        messages.append({"role": "user", "content": NEXT_PROMPT.format(
            opponent=result["opponent_move"], fen=fen, side=side_to_move(fen))})


# --- mutation helpers ---
class _MutText(str):
    """A str with the attributes of a Completion, for replies a wrapper builds itself."""

    def __new__(cls, text, finish_reason="stop"):
        obj = super().__new__(cls, text)
        obj.finish_reason = finish_reason
        obj.tool_calls = None
        obj.usage = {}
        return obj


def _mut_add_to_user(messages, text, first=False):
    """A copy of `messages` with `text` appended to the first or the last user message."""
    out = [dict(m) for m in messages]
    users = [i for i, m in enumerate(out) if m.get("role") == "user"]
    if not users:
        return out + [{"role": "user", "content": text}]
    i = users[0] if first else users[-1]
    out[i]["content"] = str(out[i].get("content") or "") + "\n\n" + text
    return out


def _mut_balanced(text):
    """`text` up to the brace that closes one opened before it."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                return text[:i]
            depth -= 1
    return text


def _mut_answer_key(text):
    """What a vote compares: the last <answer>, <move> or boxed content, else the normalized text."""
    text = str(text)
    for pattern in (r"<answer>(.*?)(?:</answer>|$)", r"<move>\s*(.*?)\s*</move>"):
        found = re.findall(pattern, text, re.S)
        if found:
            return " ".join(found[-1].lower().split())
    at = text.rfind("\\boxed{")
    if at >= 0:
        return " ".join(_mut_balanced(text[at + 7:]).split())
    return " ".join(text.lower().split())


# --- mutation: constrained_choice ---
def run(env, llm):
    def choosing_llm(messages, **kw):
        legal = [] if env.done else list(env.legal_moves or [])
        if not legal or kw.get("choices") or kw.get("tools") or kw.get("n", 1) != 1:
            return llm(messages, **kw)
        msgs = list(messages)
        if msgs[-1].get("role") != "assistant":
            msgs.append({"role": "assistant", "content": "<move>"})
        move = llm(msgs, choices=legal, template_kwargs=kw.get("template_kwargs"))
        return _MutText("<move>" + str(move) + "</move>", "choice")

    return _run_before_constrained_choice(env, choosing_llm)
