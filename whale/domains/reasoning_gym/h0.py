"""Base harness h0 for reasoning-gym tasks: the library's own evaluation protocol, nothing more.

reasoning-gym's "default" system prompt (think step by step, then the answer inside
<answer></answer>), the question as the user turn, one model call, the reply submitted as it is.
The grader scores the reply's last <answer>...</answer> (or the whole reply without a tag) with
the task's own score_answer. No format retry, no prefill, no vote: room for a harness phase.
"""

SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear and "
    "specific manner.\nOnce you have thought about the reasoning process, provide the answer in the "
    "following format:\n<answer>answer here</answer>\nDo not explain your reasoning inside the answer "
    "tags, provide only the final answer. When an example is provided, you should strictly follow the "
    "format of the output/answer in that example."
)
USER_PROMPT = "{question}"


def run(env, llm):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT.format(question=env.question)},
    ]
    env.submit(str(llm(messages)))
