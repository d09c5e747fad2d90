"""Hypothesis: 2 solved harness-split episodes, shown as earlier turns, teach the answer format and the kind of answer that scores.
Mechanism: few_shot
Parent: h5

Earlier hypothesis: Answers opened in the format run on past their first line (explanations, a next question), which the grader reads as the answer; stopping at the line's end keeps the answer alone.
Earlier mechanism: answer_line_stop
Earlier parent: h2

Earlier hypothesis: Replies miss the format the grader reads (the final answer alone inside <answer></answer>); opening the assistant turn with '<answer>' and stopping at '</answer>' makes every reply an answer in it.
Earlier mechanism: answer_prefill
Earlier parent: h0

Base harness h0 for reasoning-gym tasks: the library's own evaluation protocol, nothing more.

reasoning-gym's "default" system prompt (think step by step, then the answer inside
<answer></answer>), the question as the user turn, one model call, the reply submitted as it is.
The grader scores the reply's last <answer>...</answer> (or the whole reply without a tag) with
the task's own score_answer. No format retry, no prefill, no vote: room for a harness phase.
"""

import re

SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear and "
    "specific manner.\nOnce you have thought about the reasoning process, provide the answer in the "
    "following format:\n<answer>answer here</answer>\nDo not explain your reasoning inside the answer "
    "tags, provide only the final answer. When an example is provided, you should strictly follow the "
    "format of the output/answer in that example."
)
USER_PROMPT = "{question}"


def _run_before_answer_prefill(env, llm):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT.format(question=env.question)},
    ]
    env.submit(str(llm(messages)))


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


# --- mutation: answer_prefill ---
AP_OPEN = '<answer>'
AP_CLOSE = '</answer>'


def _run_before_answer_line_stop(env, llm):
    def _ap_wrap(out):
        text = str(out).split(AP_CLOSE)[0].strip()
        return _MutText(AP_OPEN + text + AP_CLOSE, out.finish_reason)

    def prefilled_llm(messages, **kw):
        if kw.get("choices") or kw.get("tools") or not messages or messages[-1].get("role") == "assistant":
            return llm(messages, **kw)
        stop = list(kw.pop("stop", None) or [])
        out = llm(list(messages) + [{"role": "assistant", "content": AP_OPEN}], stop=stop + [AP_CLOSE], **kw)
        return [_ap_wrap(o) for o in out] if isinstance(out, list) else _ap_wrap(out)

    return _run_before_answer_prefill(env, prefilled_llm)


# --- mutation: answer_line_stop ---
ALS_OPEN = '<answer>'


def _run_before_few_shot(env, llm):
    def line_llm(messages, **kw):
        last = messages[-1] if messages else {}
        if kw.get("choices") or kw.get("tools") or kw.get("n", 1) != 1 or last.get("role") != "assistant" \
                or not str(last.get("content", "")).rstrip().endswith(ALS_OPEN):
            return llm(messages, **kw)
        stop = list(kw.get("stop") or [])
        out = llm(messages, **dict(kw, stop=stop + ["\n"]))
        if str(out).strip():
            return out
        out = llm(messages, **dict(kw, stop=stop or None))
        lines = [ln.strip() for ln in str(out).splitlines() if ln.strip()]
        return _MutText(lines[0] if lines else str(out), out.finish_reason)

    return _run_before_answer_line_stop(env, line_llm)


# --- mutation: few_shot ---
FS_EXAMPLES = (('Given two strings representing a ransom note and a magazine, return True if you can construct the ransom note using the letters in the magazine, and False otherwise.\n\nEach letter in the magazine string can only be used once in your ransom note.\n\nRansom note: vw\nMagazine: lvguqpqws\n', '<answer>True</answer>'), ('Given two strings representing a ransom note and a magazine, return True if you can construct the ransom note using the letters in the magazine, and False otherwise.\n\nEach letter in the magazine string can only be used once in your ransom note.\n\nRansom note: lolz\nMagazine: gumylcwfvlzr\n', '<answer>False</answer>'))


def run(env, llm):
    def few_shot_llm(messages, **kw):
        text = " ".join(str(m.get("content") or "") for m in messages)
        shots = []
        for question, answer in FS_EXAMPLES:
            if question not in text:
                shots += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not shots or not users:
            return llm(messages, **kw)
        at = users[0]
        return llm(list(messages[:at]) + shots + list(messages[at:]), **kw)

    return _run_before_few_shot(env, few_shot_llm)
