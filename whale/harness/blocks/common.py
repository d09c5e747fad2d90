"""Blocks for every domain: the helpers each spliced candidate carries, majority voting, and the
system prompts the general rewrite draws from."""

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


# The general system-prompt rewrite draws from these, followed by the domain's declared answer
# format in words when it has one. A domain's hints may offer its own prompts instead.
SYSTEM_PROMPTS = (
    "You are a careful assistant. Think briefly, follow the requested answer format exactly, and give "
    "only the final answer in it.",
    "Solve the task step by step, then give the final answer in exactly the requested format.",
)
