"""VerifiersDomain: a verifiers environment's rows, tools, protocol and rubric as a WHALE domain.

`domain.options`:
- `env`: "package.module:load_environment" (or the module alone), the environment's factory;
- `args`: keyword arguments for it (what `vf-eval -a '{...}'` would pass).

Rows become problems: `env.dataset` feeds the weight and harness splits, `env.eval_dataset` (when
the environment has one) val and test, else all four come from `env.dataset`; disjoint by prompt
text, deterministic from the seed (the search-QA split rules). `Problem.source` is the row's
`task` column (else the environment's name), so reports break results down by task.

The environment's tools become `env` tools: `env.<tool>(**kwargs)` and `env.call_tool(name,
arguments_json)`, run in the parent as ToolEnv runs them (an exception becomes the tool message).
The rubric is the verifier (scoring.py), run in the grading processes. h0 replays the
environment's protocol (h0.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import warnings
from pathlib import Path
from typing import Any, Callable

from whale.config import Config, ConfigError
from whale.domains.base import EpisodeEnv, EpisodeError, Problem
from whale.domains.searchqa.data import make_splits
from whale.domains.verifiers_env import loader
from whale.domains.verifiers_env.scoring import completion_messages, grade_verifiers
from whale.harness.mechanism import NO_HINTS

OPTIONS = ("env", "args")
MAX_CALL_ID = 64

BRIEF = """\
Domain: the verifiers environment {spec} ({kind}, {n_tools} tool(s), max_turns {max_turns}).
Episode: `env.question` (the last user message), `env.prompt` (the environment's chat messages for
this row: system prompt, few-shot turns, question), `env.tool_schemas` (OpenAI-style schemas, pass
them as llm(..., tools=env.tool_schemas)), `env.max_turns`.
Tools: {tools}`env.call_tool(name, arguments_json, turn=i)` runs a tool call the way the
environment does and returns the tool message text (an error becomes that text);
`env.submit(text)` ends the episode, once.
Grading: the environment's own rubric scores the transcript the parent recorded (the executed tool
calls grouped by `turn`, then the submitted text as the final assistant message); rewards are the
rubric's weighted sums{rubric}.
What helps a small model: a format the environment's parser accepts (see the system prompt), an
assistant prefill of that format, fewer turns. Harness code may use only the standard library,
`env` and `llm`."""


class VerifiersEnv(EpisodeEnv):
    """One episode of a verifiers environment; subclassed per domain with one method per tool."""

    tools: tuple[str, ...] = ("call_tool",)

    def __init__(self, problem: Problem, vf_env: Any, schemas: list[dict[str, Any]]):
        super().__init__(problem)
        self._vf_env = vf_env
        self._schemas = schemas
        self.calls: list[dict[str, Any]] = []

    def public_state(self) -> dict[str, Any]:
        return {"question": self.problem.question, "prompt": self.problem.meta["row"]["prompt"],
                "tool_schemas": self._schemas, "max_turns": int(self._vf_env.max_turns)}

    def call_tool(self, name: str, arguments: Any = "{}", turn: int | None = None, call_id: str | None = None) -> str:
        """ToolEnv's handling of one call: parse the arguments, run the tool, its text or the error.
        Calls with the same `turn` form one assistant message; without a turn a call is a turn of its own."""
        if not isinstance(name, str) or (turn is not None and (not isinstance(turn, int) or isinstance(turn, bool))):
            raise EpisodeError("env.call_tool(name: str, arguments: JSON string or dict, turn: int | None)")
        if call_id is not None and (not isinstance(call_id, str) or len(call_id) > MAX_CALL_ID):
            raise EpisodeError(f"env.call_tool: call_id must be a string of at most {MAX_CALL_ID} characters")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        vf_env = self._vf_env
        try:
            kwargs = json.loads(text)
            tool = vf_env.tool_map[name]
            result = asyncio.run(_maybe_await(tool, kwargs))
            content = str(result)
        except Exception as e:  # noqa: BLE001 - ToolEnv returns the error as the tool message
            content = vf_env.error_formatter(e)
        self.calls.append({"turn": f"call-{len(self.calls)}" if turn is None else turn, "id": call_id or f"call_{len(self.calls)}", "name": name,
                           "arguments": text, "content": content})
        return content

    def final_answer(self) -> str | None:
        """The recorded transcript, as JSON: what the rubric scores (scoring.py)."""
        if self.submitted is None:
            return None
        return json.dumps({"completion": completion_messages(self.calls, self.submitted)})


async def _maybe_await(tool: Callable, kwargs: dict[str, Any]) -> Any:
    result = tool(**kwargs)
    return await result if asyncio.iscoroutine(result) else result


def _tool_method(name: str) -> Callable:
    def method(self, **kwargs):
        return self.call_tool(name, json.dumps(kwargs))
    method.__name__ = name
    method.__doc__ = f"The environment's tool {name!r} (see env.tool_schemas)."
    return method


class VerifiersDomain:
    name = "verifiers"
    answer_format = None  # the environment's own parser reads the transcript; nothing declared to rely on
    hints = NO_HINTS

    def __init__(self, cfg: Config):
        self.cfg = cfg
        opts = dict(cfg.domain.options)
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ConfigError(f"verifiers: unknown domain.options {unknown}; known: {', '.join(OPTIONS)}")
        self.spec, self.args = opts.get("env"), opts.get("args") or {}
        if not isinstance(self.args, dict):
            raise ConfigError("verifiers: domain.options.args must be a mapping of load_environment arguments")
        try:
            loader.split_spec(self.spec)
            self.vf_env = loader.load_environment(self.spec, self.args)
            self.rows = {w: loader.dataset_rows(self.vf_env, self.spec, w) for w in ("dataset", "eval_dataset")}
        except loader.VerifiersEnvError as e:
            raise ConfigError(str(e)) from None
        if not self.rows["dataset"] and not self.rows["eval_dataset"]:
            raise ConfigError(f"verifiers env {self.spec!r} has no dataset rows")
        self.schemas = loader.tool_schemas(self.vf_env)
        tool_names = tuple(s["function"]["name"] for s in self.schemas)
        clash = sorted(set(tool_names) & set(dir(VerifiersEnv)))
        if clash:
            raise ConfigError(f"verifiers env {self.spec!r}: tool name(s) {clash} clash with env members "
                              "(call them through env.call_tool)")
        self.env_class = type("VerifiersEnv", (VerifiersEnv,), {"tools": ("call_tool", *tool_names),
                                                               **{n: _tool_method(n) for n in tool_names}})
        max_turns = int(self.vf_env.max_turns)
        if max_turns > cfg.domain.budget.llm_calls:
            warnings.warn(f"verifiers env {self.spec!r} allows {max_turns} turns but domain.budget.llm_calls is "
                          f"{cfg.domain.budget.llm_calls}: episodes that use every turn will hit the budget",
                          RuntimeWarning, stacklevel=2)
        funcs = _rubric_summary(self.vf_env.rubric)
        self.brief = BRIEF.format(
            spec=self.spec, kind=type(self.vf_env).__name__, n_tools=len(tool_names), max_turns=max_turns,
            tools="".join(f"`env.{n}(**arguments)`, " for n in tool_names),
            rubric=f" ({funcs})" if funcs else "")
        self._splits: dict[str, list[Problem]] | None = None

    def load_splits(self) -> dict[str, list[Problem]]:
        if self._splits is None:
            sizes = self.cfg.domain.splits.model_dump()
            main = self._problems("dataset") or self._problems("eval_dataset")
            held_out = self._problems("eval_dataset") if self.rows["dataset"] and self.rows["eval_dataset"] else None
            try:
                self._splits = make_splits(main, sizes, self.cfg.seed, f"verifiers env {self.spec!r}", held_out)
            except ValueError as e:  # the shared split helper's message, under this domain's name
                raise ConfigError(str(e).removeprefix("searchqa: ").replace("(test_path)", "(eval_dataset)")) from None
        return self._splits

    def make_env(self, problem: Problem) -> VerifiersEnv:
        return self.env_class(problem, self.vf_env, self.schemas)

    def grader(self) -> Callable[[Problem, str | None], float]:
        return functools.partial(grade_verifiers, spec=self.spec, args=self.args)

    def grade(self, problem: Problem, answer: str | None) -> float:
        return grade_verifiers(problem, answer, spec=self.spec, args=self.args)

    def base_harness(self) -> str:
        return Path(__file__).with_name("h0.py").read_text(encoding="utf-8")

    def _problems(self, which: str) -> list[Problem]:
        label = self.spec.partition(":")[0].rsplit(".", 1)[-1]
        out = []
        for n, row in enumerate(self.rows[which]):
            user = [m for m in row["prompt"] if m.get("role") == "user"]
            question = str(user[-1].get("content", "")) if user else json.dumps(row["prompt"])
            out.append(Problem(id=f"{which}-{row.get('example_id', n)}", question=question, answer=row.get("answer"),
                               source=str(row.get("task") or label), meta={"row": row}))
        return out


def _rubric_summary(rubric: Any) -> str:
    """'correct_answer x1.0, short_reply x0.5' over the rubric (and a RubricGroup's members)."""
    parts = []
    for r in getattr(rubric, "rubrics", None) or [rubric]:
        parts += [f"{getattr(f, '__name__', 'reward')} x{w:g}" for f, w in zip(r.funcs, r.weights) if w]
    return ", ".join(parts)
