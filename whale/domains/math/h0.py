"""Base harness h0 for math: the paper's weak ReTool-style harness.

No system prompt; the question plus a demand for a \boxed{} answer; two turns. If the first reply
contains a ```python block, the block runs in the sandbox and its output goes back to the model,
which is asked for the final answer. The last reply is submitted as it is.
"""

import re

SYSTEM_PROMPT = ""
USER_PROMPT = "{question}\n\nPlease put your final answer within \\boxed{{}}."
FOLLOWUP_PROMPT = "Output of your code:\n{output}\n\nNow give the final answer within \\boxed{{}}."

CODE_BLOCK = re.compile(r"```(?:python|py)\s*\n(.*?)```", re.S)


def run(env, llm):
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
