"""Base harness h0 for search QA: deliberately weak, like the paper's SQA base harness.

Turn 1: the model writes one search query, prefilled with "<search>" (only the first line of the
query is used; top-1 passage, cut to ~200 words). Turn 2: the answer turn, prefilled with
"<answer>" so even a small model produces a tagged answer. Two model calls at most.

Why the "<search>" prefill: the paper's h0 lets the model decide whether to search, but the 135M
offline default never writes a search tag on its own (0 of 32 first turns), which would leave the
weight phase with no accepted samples at all. With the prefill the model still chooses the query,
so retrieval quality stays the model's (and a better harness's) job.
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
