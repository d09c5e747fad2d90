"""Harness code that the mutation proposer (mutation.py) splices into candidates.

Each block is plain harness code (standard library only, contract of DESIGN §4). `__INNER__` is
replaced by the name of the renamed parent `run`, `__NAME__` by the name of a replaced base run.
Wrappers change one mechanism each and hand everything else through, so they compose.
"""

HELPERS_MARK = "# --- mutation helpers ---"

HELPERS = r'''# --- mutation helpers ---
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
'''

MAJORITY_VOTE = r'''
MV_SAMPLES = 3


def run(env, llm):
    def voting_llm(messages, **kw):
        if kw.get("choices") or kw.get("tools") or kw.get("n", 1) != 1:
            return llm(messages, **kw)
        kw.pop("n", None)
        samples = llm(messages, n=MV_SAMPLES, **kw)
        keys = [_mut_answer_key(s) for s in samples]
        return samples[keys.index(max(keys, key=keys.count))]

    return __INNER__(env, voting_llm)
'''

MORE_PASSAGES = r'''
MP_PASSAGES = 3
MP_WORDS = 60


class _MorePassagesEnv:
    """env whose search gives the top MP_PASSAGES passages (shortened, merged) where one is asked for."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        results = self._env.search(query, k=max(int(k), MP_PASSAGES))
        if int(k) > 1 or len(results) <= 1:
            return results
        top = results[:MP_PASSAGES]
        text = " ".join("(" + str(r["title"]) + ") " + " ".join(str(r["text"]).split()[:MP_WORDS]) for r in top)
        return [{"title": " / ".join(str(r["title"]) for r in top), "text": text}]


def run(env, llm):
    return __INNER__(_MorePassagesEnv(env), llm)
'''

QUERY_REWRITE = r'''
QR_STOPWORDS = {"what", "which", "who", "whom", "whose", "where", "when", "why", "how", "is", "are", "was",
                "were", "the", "a", "an", "of", "does", "do", "did", "in", "for", "to", "and", "please"}


class _QueryRewriteEnv:
    """env whose search drops question words and punctuation from the query (BM25 wants content words)."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        words = re.findall(r"[\w'-]+", str(query))
        kept = [w for w in words if w.lower() not in QR_STOPWORDS]
        return self._env.search(" ".join(kept) or str(query), k=k)


def run(env, llm):
    return __INNER__(_QueryRewriteEnv(env), llm)
'''

FORCE_RETRIEVAL = r'''
FR_PASSAGES = 2
FR_WORDS = 60


def run(env, llm):
    cache = {}

    def llm_with_evidence(messages, **kw):
        if "text" not in cache:
            try:
                results = env.search(env.question, k=FR_PASSAGES)
            except Exception:
                results = []
            cache["text"] = "\n".join("(" + str(r["title"]) + ") " + " ".join(str(r["text"]).split()[:FR_WORDS])
                                      for r in results)
        if cache["text"]:
            messages = _mut_add_to_user(messages, "Retrieved for this question:\n" + cache["text"], first=True)
        return llm(messages, **kw)

    return __INNER__(env, llm_with_evidence)
'''

RETRIEVED_TITLES = r'''
class _TitlesEnv:
    """env that remembers the titles of every passage its search returned."""

    def __init__(self, env, titles):
        self._env = env
        self._titles = titles

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        results = self._env.search(query, k=k)
        for r in results:
            title = str(r.get("title", ""))
            if title and title not in self._titles:
                self._titles.append(title)
        return results


def run(env, llm):
    titles = []

    def llm_with_titles(messages, **kw):
        if titles:
            messages = _mut_add_to_user(messages, "Titles retrieved so far: " + "; ".join(titles[-8:]))
        return llm(messages, **kw)

    return __INNER__(_TitlesEnv(env, titles), llm_with_titles)
'''

SEARCH_TURNS_RUN = r'''
MST_TURNS = 3


def __NAME__(env, llm):
    words = globals().get("MAX_PASSAGE_WORDS", 200)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if SYSTEM_PROMPT else []
    messages.append({"role": "user", "content": USER_PROMPT.format(question=env.question)})
    for _ in range(MST_TURNS):
        reply = str(llm(messages, max_tokens=128, stop=["</search>", "</answer>"]))
        s_pos, a_pos = reply.find("<search>"), reply.find("<answer>")
        if a_pos >= 0 and (s_pos < 0 or a_pos < s_pos):
            m = re.search(r"<answer>(.*?)(?:</answer>|$)", reply, re.S)
            env.submit("<answer>" + m.group(1).strip() + "</answer>")
            return
        m = re.search(r"<search>(.*?)(?:</search>|$)", reply, re.S) if s_pos >= 0 else None
        query = m.group(1).strip().splitlines()[0].strip() if m and m.group(1).strip() else ""
        if not query:
            messages.append({"role": "assistant", "content": (reply.rstrip() + "\n<answer>").lstrip()})
            break
        results = env.search(query, k=1)
        passage = "no results"
        if results:
            passage = " ".join((str(results[0]["title"]) + "\n" + str(results[0]["text"])).split(" ")[:words])
        messages += [
            {"role": "assistant", "content": reply[:s_pos] + "<search>" + query + "</search>"},
            {"role": "user", "content": "<information>" + passage + "</information>\nIf a fact is still missing, "
             "search again with <search>query</search>; otherwise answer inside <answer></answer>."},
        ]
    else:
        messages.append({"role": "assistant", "content": "<answer>"})
    final = str(llm(messages, max_tokens=32, stop=["</answer>"]))
    env.submit("<answer>" + final.split("</answer>")[0].strip() + "</answer>")
'''

