"""A probe harness for the reasoning-gym measurement: a short prompt and an "<answer>" prefill.

It asks for the answer directly (no reasoning), prefills the assistant turn with "<answer>" and
stops at "</answer>", so the reply is always gradable. Compared with h0 it tells whether a task's
signal is the model's (h0) or only reachable through the harness.
"""

SYSTEM_PROMPT = "Answer the question directly. Give only the final answer."
USER_PROMPT = "{question}"


def run(env, llm):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT.format(question=env.question)},
        {"role": "assistant", "content": "<answer>"},
    ]
    reply = str(llm(messages, max_tokens=48, stop=["</answer>"]))
    env.submit("<answer>" + reply.split("</answer>")[0].strip() + "</answer>")
