"""Hypothesis: Replies name the answer but not in the grader's format; submitting the choice they name (or their last line in the format) lets the grader read it.
Mechanism: answer_extraction
Parent: h0

"""

import re

SYSTEM_PROMPT = "You identify languages."
USER_PROMPT = "Text: {question}\nWhich language is this text written in?"


def _run_before_answer_extraction(env, llm):
    out = llm([{"role": "system", "content": SYSTEM_PROMPT},
               {"role": "user", "content": USER_PROMPT.format(question=env.question)}], max_tokens=24)
    env.submit(str(out).strip())


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


# --- mutation: answer_extraction ---
AX_CHOICES = ('English', 'French', 'Spanish', 'German', 'Italian')
AX_OPEN = ''
AX_CLOSE = ''


def _ax_extract(text):
    if AX_CHOICES:
        low = text.lower()
        found = []
        for choice in AX_CHOICES:
            m = re.search(r"(?<!\w)" + re.escape(choice.lower()) + r"(?!\w)", low)
            if m:
                found.append((m.start(), choice))
        return min(found)[1] if found else text
    if AX_OPEN and AX_OPEN not in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return AX_OPEN + (lines[-1] if lines else "") + AX_CLOSE
    return text


def run(env, llm):
    class _ExtractEnv:
        """env whose submit sends what the grader reads: the choice named, or the last line in the format."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            return env.submit(_ax_extract(str(answer)))

    return _run_before_answer_extraction(_ExtractEnv(), llm)
