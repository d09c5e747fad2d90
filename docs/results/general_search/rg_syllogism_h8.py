"""Hypothesis: Sampling several completions and keeping the most common answer removes one-off sampling errors at temperature 1.
Mechanism: majority_vote
Parent: h6

Earlier hypothesis: 2 solved harness-split episodes, shown as earlier turns, teach the answer format and the kind of answer that scores.
Earlier mechanism: few_shot
Earlier parent: h2

Earlier hypothesis: When the submission does not match the grader's format, one short follow-up call asking for the answer alone in it recovers a gradable answer.
Earlier mechanism: format_repair
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


def _run_before_format_repair(env, llm):
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


# --- mutation: format_repair ---
FR_PATTERN = '<answer>\\s?(.*?)\\s?</answer>'
FR_CHOICES = ()
FR_OPEN = '<answer>'
FR_CLOSE = '</answer>'
FR_FORMAT = 'the final answer alone inside <answer></answer>'
FR_TOKENS = 32


def _fr_readable(text):
    if FR_PATTERN:
        found = re.findall(FR_PATTERN, text, re.S)
        if not found:
            return False
        text = found[-1] if isinstance(found[-1], str) else found[-1][0]
    return not FR_CHOICES or text.strip() in FR_CHOICES


def _run_before_few_shot(env, llm):
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


# --- mutation: few_shot ---
FS_EXAMPLES = (('Consider these statements:\n1. All birds are insects\n2. All insects are elephants\n\nDoes it logically follow that:\nAll birds are elephants?\n(Answer Yes or No)', '<answer>Yes</answer>'), ('Consider these statements:\n1. Some mammals are programmers\n2. All programmers are chefs\n\nDoes it logically follow that:\nSome mammals are chefs?\n(Answer Yes or No)', '<answer>Yes.</answer>'))


def _run_before_majority_vote(env, llm):
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


# --- mutation: majority_vote ---
MV_SAMPLES = 3


def run(env, llm):
    def voting_llm(messages, **kw):
        if kw.get("choices") or kw.get("tools") or kw.get("n", 1) != 1:
            return llm(messages, **kw)
        kw.pop("n", None)
        samples = llm(messages, n=MV_SAMPLES, **kw)
        keys = [_mut_answer_key(s) for s in samples]
        return samples[keys.index(max(keys, key=keys.count))]

    return _run_before_majority_vote(env, voting_llm)
