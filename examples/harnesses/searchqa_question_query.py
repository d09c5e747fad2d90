"""Search QA with the question itself as the BM25 query and a one-line answer (what the mutations
`question_as_query` + `answer_first_line` do to h0, written out by hand): the retrieval arm of
the retrieval-vs-closed-book comparison in scripts/eval_offline.sh."""

SYSTEM_PROMPT = "You answer factual questions using the passage."
USER_PROMPT = "Passage: {passage}\n\nQuestion: {question}\nAnswer with the name only, inside <answer></answer>."


def run(env, llm):
    hits = env.search(env.question, k=1)
    passage = hits[0]["title"] + ": " + hits[0]["text"] if hits else "none"
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": USER_PROMPT.format(passage=" ".join(passage.split()[:200]), question=env.question)},
                {"role": "assistant", "content": "<answer>"}]
    out = str(llm(messages, max_tokens=24, stop=["</answer>", "\n"]))
    env.submit("<answer>" + out.split("</answer>")[0].strip() + "</answer>")
