"""ReasoningGymDomain: reasoning-gym tasks as one WHALE domain (a weighted mixture of tasks).

`domain.options`:
- `tasks`: task names from reasoning-gym's registry (a list, or one name);
- `weights`: task -> share of every split (default: equal shares);
- `config`: task -> generator config, the keyword arguments of the task's config dataclass
  (e.g. `{basic_arithmetic: {max_terms: 3, max_digits: 2}}`).

The environment has no tools besides `env.submit`: these are single-answer reasoning tasks. The
reward is the task's own `score_answer` (grading.py), `Problem.source` is the task name, so every
evaluation and report breaks mean@k down per task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from whale.config import Config, ConfigError
from whale.domains.base import AnswerFormat, EpisodeEnv, Problem, split_sizes
from whale.domains.reasoning_gym import data
from whale.domains.reasoning_gym.grading import grade_reasoning_gym
from whale.harness.mechanism import NO_HINTS

OPTIONS = ("tasks", "weights", "config")

BRIEF = """\
Domain: reasoning-gym procedural tasks ({tasks}).
Episode: `env.question` (str) is the task's prompt, which states the expected answer format.
The only tool is `env.submit(text: str)`, once per episode.
Grading: the LAST <answer>...</answer> in the submitted text is scored by the task's own
reasoning-gym scorer (no tag scores 0); scores are in [0, 1] (mostly 1 or 0; some tasks give
partial credit). Put only the final answer inside the tags, in the format the question asks.
Harness code may use only the standard library, `env` and `llm`."""


class ReasoningGymDomain:
    name = "reasoning_gym"
    answer_format = AnswerFormat("the final answer alone inside <answer></answer>",
                                 pattern=r"<answer>\s?(.*?)\s?</answer>", open="<answer>", close="</answer>")
    hints = NO_HINTS  # no knowledge of these tasks beyond their declared answer format

    def __init__(self, cfg: Config):
        self.cfg = cfg
        opts = dict(cfg.domain.options)
        try:
            self.tasks, self.configs = parse_options(opts)
        except data.TaskError as e:
            raise ConfigError(str(e)) from None
        self.brief = BRIEF.format(tasks=", ".join(f"{t} ({w:g})" for t, w in self.tasks.items()))
        self._splits: dict[str, list[Problem]] | None = None

    def load_splits(self) -> dict[str, list[Problem]]:
        if self._splits is None:
            try:
                self._splits = data.make_splits(self.tasks, self.configs, split_sizes(self.cfg.domain.splits),
                                                self.cfg.seed)
            except data.TaskError as e:
                raise ConfigError(str(e)) from None
        return self._splits

    def make_env(self, problem: Problem) -> EpisodeEnv:
        return EpisodeEnv(problem)

    def grade(self, problem: Problem, answer: str | None) -> float:
        return grade_reasoning_gym(problem, answer)

    def grader(self) -> Callable[[Problem, str | None], float]:
        return grade_reasoning_gym

    def base_harness(self) -> str:
        return Path(__file__).with_name("h0.py").read_text(encoding="utf-8")


def parse_options(opts: dict[str, Any]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """(task -> weight, task -> generator config) from `domain.options`, every name checked."""
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise data.TaskError(f"reasoning_gym: unknown domain.options {unknown}; known: {', '.join(OPTIONS)}")
    tasks = opts.get("tasks")
    if isinstance(tasks, str):
        tasks = [tasks]
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise data.TaskError("reasoning_gym needs domain.options.tasks: a list of reasoning-gym task names, "
                             "e.g. --set 'domain.options.tasks=[chain_sum,letter_counting]'")
    for t in tasks:
        data.check_task(t)
    weights = opts.get("weights") or {}
    configs = opts.get("config") or {}
    for what, table in (("weights", weights), ("config", configs)):
        if not isinstance(table, dict):
            raise data.TaskError(f"reasoning_gym: domain.options.{what} must map task names to values")
        stray = sorted(set(table) - set(tasks))
        if stray:
            raise data.TaskError(f"reasoning_gym: domain.options.{what} names {stray}, which are not in "
                                 f"domain.options.tasks {tasks}")
    try:
        mix = {t: float(weights.get(t, 1.0)) for t in dict.fromkeys(tasks)}
    except (TypeError, ValueError):
        raise data.TaskError(f"reasoning_gym: domain.options.weights must be numbers (got {weights})") from None
    if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise data.TaskError(f"reasoning_gym: task weights must be >= 0 with a positive sum (got {mix})")
    for t, c in configs.items():
        if not isinstance(c, dict):
            raise data.TaskError(f"reasoning_gym: domain.options.config.{t} must be a mapping of generator settings")
        if {"seed", "size"} & set(c):
            raise data.TaskError(f"reasoning_gym: domain.options.config.{t} may not set seed or size "
                                 "(they come from the run seed and the split sizes)")
        data.make_dataset(t, c, size=1)  # a bad setting fails now, naming the task
    return {t: w for t, w in mix.items() if w > 0}, {t: dict(c) for t, c in configs.items()}
