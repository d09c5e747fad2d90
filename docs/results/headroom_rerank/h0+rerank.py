"""Hypothesis: BM25's top passage is often another field of the right entity (a short one that repeats its name); drawing ten and putting first those whose titles name what the question asks keeps one passage, now the one with the answer.
Mechanism: rerank_passages
Parent: h0

Base harness h0 for search QA: deliberately weak, like the paper's SQA base harness.

Turn 1: the model writes one search query, prefilled with "<search>" (only the first line of the
query is used; top-1 passage, cut to ~200 words). Turn 2: the answer turn, prefilled with
"<answer>" so even a small model produces a tagged answer. Two model calls at most.

Why the "<search>" prefill: the paper's h0 lets the model decide whether to search, but the 135M
offline default never writes a search tag on its own (0 of 32 first turns), which would leave the
weight phase with no accepted samples at all. With the prefill the model still chooses the query,
so retrieval quality stays the model's (and a better harness's) job.
"""

import unicodedata

import re

SYSTEM_PROMPT = "You answer factual questions. Search when you need information."

USER_PROMPT = (
    "Question: {question}\n"
    "If you need to look something up, write <search>your query</search>. "
    "Give the final answer inside <answer></answer> tags, for example <answer>Paris</answer>."
)

MAX_PASSAGE_WORDS = 200


def _tag(text, name):
    """Text after the first <name> tag, up to its closing tag (or the end); None if absent."""
    m = re.search("<" + name + ">(.*?)(?:</" + name + ">|$)", text, re.DOTALL)
    return m.group(1).strip() if m else None


def _run_before_rerank_passages(env, llm):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT.format(question=env.question)},
    ]
    first = "<search>" + str(llm(messages + [{"role": "assistant", "content": "<search>"}],
                                  max_tokens=32, stop=["</search>"]))
    query = _tag(first, "search")
    if query:
        results = env.search(query.splitlines()[0], k=1)
        passage = "no results"
        if results:
            words = (results[0]["title"] + "\n" + results[0]["text"]).split(" ")
            passage = " ".join(words[:MAX_PASSAGE_WORDS])
        said = first.split("</search>")[0] + "</search>"  # the model's own words, as generated
        messages += [
            {"role": "assistant", "content": said},
            {"role": "user", "content": "<information>" + passage + "</information>"},
            {"role": "assistant", "content": "<answer>"},
        ]
    else:
        messages.append({"role": "assistant", "content": (first.rstrip() + "\n<answer>").lstrip()})
    final = str(llm(messages, max_tokens=32, stop=["</answer>"]))
    env.submit("<answer>" + final.split("</answer>")[0].strip() + "</answer>")


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


# --- mutation: rerank_passages ---
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
    return _run_before_rerank_passages(_RerankEnv(env), llm)
