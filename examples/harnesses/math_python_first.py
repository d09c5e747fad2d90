"""Hypothesis: Many replies never reach a boxed answer; a firm reminder to end with it raises the parse rate.
Mechanism: boxed_reminder
Parent: h0

Earlier hypothesis: Small models make arithmetic slips; a Python program run before solving gives the model a computed result to rely on.
Earlier mechanism: python_first
Earlier parent: h0

Base harness h0 for math: the paper's weak ReTool-style harness.

No system prompt; the question plus a demand for a \boxed{} answer; two turns. If the first reply
contains a ```python block, the block runs in the sandbox and its output goes back to the model,
which is asked for the final answer. The last reply is submitted as it is.
"""

import re

SYSTEM_PROMPT = ""
USER_PROMPT = (
    '{question}\n'
    '\n'
    'Please put your final answer within \\boxed{{}}.\n'
    'Think step by step but briefly. End your reply with the final answer as \\boxed{{answer}}, '
    'with only the number or expression inside.'
)
FOLLOWUP_PROMPT = "Output of your code:\n{output}\n\nNow give the final answer within \\boxed{{}}."

CODE_BLOCK = re.compile(r"```(?:python|py)\s*\n(.*?)```", re.S)


def _run_before_python_first(env, llm):
    messages = []
    if SYSTEM_PROMPT:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": USER_PROMPT.format(question=env.question)})
    reply = llm(messages)
    blocks = CODE_BLOCK.findall(reply)
    if blocks:
        try:
            output = env.python(blocks[0])
        except Exception as exc:  # a refused tool call (budget, bad input) is shown to the model
            output = f"Error: {exc}"
        messages.append({"role": "assistant", "content": str(reply)})
        messages.append({"role": "user", "content": FOLLOWUP_PROMPT.format(output=str(output)[:2000])})
        try:
            reply = llm(messages)
        except Exception:  # a budget ran out: submit what we have
            pass
    env.submit(str(reply))


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


# --- mutation: python_first ---
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

    return _run_before_python_first(env, llm_with_program)
