"""Hypothesis: When the submission does not match the grader's format, one short follow-up call asking for the answer alone in it recovers a gradable answer.
Mechanism: format_repair
Parent: h3

Earlier hypothesis: Replies name the answer but not in the grader's format; submitting the choice they name (or their last line in the format) lets the grader read it.
Earlier mechanism: answer_extraction
Earlier parent: h0

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


def _run_before_format_repair(env, llm):
    class _ExtractEnv:
        """env whose submit sends what the grader reads: the choice named, or the last line in the format."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            return env.submit(_ax_extract(str(answer)))

    return _run_before_answer_extraction(_ExtractEnv(), llm)


# --- mutation: format_repair ---
FR_PATTERN = ''
FR_CHOICES = ('English', 'French', 'Spanish', 'German', 'Italian')
FR_OPEN = ''
FR_CLOSE = ''
FR_FORMAT = 'the language name alone: English, French, Spanish, German or Italian'
FR_TOKENS = 32


def _fr_readable(text):
    if FR_PATTERN:
        found = re.findall(FR_PATTERN, text, re.S)
        if not found:
            return False
        text = found[-1] if isinstance(found[-1], str) else found[-1][0]
    return not FR_CHOICES or text.strip() in FR_CHOICES


def run(env, llm):
    last = {}

    def recording_llm(messages, **kw):
        out = llm(messages, **kw)
        if not kw.get("choices") and not kw.get("tools") and not isinstance(out, list):
            last["messages"], last["reply"] = list(messages), str(out)
        return out

    class _FormatRepairEnv:
        """env whose submit asks once more for the answer in the grader's format when it is not."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            answer = str(answer)
            if not _fr_readable(answer) and "messages" in last:
                msgs = list(last["messages"])
                if msgs and msgs[-1].get("role") == "assistant":  # the reply continued a prefill
                    msgs[-1] = {"role": "assistant", "content": str(msgs[-1].get("content")) + last["reply"]}
                else:
                    msgs.append({"role": "assistant", "content": last["reply"]})
                msgs.append({"role": "user", "content": "Give only the final answer, formatted as: " + FR_FORMAT})
                try:
                    if FR_CHOICES:
                        answer = str(llm(msgs, choices=list(FR_CHOICES)))
                    elif FR_OPEN:
                        tail = str(llm(msgs + [{"role": "assistant", "content": FR_OPEN}], max_tokens=FR_TOKENS,
                                       stop=[FR_CLOSE] if FR_CLOSE else None))
                        answer = FR_OPEN + tail.split(FR_CLOSE)[0].strip() + FR_CLOSE if FR_CLOSE else FR_OPEN + tail
                    else:
                        answer = str(llm(msgs, max_tokens=FR_TOKENS)).strip()
                except Exception:
                    pass
            return env.submit(answer)

    return _run_before_format_repair(_FormatRepairEnv(), recording_llm)
