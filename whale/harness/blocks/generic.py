"""Domain-general blocks: they act on the answer format a domain declares (`Domain.answer_format`),
the parent's solved episodes and the sampling limits, never on a particular task.

`__NAME__` placeholders in capitals (e.g. `__OPEN__`) are filled with Python literals by the
proposer (mutation.py, `fill`), so a candidate carries the format as plain constants.
"""

# The assistant turn opens with the answer's opening text and stops at its closing text: a small
# model that never writes the format (reasoning-gym h0: 0 of 96 replies tagged) answers in it.
ANSWER_PREFILL = r'''
AP_OPEN = __OPEN__
AP_CLOSE = __CLOSE__


def run(env, llm):
    def _ap_wrap(out):
        text = str(out).split(AP_CLOSE)[0].strip()
        return _MutText(AP_OPEN + text + AP_CLOSE, out.finish_reason)

    def prefilled_llm(messages, **kw):
        if kw.get("choices") or kw.get("tools") or not messages or messages[-1].get("role") == "assistant":
            return llm(messages, **kw)
        stop = list(kw.pop("stop", None) or [])
        out = llm(list(messages) + [{"role": "assistant", "content": AP_OPEN}], stop=stop + [AP_CLOSE], **kw)
        return [_ap_wrap(o) for o in out] if isinstance(out, list) else _ap_wrap(out)

    return __INNER__(env, prefilled_llm)
'''

# A submission the grader cannot read gets one more short call: the reply so far, then a request
# for the final answer alone in the declared format (prefilled, or constrained to the choices).
FORMAT_REPAIR = r'''
FR_PATTERN = __PATTERN__
FR_CHOICES = __CHOICES__
FR_OPEN = __OPEN__
FR_CLOSE = __CLOSE__
FR_FORMAT = __DESCRIPTION__
FR_TOKENS = 32


def _fr_readable(text):
    if FR_PATTERN:
        found = re.findall(FR_PATTERN, text, re.S)
        if not found:
            return False
        text = found[-1] if isinstance(found[-1], str) else found[-1][0]
    return not FR_CHOICES or text.strip() in FR_CHOICES


def run(env, llm):
    last = {}

    def recording_llm(messages, **kw):
        out = llm(messages, **kw)
        if not kw.get("choices") and not kw.get("tools") and not isinstance(out, list):
            last["messages"], last["reply"] = list(messages), str(out)
        return out

    class _FormatRepairEnv:
        """env whose submit asks once more for the answer in the grader's format when it is not."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            answer = str(answer)
            if not _fr_readable(answer) and "messages" in last:
                msgs = list(last["messages"])
                if msgs and msgs[-1].get("role") == "assistant":  # the reply continued a prefill
                    msgs[-1] = {"role": "assistant", "content": str(msgs[-1].get("content")) + last["reply"]}
                else:
                    msgs.append({"role": "assistant", "content": last["reply"]})
                msgs.append({"role": "user", "content": "Give only the final answer, formatted as: " + FR_FORMAT})
                try:
                    if FR_CHOICES:
                        answer = str(llm(msgs, choices=list(FR_CHOICES)))
                    elif FR_OPEN:
                        tail = str(llm(msgs + [{"role": "assistant", "content": FR_OPEN}], max_tokens=FR_TOKENS,
                                       stop=[FR_CLOSE] if FR_CLOSE else None))
                        answer = FR_OPEN + tail.split(FR_CLOSE)[0].strip() + FR_CLOSE if FR_CLOSE else FR_OPEN + tail
                    else:
                        answer = str(llm(msgs, max_tokens=FR_TOKENS)).strip()
                except Exception:
                    pass
            return env.submit(answer)

    return __INNER__(_FormatRepairEnv(), recording_llm)
'''

# No model call: a submission that names one of the grader's choices (in any case, among other
# words) is submitted as that choice exactly; with an open/close format, the last line is wrapped.
ANSWER_EXTRACTION = r'''
AX_CHOICES = __CHOICES__
AX_OPEN = __OPEN__
AX_CLOSE = __CLOSE__


def _ax_extract(text):
    if AX_CHOICES:
        low = text.lower()
        found = []
        for choice in AX_CHOICES:
            m = re.search(r"(?<!\w)" + re.escape(choice.lower()) + r"(?!\w)", low)
            if m:
                found.append((m.start(), choice))
        return min(found)[1] if found else text
    if AX_OPEN and AX_OPEN not in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return AX_OPEN + (lines[-1] if lines else "") + AX_CLOSE
    return text


def run(env, llm):
    class _ExtractEnv:
        """env whose submit sends what the grader reads: the choice named, or the last line in the format."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            return env.submit(_ax_extract(str(answer)))

    return __INNER__(_ExtractEnv(), llm)
'''

