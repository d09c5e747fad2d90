"""The null-engine probe: does the model earn a harness's score, or the harness's own rules?

A search that optimizes code can find harnesses that win without the model: always playing the
first capture, submitting a fixed entity, computing the answer in Python from the question.
WHALE trains the weights on what the harness makes the model do, so such a harness would teach
the model nothing. The probe runs the same problems with the same sampling seeds under
`NullEngine` (uniform among `choices`, random words otherwise) and compares, problem by problem,
with the real engine's success on FRESH samples (the confirmation samples of acceptance.py, or
its own fresh run), never with the selection traces that made the harness look good.

The harness is flagged when the null engine scores at all and the model's paired advantage over
it is not shown: the one-sided sign-flip test of (real - null) per problem has p > alpha (the
search's `harness.accept_alpha`), or the advantage is at most `harness.null_probe_min_drop`.
Why not an absolute cutoff (the old rule flagged real - null < 0.05): it rejects every real gain
near zero, however many problems show it, and lets a large noisy difference through. And why the
exemption when the null engine scores nothing: then the harness earns nothing by itself, so
whatever it scores, the model earned.
"""

from __future__ import annotations

from typing import Any

from whale.config import Config
from whale.engine.null import NullEngine
from whale.rollout.runner import RolloutRunner
from whale.harness.acceptance import paired_test, per_problem, recorded_p


def null_probe(runner, harness_source: str, problems: list, cfg: Config, *, null_runner=None, domain=None,
               real_rewards: dict[str, float] | None = None, harness_id: str = "probe", seed: int = 0,
               samples: int = 1, ledger_callback=None) -> dict[str, Any]:
    """Return {real, null, drop, p, flagged, n, note}.

    `runner` is the real RolloutRunner; `null_runner` one over a NullEngine (built here from
    `domain` when not given). `real_rewards` (problem id -> mean reward on fresh samples drawn
    with `seed`) saves re-running the real side; problems it lacks are run here. Rollouts are
    counted through `ledger_callback(purpose, trajectories)` with purpose "null_probe".
    """
    want = cfg.harness.null_probe_items
    items = list(problems)[:want]
    if not items:
        raise ValueError("null probe needs at least one problem")
    note = "" if len(items) >= want else f"only {len(items)} problems available (< null_probe_items={want})"
    own_null = null_runner is None
    if own_null:
        if domain is None:
            raise ValueError("null_probe needs `domain` to build its null runner")
        null_runner = RolloutRunner(NullEngine(seed=cfg.seed), domain, cfg)
    try:
        real = dict(real_rewards or {})
        missing = [p for p in items if p.id not in real]
        if missing:
            trajs = runner.run(harness_source, missing, samples, harness_id=harness_id, seed=seed, purpose="null_probe")
            if ledger_callback:
                ledger_callback("null_probe", trajs)
            real.update(per_problem(trajs))
        null_trajs = null_runner.run(harness_source, items, samples, harness_id=harness_id, seed=seed,
                                     purpose="null_probe")
        if ledger_callback:
            ledger_callback("null_probe", null_trajs)
    finally:
        if own_null:
            null_runner.close()
    null = {p.id: 0.0 for p in items} | per_problem(null_trajs)
    test = paired_test({p.id: real[p.id] for p in items}, null)
    shown = test.p <= cfg.harness.accept_alpha and test.gain > cfg.harness.null_probe_min_drop
    flagged = test.mean_b > 0 and not shown
    return {"real": round(test.mean_a, 4), "null": round(test.mean_b, 4), "drop": round(test.gain, 4),
            "p": recorded_p(test.p), "flagged": flagged, "n": len(items), "note": note}
