"""The null-engine probe: does the model earn a harness's score, or the harness's own rules?

A search that optimizes code can find harnesses that win without the model: always playing the
first capture, submitting a fixed entity, computing the answer in Python from the question.
WHALE trains the weights on what the harness makes the model do, so such a harness would teach
the model nothing. The probe scores the same problems, paired, under the real engine and under
`NullEngine` (uniform among `choices`, random words otherwise) and flags the harness when the
real score is not at least `cfg.harness.null_probe_min_drop` above the null score.

Why paired and on >= 64 items: a difference of two independent small-sample means is noise;
the same problems with the same harness isolate the engine.
"""

from __future__ import annotations

from typing import Any

from whale.config import Config
from whale.engine.null import NullEngine


def null_probe(runner, harness_source: str, problems: list, cfg: Config, *, null_runner=None, domain=None,
               real_rewards: dict[str, float] | None = None, harness_id: str = "probe", seed: int = 0,
               ledger_callback=None) -> dict[str, Any]:
    """Return {real, null, drop, flagged, n, note}.

    `runner` is the real RolloutRunner; `null_runner` one over a NullEngine (built here from
    `domain` when not given). `real_rewards` (problem id -> mean reward), when the harness was
    already evaluated on these problems under the current weights, saves re-running the real side.
    Null rollouts are counted through `ledger_callback(purpose, trajectories)` with
    purpose "null_probe" (the runner also tags its episodes with it).
    """
    want = cfg.harness.null_probe_items
    items = list(problems)[:want]
    if not items:
        raise ValueError("null probe needs at least one problem")
    note = "" if len(items) >= want else f"only {len(items)} problems available (< null_probe_items={want})"
    own_null = null_runner is None
    if own_null:
        from whale.harness.runner import RolloutRunner

        if domain is None:
            raise ValueError("null_probe needs `domain` to build its null runner")
        null_runner = RolloutRunner(NullEngine(seed=cfg.seed), domain, cfg)
    try:
        real = dict(real_rewards or {})
        missing = [p for p in items if p.id not in real]
        if missing:
            trajs = runner.run(harness_source, missing, 1, harness_id=harness_id, seed=seed, purpose="null_probe")
            if ledger_callback:
                ledger_callback("null_probe", trajs)
            real.update(_per_problem(trajs))
        null_trajs = null_runner.run(harness_source, items, 1, harness_id=harness_id, seed=seed, purpose="null_probe")
        if ledger_callback:
            ledger_callback("null_probe", null_trajs)
    finally:
        if own_null:
            null_runner.close()
    null = _per_problem(null_trajs)
    real_mean = sum(real[p.id] for p in items) / len(items)
    null_mean = sum(null.get(p.id, 0.0) for p in items) / len(items)
    drop = real_mean - null_mean
    return {"real": real_mean, "null": null_mean, "drop": drop, "flagged": drop < cfg.harness.null_probe_min_drop,
            "n": len(items), "note": note}


def _per_problem(trajectories) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for t in trajectories:
        sums.setdefault(t.problem_id, []).append(float(t.reward))
    return {pid: sum(v) / len(v) for pid, v in sums.items()}