# The grader accepts a finite set of answers: every plain model call chooses among them, drawn
# from the model's own probabilities (llm(..., choices=...)).
CONSTRAINED_ANSWER = r'''
CA_CHOICES = __CHOICES__


def run(env, llm):
    def choosing_llm(messages, **kw):
        if kw.get("choices") or kw.get("tools") or kw.get("n", 1) != 1:
            return llm(messages, **kw)
        return llm(messages, choices=list(CA_CHOICES))

    return __INNER__(env, choosing_llm)
'''

# Solved episodes of the harness split (the parent's own traces), shown as earlier turns: the
# model sees the answer format and the kind of answer that scored. An exemplar whose question is
# in the prompt is left out, so no episode is shown its own answer.
FEW_SHOT = r'''
FS_EXAMPLES = __EXAMPLES__


def run(env, llm):
    def few_shot_llm(messages, **kw):
        text = " ".join(str(m.get("content") or "") for m in messages)
        shots = []
        for question, answer in FS_EXAMPLES:
            if question not in text:
                shots += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not shots or not users:
            return llm(messages, **kw)
        at = users[0]
        return llm(list(messages[:at]) + shots + list(messages[at:]), **kw)

    return __INNER__(env, few_shot_llm)
'''

# Replies cut off at max_tokens: twice the tokens, up to the run's cap.
MORE_TOKENS = r'''
MT_DEFAULT = __DEFAULT__
MT_CAP = __CAP__


def run(env, llm):
    def longer_llm(messages, **kw):
        if not kw.get("choices"):
            kw["max_tokens"] = min(MT_CAP, 2 * int(kw.get("max_tokens") or MT_DEFAULT))
        return llm(messages, **kw)

    return __INNER__(env, longer_llm)
'''

# An answer opened by a prefill runs on past its first line (an explanation, the next question):
# stop it at the line's end, so the grader reads the answer alone; a reply that opened with a line
# break takes the first non-empty line of a free completion instead.
ANSWER_LINE_STOP = r'''
ALS_OPEN = __OPEN__


def run(env, llm):
    def line_llm(messages, **kw):
        last = messages[-1] if messages else {}
        if kw.get("choices") or kw.get("tools") or kw.get("n", 1) != 1 or last.get("role") != "assistant" \
                or not str(last.get("content", "")).rstrip().endswith(ALS_OPEN):
            return llm(messages, **kw)
        stop = list(kw.get("stop") or [])
        out = llm(messages, **dict(kw, stop=stop + ["\n"]))
        if str(out).strip():
            return out
        out = llm(messages, **dict(kw, stop=stop or None))
        lines = [ln.strip() for ln in str(out).splitlines() if ln.strip()]
        return _MutText(lines[0] if lines else str(out), out.finish_reason)

    return __INNER__(env, line_llm)
'''

# The grader gives part of the reward for an answer near the gold: the answer the grader reads is
# submitted without the spaces, quotes, asterisks and closing punctuation around it ("No." -> "No").
ANSWER_TRIM = r'''
AT_OPEN = __OPEN__
AT_CLOSE = __CLOSE__


def _at_trim(text):
    return text.strip().strip("\"'*`").rstrip(".!;:,").strip()


def run(env, llm):
    class _TrimEnv:
        """env whose submit trims the answer the grader reads."""

        def __getattr__(self, name):
            return getattr(env, name)

        def submit(self, answer):
            answer = str(answer)
            if AT_OPEN and AT_CLOSE:
                start = answer.rfind(AT_OPEN)
                end = answer.find(AT_CLOSE, start + len(AT_OPEN)) if start >= 0 else -1
                if end >= 0:
                    inner = answer[start + len(AT_OPEN):end]
                    answer = answer[:start + len(AT_OPEN)] + _at_trim(inner) + answer[end:]
            else:
                answer = _at_trim(answer)
            return env.submit(answer)

    return __INNER__(_TrimEnv(), llm)
'''
