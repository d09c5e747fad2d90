"""Base harness h0 for verifiers environments: the environment's own protocol, replayed.

The prompt is the environment's (its system prompt and few-shot turns are already in the dataset
row, `env.prompt`); with tools, each reply's tool calls go to the environment (`env.call_tool`,
which does what the environment's ToolEnv does with a call, errors included) and the results come
back as tool messages, until a reply calls no tool or `env.max_turns` replies were made; the last
reply is submitted. SingleTurnEnv: one call. Under `whale eval` this scores what the environment's
own rollouts would score for the same model outputs.
"""

SYSTEM_PROMPT = ""  # empty: keep the environment's own system prompt
USER_PROMPT = "{question}"
DEFAULT_TURNS = 10  # when the environment sets no turn limit (max_turns <= 0)


def run(env, llm):
    messages = [dict(m) for m in env.prompt]
    if SYSTEM_PROMPT:
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = SYSTEM_PROMPT
        else:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    if USER_PROMPT != "{question}":
        messages[-1] = {"role": "user", "content": USER_PROMPT.format(question=env.question)}
    tools = env.tool_schemas
    turns = env.max_turns if env.max_turns > 0 else DEFAULT_TURNS
    reply = ""
    for turn in range(turns):
        out = llm(messages, tools=tools) if tools else llm(messages)
        reply = str(out)
        calls = (out.tool_calls or []) if tools else []
        if not calls or turn == turns - 1:  # the environment stops here too, without running them
            break
        messages.append({"role": "assistant", "content": reply, "tool_calls": calls})
        for call in calls:
            fn = call["function"]
            content = env.call_tool(fn["name"], fn.get("arguments") or "{}", turn=turn, call_id=call.get("id"))
            messages.append({"role": "tool", "content": content, "tool_call_id": call.get("id")})
    env.submit(reply)
