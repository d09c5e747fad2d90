"""Which recorded model calls reached the episode's outcome, and so may become training rows.

RSFT raises the probability of what earned the reward. A harness samples more than it keeps: the
`n` siblings of a majority vote, a reply it rejected and retried, a draft it threw away. Training
on those would fine-tune the minority (wrong) answers of an accepted episode. So a call is *used*
(trained, if the episode is accepted) only when its output reached the outcome:

1. **It produced an action.** A later action is a string argument of a tool call that succeeded
   (`env.search(query)`, `env.move(uci)`, `env.submit(answer)`) or the episode's final answer (for
   chess, the moves played). The call produced it when the action is contained in what the model
   wrote (the prefill plus the completion, but not the prefill alone: `"<answer>"` prefilled does
   not produce `"<answer>Paris</answer>"`, the completion `"Paris</answer>"` does), or the action
   contains the whole completion (`env.submit(reply)`). Only the latest round (one request and its
   `n` siblings) before the action that produced it gets the credit: an earlier rejected attempt
   that happened to say the same thing is not trained, while every majority sibling that says the
   submitted answer is.
2. **Or it was carried into a later used call.** Its completion is contained in a message of a
   later call that the earlier call's prompt did not have (the harness appended it to the
   conversation, quoted it, ...) and that later call is itself used; transitively. A completion
   with tool calls is also carried when a later assistant message re-sends one of them.

`choices` picks count only as what was acted on: by rule 1 (the move played, the answer
submitted), or by rule 2 when a later message is exactly the pick (after its prefill). A pick
merely listed in a later prompt (all the legal moves) is not carried.

Known edges (the harness can mark either way): a sibling that mentions the submitted string
without concluding it is credited; a rejected reply the harness keeps in the conversation before
its retry (chess h0 does) is carried, so trained.

Text is compared with whitespace runs collapsed and case folded. Engines return text without the
stop string that ended it, so a harness re-appending the stop (`said = text + "</search>"`) still
contains it.

Overrides: a harness calls `completion.use()` or `completion.discard()` on what `llm` returned; the
parent records the mark on the call it returned (`record_mark`: only this episode's completions,
only a bool, the text must match) and the mark beats both rules. Never trained whatever the mark:
a call that errored, and a `choices` call with a single choice — that is not a sample, and
training on it would let a harness write its own targets.
"""

from __future__ import annotations

import json
from typing import Any

from whale.rollout.trajectory import LLMCall, Trajectory


def _norm(text: str | None) -> str:
    return " ".join(str(text or "").split()).casefold()


def rounds(calls: list[LLMCall]) -> list[list[int]]:
    """Call indices grouped by request: the `n` samples of one request are consecutive, 0..n-1."""
    out: list[list[int]] = []
    for i, call in enumerate(calls):
        if call.sample_index == 0 or not out:
            out.append([i])
        else:
            out[-1].append(i)
    return out


def returned_calls(traj: Trajectory) -> list[int]:
    """Indices of the calls whose completions the harness received, in the order it received
    them: rounds that errored were answered with an error, so the harness never saw them."""
    return [i for group in rounds(traj.calls)
            if not any(traj.calls[i].finish_reason == "error" for i in group) for i in group]


def record_mark(traj: Trajectory, ordinal: Any, used: Any, text: Any) -> str | None:
    """Record a harness's `completion.use()`/`.discard()`; return why it is refused, or None.

    `ordinal` counts the completions returned to this episode; `text` must be that completion's
    text, so a harness cannot aim at a call it was not given, and a mark changes nothing but
    whether a sampled call is trained."""
    if not isinstance(ordinal, int) or isinstance(ordinal, bool) or not isinstance(used, bool):
        return "mark needs an int 'call' and a bool 'used'"
    visible = returned_calls(traj)
    if not 0 <= ordinal < len(visible):
        return f"no completion #{ordinal} was returned to this episode"
    call = traj.calls[visible[ordinal]]
    if text != call.completion:
        return f"completion #{ordinal} does not match the text that was returned"
    if used and call.choices is not None and len(call.choices) == 1:
        return "a choices call with a single choice is not a sample and cannot be trained"
    call.mark = used
    return None