SEARCHQA_REMINDER = "Reply with only the short answer (a name, place or number), never a sentence."

PYTHON_FIRST = r'''
PF_TOKENS = 200


def run(env, llm):
    note = {}

    def llm_with_program(messages, **kw):
        if "text" not in note:
            note["text"] = ""
            ask = [{"role": "user", "content": "Write a short Python program that computes and prints the answer "
                    "to this problem.\n\nProblem: " + env.question},
                   {"role": "assistant", "content": "```python\n"}]
            try:
                code = str(llm(ask, max_tokens=PF_TOKENS, stop=["```"]))
                output = str(env.python(code)).strip()[:500]
                if output:
                    note["text"] = ("A Python program written for this problem printed:\n" + output
                                    + "\nUse this result if the program is right.")
            except Exception:
                pass
        if note["text"]:
            messages = _mut_add_to_user(messages, note["text"], first=True)
        return llm(messages, **kw)

    return __INNER__(env, llm_with_program)
'''

BOXED_REMINDER = ("Think step by step but briefly. End your reply with the final answer as \\boxed{answer}, "
                  "with only the number or expression inside.")

RETRY_PARSE = r'''
RP_TOKENS = 32


def run(env, llm):
    last = {}

    def recording_llm(messages, **kw):
        out = llm(messages, **kw)
        if not kw.get("choices") and kw.get("n", 1) == 1:
            last["messages"], last["reply"] = list(messages), str(out)
        return out

    class _RetryParseEnv:
        """env whose submit asks once more, prefilled with a boxed answer, when none was given."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            answer = str(answer)
            if "\\boxed{" not in answer and "messages" in last:
                msgs = list(last["messages"])
                if msgs and msgs[-1].get("role") == "assistant":
                    msgs[-1] = {"role": "assistant", "content": str(msgs[-1].get("content")) + last["reply"]}
                else:
                    msgs.append({"role": "assistant", "content": last["reply"]})
                msgs += [{"role": "user", "content": "Give the final answer only."},
                         {"role": "assistant", "content": "The final answer is \\boxed{"}]
                try:
                    tail = str(llm(msgs, max_tokens=RP_TOKENS))
                    answer = answer + "\nThe final answer is \\boxed{" + _mut_balanced(tail).strip() + "}"
                except Exception:
                    pass
            return env.submit(answer)

    return __INNER__(_RetryParseEnv(), recording_llm)
'''

SELF_CHECK = r'''
SC_TOKENS = 256


def run(env, llm):
    class _SelfCheckEnv:
        """env whose submit first asks the model to check the solution and keeps a corrected answer."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            answer = str(answer)
            if "\\boxed{" in answer:
                ask = [{"role": "user", "content": "Problem: " + env.question + "\n\nProposed solution:\n"
                        + answer[-1500:] + "\n\nCheck this solution step by step. If it is wrong, correct it. "
                        "End with the final answer as \\boxed{}."}]
                try:
                    checked = str(llm(ask, max_tokens=SC_TOKENS))
                    if "\\boxed{" in checked:
                        answer = checked
                except Exception:
                    pass
            return env.submit(answer)

    return __INNER__(_SelfCheckEnv(), llm)
'''

LEGAL_MOVE_LIST = r'''
def run(env, llm):
    def llm_with_moves(messages, **kw):
        legal = [] if env.done else list(env.legal_moves or [])
        if legal and not kw.get("choices"):
            messages = _mut_add_to_user(messages, "Legal moves: " + " ".join(legal))
        return llm(messages, **kw)

    return __INNER__(env, llm_with_moves)
'''

ANNOTATE_MOVES = r'''
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
        if legal and not kw.get("choices"):
            messages = _mut_add_to_user(messages, "Legal moves: " + ", ".join(_am_annotate(env.fen, legal)))
        return llm(messages, **kw)

    return __INNER__(env, llm_with_annotations)
'''

CONSTRAINED_CHOICE = r'''
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

    return __INNER__(env, choosing_llm)
'''

