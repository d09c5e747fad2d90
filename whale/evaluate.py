"""mean@k and pass@k of any (harness, weights) pair on any split, through the same runner.

mean@k (the paper's metric): for each problem take k samples and average the binary rewards, then
average over problems. pass@k: the share of problems with at least one success among the k.
Both come with a per-source breakdown and a bootstrap 95% interval over problems, because small
test sets (AIME has 60 problems) make a few points of difference noise.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from whale.config import Config
from whale.domains import Domain, load_domain
from whale.domains.base import Problem
from whale.engine import make_engine
from whale.executor import make_executor
from whale.rollout.runner import RolloutRunner, derive_seed
from whale.rollout.trajectory import Trajectory


@dataclass
class EvalResult:
    split: str
    k: int
    n: int  # problems
    mean_at_k: float
    pass_at_k: float
    rollouts: int
    ci95: tuple[float, float] = (0.0, 0.0)
    per_source: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    mean_llm_calls: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    harness_id: str = ""
    weights_version: str = ""
    per_problem: list[float] = field(default_factory=list)
    # None: not under a lockstep (samples depend on timing); 0: bit-reproducible; n: the engine
    # stopped waiting for n slow episodes, so a re-run agrees within sampling noise only
    lockstep_breaks: int | None = None

    def to_json(self, with_per_problem: bool = False) -> dict[str, Any]:
        row = asdict(self)
        row["ci95"] = list(self.ci95)
        if not with_per_problem:
            row.pop("per_problem")
        return row


def eval_seed(run_seed: int, split: str) -> int:
    """The seed of every evaluation of `split` in a run with `run_seed`, and of `whale eval` on it.

    One function for both, so `whale eval` on a run's (harness, weights) samples exactly what the
    run's evaluation sampled (per-episode seeds then derive from this, the problem and the sample).
    """
    return derive_seed(run_seed, "eval", split)


def bootstrap_ci(values: list[float], iters: int = 1000, seed: int = 0) -> tuple[float, float]:
    if not values:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    return (round(means[int(0.025 * iters)], 4), round(means[int(0.975 * iters) - 1], 4))


def _error_kind(error: str) -> str:
    for key in ("budget exceeded", "wall-time", "never submitted", "failed to load", "killed", "exited",
                "harness raised", "engine error", "grading failed", "runner error"):
        if key in error:
            return key
    return "other"


def summarize(trajectories: list[Trajectory], problems: list[Problem], k: int, split: str = "") -> EvalResult:
    by_problem: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        by_problem[t.problem_id].append(t.reward)
    per_problem = [sum(by_problem[p.id]) / max(1, len(by_problem[p.id])) for p in problems]
    passes = [1.0 if any(r > 0.5 for r in by_problem[p.id]) else 0.0 for p in problems]
    sources: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for p, m, s in zip(problems, per_problem, passes):
        sources[p.source or "all"].append((m, s))
    errors = [t.error for t in trajectories if t.error]
    kinds: dict[str, int] = defaultdict(int)
    for e in errors:
        kinds[_error_kind(e)] += 1
    n = len(problems)
    return EvalResult(
        split=split, k=k, n=n,
        mean_at_k=round(sum(per_problem) / n, 4) if n else 0.0,
        pass_at_k=round(sum(passes) / n, 4) if n else 0.0,
        rollouts=len(trajectories),
        ci95=bootstrap_ci(per_problem),
        per_source={s: {"n": len(v), "mean_at_k": round(sum(m for m, _ in v) / len(v), 4),
                        "pass_at_k": round(sum(x for _, x in v) / len(v), 4)} for s, v in sorted(sources.items())},
        errors=len(errors), error_kinds=dict(kinds),
        mean_llm_calls=round(sum(len(t.calls) for t in trajectories) / max(1, len(trajectories)), 3),
        prompt_tokens=sum(t.prompt_tokens for t in trajectories),
        completion_tokens=sum(t.completion_tokens for t in trajectories),
        harness_id=trajectories[0].harness_id if trajectories else "",
        weights_version=trajectories[0].weights_version if trajectories else "",
        per_problem=[round(x, 4) for x in per_problem],
    )


def evaluate(runner: RolloutRunner, harness_source: str, problems: list[Problem], k: int, *, split: str = "test",
             harness_id: str = "h0", seed: int = 0, progress: str | None = None,
             traces_path: str | Path | None = None, gold_in_traces: bool = True) -> tuple[EvalResult, list[Trajectory]]:
    trajs = runner.run(harness_source, problems, samples=k, harness_id=harness_id, seed=seed,
                       purpose="eval", progress=progress)
    result = summarize(trajs, problems, k, split)
    result.lockstep_breaks = runner.last_lockstep_breaks
    if traces_path is not None:
        gold = {p.id: p.answer for p in problems}
        path = Path(traces_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for t in trajs:
                f.write(json.dumps(t.to_json(gold=gold[t.problem_id] if gold_in_traces else None,
                                             include_ids=False)) + "\n")
    return result, trajs


class Evaluator:
    """The one way a (harness, weights) pair is measured: a config's domain and splits, its engine,
    and a runner on that engine; `measure` evaluates a harness on a split with the split's seed.

    A run's evaluations, `whale eval` and `whale matrix` all measure through it, so a number from
    any of them is the same measurement: the same problems (`eval.limit`), k, seeds
    (`eval_seed(seed, split)`) and runner. Give `domain` and `splits` when the caller has loaded
    (and checked) them already. The engine serves whatever weights were last loaded into it.
    """

    def __init__(self, cfg: Config, domain: Domain | None = None, splits: dict[str, list[Problem]] | None = None):
        self.cfg = cfg
        self.domain = domain if domain is not None else load_domain(cfg)
        self.splits = splits if splits is not None else self.domain.load_splits()
        self.engine = make_engine(cfg)
        try:
            self.runner = make_executor(cfg, self.engine, self.domain)
        except BaseException:
            self.engine.close()
            raise

    def problems(self, split: str, limit: int | None = None) -> list[Problem]:
        """The first `limit` problems of `split` (default `eval.limit`; None or 0: all)."""
        limit = self.cfg.eval.limit if limit is None else limit
        return self.splits[split][: limit or None]

    def measure(self, source: str, split: str, *, harness_id: str, k: int | None = None, limit: int | None = None,
                progress: str | None = None, traces_path: str | Path | None = None) -> tuple[EvalResult, list[Trajectory]]:
        return evaluate(self.runner, source, self.problems(split, limit), self.cfg.eval.k if k is None else k,
                        split=split, harness_id=harness_id, seed=eval_seed(self.cfg.seed, split), progress=progress,
                        traces_path=traces_path)

    def close(self) -> None:
        try:
            self.runner.close()
        finally:
            self.engine.close()

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
