"""Base harness h0 for search QA: deliberately weak, like the paper's SQA base harness.

Turn 1: the model may ask for one search as <search>query</search> (only the first query is used,
top-1 passage, cut to ~200 words). Turn 2: the answer turn, prefilled with "<answer>" so even a
small model produces a tagged answer. Two model calls at most.
"""

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


def run(env, llm):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT.format(question=env.question)},
    ]
    first = str(llm(messages, max_tokens=128, stop=["</search>", "</answer>"]))
    s_pos, a_pos = first.find("<search>"), first.find("<answer>")
    if a_pos >= 0 and (s_pos < 0 or a_pos < s_pos):
        env.submit("<answer>" + (_tag(first, "answer") or "") + "</answer>")
        return
    query = _tag(first, "search") if s_pos >= 0 else None
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
