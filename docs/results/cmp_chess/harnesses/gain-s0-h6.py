"""Hypothesis: Tactics start with checks, captures and mates; annotating each legal move with them (computed from the FEN) points the model at the forcing moves.
Mechanism: hint: annotate_moves
Parent: h1

Earlier hypothesis: Choosing among env.legal_moves with llm(..., choices=...) makes every move legal and draws it from the model's own preferences.
Earlier mechanism: hint: constrained_choice
Earlier parent: h0

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
def _run_before_annotate_moves(env, llm):
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


# --- mutation: annotate_moves ---
_AM_ROOK = ((1, 0), (-1, 0), (0, 1), (0, -1))
_AM_BISHOP = ((1, 1), (1, -1), (-1, 1), (-1, -1))
_AM_LINES = {"r": _AM_ROOK, "b": _AM_BISHOP, "q": _AM_ROOK + _AM_BISHOP}
_AM_KNIGHT = ((1, 2), (2, 1), (-1, 2), (-2, 1), (1, -2), (2, -1), (-1, -2), (-2, -1))
_AM_KING = _AM_ROOK + _AM_BISHOP


def _am_board(fen):
    """{(file, rank): piece letter} from the FEN's placement field (uppercase = White)."""
    board = {}
    for r, row in enumerate(fen.split()[0].split("/")):
        f = 0
        for ch in row:
            if ch.isdigit():
                f += int(ch)
            else:
                board[(f, 7 - r)] = ch
                f += 1
    return board


def _am_attacked(board, sq, by_white):
    """Is square `sq` attacked by a piece of the given colour?"""
    x, y = sq

    def own(p, kinds):
        return p is not None and p.isupper() == by_white and p.lower() in kinds

    back = -1 if by_white else 1
    if own(board.get((x - 1, y + back)), "p") or own(board.get((x + 1, y + back)), "p"):
        return True
    if any(own(board.get((x + dx, y + dy)), "n") for dx, dy in _AM_KNIGHT):
        return True
    if any(own(board.get((x + dx, y + dy)), "k") for dx, dy in _AM_KING):
        return True
    for kind, kinds in (("r", "rq"), ("b", "bq")):
        for dx, dy in _AM_LINES[kind]:
            cx, cy = x + dx, y + dy
            while 0 <= cx < 8 and 0 <= cy < 8:
                p = board.get((cx, cy))
                if p is not None:
                    if own(p, kinds):
                        return True
                    break
                cx, cy = cx + dx, cy + dy
    return False


def _am_play(board, fr, to, promo=None):
    """The board after fr -> to, with en passant, the castling rook and promotion."""
    b = dict(board)
    piece = b.pop(fr)
    if piece.lower() == "p" and fr[0] != to[0] and to not in b:
        b.pop((to[0], fr[1]), None)
    if piece.lower() == "k" and abs(to[0] - fr[0]) == 2:
        rook = b.pop((7 if to[0] > fr[0] else 0, fr[1]), None)
        if rook:
            b[((fr[0] + to[0]) // 2, fr[1])] = rook
    if piece.lower() == "p" and to[1] in (0, 7):
        promo = promo or "q"
        piece = promo.upper() if piece.isupper() else promo.lower()
    b[to] = piece
    return b


def _am_king(board, white):
    for sq, p in board.items():
        if p == ("K" if white else "k"):
            return sq
    return None


def _am_moves(board, white, ep):
    """Pseudo-legal (from, to) moves of one side; castling left out (it never escapes a check)."""
    out = []
    for (x, y), p in list(board.items()):
        if p.isupper() != white:
            continue
        kind = p.lower()
        if kind == "p":
            d = 1 if white else -1
            if 0 <= y + d < 8 and (x, y + d) not in board:
                out.append(((x, y), (x, y + d)))
                if y == (1 if white else 6) and (x, y + 2 * d) not in board:
                    out.append(((x, y), (x, y + 2 * d)))
            for dx in (-1, 1):
                t = (x + dx, y + d)
                q = board.get(t)
                if (q is not None and q.isupper() != white) or t == ep:
                    out.append(((x, y), t))
        elif kind in "nk":
            for dx, dy in (_AM_KNIGHT if kind == "n" else _AM_KING):
                t = (x + dx, y + dy)
                q = board.get(t)
                if 0 <= t[0] < 8 and 0 <= t[1] < 8 and (q is None or q.isupper() != white):
                    out.append(((x, y), t))
        else:
            for dx, dy in _AM_LINES[kind]:
                cx, cy = x + dx, y + dy
                while 0 <= cx < 8 and 0 <= cy < 8:
                    q = board.get((cx, cy))
                    if q is None or q.isupper() != white:
                        out.append(((x, y), (cx, cy)))
                    if q is not None:
                        break
                    cx, cy = cx + dx, cy + dy
    return out


def _am_effects(fen, uci):
    """['mate' | 'check', 'capture', 'promotion'] for one legal UCI move in the FEN position."""
    board = _am_board(fen)
    white = fen.split()[1] == "w"
    sq = lambda s: (ord(s[0]) - 97, int(s[1]) - 1)
    fr, to = sq(uci[:2]), sq(uci[2:4])
    piece = board.get(fr, "")
    after = _am_play(board, fr, to, uci[4:5] or None)
    effects = []
    king = _am_king(after, not white)
    if king is not None and _am_attacked(after, king, white):
        ep = (fr[0], (fr[1] + to[1]) // 2) if piece.lower() == "p" and abs(to[1] - fr[1]) == 2 else None
        escapes = any(not _am_attacked(b, _am_king(b, not white), white)
                      for b in (_am_play(after, a, t) for a, t in _am_moves(after, not white, ep)))
        effects.append("check" if escapes else "mate")
    if to in board or (piece.lower() == "p" and fr[0] != to[0]):
        effects.append("capture")
    if len(uci) == 5:
        effects.append("promotion")
    return effects


def _am_annotate(fen, legal):
    """Legal moves with their effects, forcing moves first, e.g. 'h5f7 (mate, capture)'."""
    try:
        rows = [(m, _am_effects(fen, m)) for m in legal]
    except Exception:
        return list(legal)
    rank = {"mate": 0, "check": 1, "capture": 2}
    rows.sort(key=lambda r: min([rank.get(e, 3) for e in r[1]] + [3]))
    return [m + (" (" + ", ".join(e) + ")" if e else "") for m, e in rows]


def run(env, llm):
    def llm_with_annotations(messages, **kw):
        legal = [] if env.done else list(env.legal_moves or [])
        if legal:  # also when the move is drawn with choices (constrained_choice applied first or last)
            messages = _mut_add_to_user(messages, "Legal moves: " + ", ".join(_am_annotate(env.fen, legal)))
        return llm(messages, **kw)

    return _run_before_annotate_moves(env, llm_with_annotations)