ILLEGAL_RETRY = r'''
def run(env, llm):
    last = {}

    def recording_llm(messages, **kw):
        last["messages"] = list(messages)
        return llm(messages, **kw)

    class _RetryMoveEnv:
        """env whose move, when refused, re-chooses at once among the legal moves."""

        def __getattr__(self, name):
            return getattr(env, name)

        def move(self, uci):
            result = env.move(uci)
            legal = result.get("legal_moves") or []
            if result.get("error") and not result.get("done") and legal and "messages" in last:
                msgs = list(last["messages"])
                if msgs and msgs[-1].get("role") == "assistant":
                    msgs = msgs[:-1]
                msgs += [{"role": "user", "content": str(uci) + " is not legal here. Choose a legal move."},
                         {"role": "assistant", "content": "<move>"}]
                try:
                    pick = str(llm(msgs, choices=legal))
                except Exception:
                    return result
                result = env.move(pick)
            return result

    return __INNER__(_RetryMoveEnv(), recording_llm)
'''

CHESS_HINT = "Look for checks, captures and threats first."

SYSTEM_PROMPTS = {
    "*": [
        "You are a careful assistant. Think briefly, follow the requested answer format exactly, and give "
        "only the final answer in it.",
        "Solve the task step by step, then give the final answer in exactly the requested format.",
    ],
    "searchqa": [
        "You answer factual questions with a search engine. Search for the main entity of the question "
        "first, read the passage, then reply with only the short answer inside <answer></answer>.",
        "You are a precise research assistant. Use <search>query</search> to look facts up instead of "
        "guessing. The final answer is a short entity (a name, place or number) inside <answer></answer>.",
    ],
    "math": [
        "You are a careful mathematician. Solve the problem step by step, check each computation, and end "
        "with the final answer in \\boxed{}.",
        "You solve math problems. When a computation is tedious, write a short ```python block that "
        "prints the result. Always end with \\boxed{answer}.",
    ],
    "chess": [
        "You are a chess grandmaster solving a tactics puzzle. Look for checks, captures and threats, in "
        "that order, and answer with exactly one move in UCI notation inside <move></move>.",
        "You solve chess puzzles. The solution is forcing: consider every check first, then captures. "
        "Reply with one move as <move>uci</move>, for example <move>e2e4</move>.",
    ],
}

QUESTION_AS_QUERY = r'''
class _QuestionQueryEnv:
    """env whose search uses the question itself as the query (the model's own query is dropped)."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        return self._env.search(self._env.question, k=k)


def run(env, llm):
    return __INNER__(_QuestionQueryEnv(env), llm)
'''

RERANK_PASSAGES = r'''
RR_POOL = 10
RR_STOPWORDS = {"what", "which", "who", "whom", "whose", "where", "when", "why", "how", "is", "are", "was",
                "were", "the", "a", "an", "of", "does", "do", "did", "in", "on", "at", "for", "to", "and",
                "or", "by", "with", "from", "its", "it", "this", "that", "name", "named", "called", "please"}


def _rr_words(text):
    # lower-cased, accent-folded content words with a plural "s" dropped: "Bogota" meets "Bogotá"
    text = unicodedata.normalize("NFKD", str(text).lower())
    text = "".join(c for c in text if not unicodedata.combining(c))
    return {w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w
            for w in re.findall(r"[a-z0-9]{2,}", text) if w not in RR_STOPWORDS}


class _RerankEnv:
    """env whose search draws RR_POOL passages and returns first those whose titles share the most
    words with the query and the question (ties keep the retriever's order), as many as were asked."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        pool = list(self._env.search(query, k=max(int(k), RR_POOL)) or [])
        words = _rr_words(query) | _rr_words(getattr(self._env, "question", ""))

        def overlap(i):
            title = pool[i].get("title", "") if isinstance(pool[i], dict) else ""
            return -len(words & _rr_words(title)), i

        return [pool[i] for i in sorted(range(len(pool)), key=overlap)[:max(1, int(k))]]


def run(env, llm):
    return __INNER__(_RerankEnv(env), llm)
'''

ANSWER_FIRST_LINE = r'''
def run(env, llm):
    def llm_first_line(messages, **kw):
        last = messages[-1] if messages else {}
        if last.get("role") != "assistant" or not str(last.get("content", "")).rstrip().endswith("<answer>"):
            return llm(messages, **kw)
        stop = list(kw.get("stop") or [])
        out = llm(messages, **dict(kw, stop=stop + ["\n"]))
        if str(out).strip():
            return out
        # the model opened with a line break: take the first non-empty line of a free completion
        out = llm(messages, **dict(kw, stop=stop or None))
        lines = [ln.strip() for ln in str(out).splitlines() if ln.strip()]
        return lines[0] if lines else out

    return __INNER__(env, llm_first_line)
'''
