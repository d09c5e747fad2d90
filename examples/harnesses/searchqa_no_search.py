"""Search QA without retrieval (closed book): the control for the retrieval comparison in scripts/eval_offline.sh."""

SYSTEM_PROMPT = "You answer factual questions."
USER_PROMPT = "Question: {question}\nGive the final answer inside <answer></answer> tags."


def run(env, llm):
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": USER_PROMPT.format(question=env.question)},
                {"role": "assistant", "content": "<answer>"}]
    out = str(llm(messages, max_tokens=32, stop=["</answer>"]))
    env.submit("<answer>" + out.split("</answer>")[0].strip() + "</answer>")
