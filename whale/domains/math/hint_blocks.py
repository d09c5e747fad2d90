"""Math hint blocks (harness code the domain's hints splice in, see hints.py):
a Python program before solving, a boxed-answer reminder, a parse retry, a self-check."""

PYTHON_FIRST = r'''
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

    return __INNER__(env, llm_with_program)
'''

BOXED_REMINDER = ("Think step by step but briefly. End your reply with the final answer as \\boxed{answer}, "
                  "with only the number or expression inside.")

RETRY_PARSE = r'''
RP_TOKENS = 32


def run(env, llm):
    last = {}

    def recording_llm(messages, **kw):
        out = llm(messages, **kw)
        if not kw.get("choices") and kw.get("n", 1) == 1:
            last["messages"], last["reply"] = list(messages), str(out)
        return out

    class _RetryParseEnv:
        """env whose submit asks once more, prefilled with a boxed answer, when none was given."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            answer = str(answer)
            if "\\boxed{" not in answer and "messages" in last:
                msgs = list(last["messages"])
                if msgs and msgs[-1].get("role") == "assistant":
                    msgs[-1] = {"role": "assistant", "content": str(msgs[-1].get("content")) + last["reply"]}
                else:
                    msgs.append({"role": "assistant", "content": last["reply"]})
                msgs += [{"role": "user", "content": "Give the final answer only."},
                         {"role": "assistant", "content": "The final answer is \\boxed{"}]
                try:
                    tail = str(llm(msgs, max_tokens=RP_TOKENS))
                    answer = answer + "\nThe final answer is \\boxed{" + _mut_balanced(tail).strip() + "}"
                except Exception:
                    pass
            return env.submit(answer)

    return __INNER__(_RetryParseEnv(), recording_llm)
'''

SELF_CHECK = r'''
SC_TOKENS = 256


def run(env, llm):
    class _SelfCheckEnv:
        """env whose submit first asks the model to check the solution and keeps a corrected answer."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            answer = str(answer)
            if "\\boxed{" in answer:
                ask = [{"role": "user", "content": "Problem: " + env.question + "\n\nProposed solution:\n"
                        + answer[-1500:] + "\n\nCheck this solution step by step. If it is wrong, correct it. "
                        "End with the final answer as \\boxed{}."}]
                try:
                    checked = str(llm(ask, max_tokens=SC_TOKENS))
                    if "\\boxed{" in checked:
                        answer = checked
                except Exception:
                    pass
            return env.submit(answer)

    return __INNER__(_SelfCheckEnv(), llm)
'''