def _actions(traj: Trajectory) -> list[tuple[int, str, str]]:
    """(calls made before it, normalized text, description) of every action of the episode."""
    out = []
    for t, tool in enumerate(traj.tool_calls):
        if tool.error is not None:
            continue
        before = len(traj.calls) if tool.after_calls is None else tool.after_calls
        for value in list(tool.args) + list(tool.kwargs.values()):
            if isinstance(value, str) and _norm(value):
                out.append((before, _norm(value), f"produced the argument of env.{tool.name} (tool call {t})"))
    if traj.answer is not None and _norm(traj.answer):
        out.append((len(traj.calls), _norm(traj.answer), "produced the final answer"))
    return out


def _tool_signatures(tool_calls: Any) -> set[tuple[str, str]]:
    """(name, canonical arguments) of OpenAI-style tool calls; a harness may send anything here."""
    sigs: set[tuple[str, str]] = set()
    for tc in tool_calls if isinstance(tool_calls, list) else []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            continue
        args = fn.get("arguments")
        try:
            args = json.dumps(json.loads(args) if isinstance(args, str) else args, sort_keys=True)
        except (TypeError, ValueError):
            args = str(args)
        sigs.add((str(fn.get("name")), args))
    return sigs


def _carried(earlier: LLMCall, later: LLMCall) -> bool:
    """Is `earlier`'s output in a message of `later` that `earlier`'s own prompt did not have?"""
    seen = {(m.get("role"), m.get("content")) for m in earlier.messages}
    new = [m for m in later.messages if (m.get("role"), m.get("content")) not in seen]
    core = _norm(earlier.completion)
    if earlier.choices is not None:
        picks = {core, _norm((earlier.prefill or "") + earlier.completion)}
        return any(_norm(m.get("content")) in picks for m in new)
    if core and any(core in _norm(m.get("content")) for m in new):
        return True
    sigs = _tool_signatures(earlier.tool_calls)
    return bool(sigs) and any(sigs & _tool_signatures(m.get("tool_calls")) for m in new if m.get("role") == "assistant")


def _produces(call: LLMCall, action: str) -> bool:
    core = _norm(call.completion)
    written, prefill = _norm((call.prefill or "") + call.completion), _norm(call.prefill)
    return bool(core) and ((action in written and action not in prefill) or core in action)


def _never_trained(call: LLMCall) -> str | None:
    if call.finish_reason == "error":
        return "engine error"
    if call.choices is not None and len(call.choices) == 1:
        return "a single choice is not a sample"
    return None


def decide_usage(traj: Trajectory) -> None:
    """Set `used` and `use_reason` on every call of `traj` not decided yet (module docstring)."""
    calls = traj.calls
    if all(c.used is not None for c in calls):
        return
    credit: dict[int, str] = {}
    groups = rounds(calls)
    for before, action, why in _actions(traj):
        for group in reversed([g for g in groups if g[-1] < before]):
            producers = [i for i in group if _never_trained(calls[i]) is None and _produces(calls[i], action)]
            if producers:
                for i in producers:
                    credit.setdefault(i, why)
                break
    used = [False] * len(calls)
    for i in reversed(range(len(calls))):
        call = calls[i]
        if call.used is not None:  # decided before (a trajectory read back from a trace)
            used[i] = call.used
            continue
        if (never := _never_trained(call)) is not None:
            decision, reason = False, never
        elif call.mark is not None:
            decision, reason = call.mark, "marked used by the harness" if call.mark else "discarded by the harness"
        elif i in credit:
            decision, reason = True, credit[i]
        else:
            later = next((j for j in range(i + 1, len(calls)) if used[j] and _carried(call, calls[j])), None)
            decision = later is not None
            reason = (f"carried into the prompt of call {later}" if decision else
                      "its output reached no action and no later used call")
        used[i] = call.used = decision
        call.use_reason = reason
