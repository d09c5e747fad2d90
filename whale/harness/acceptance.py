"""Decision rules that sampling noise cannot fool: paired tests on per-problem success rates.

Why: the search scores M candidates per iteration on a few dozen problems at temperature 1 and
keeps the best. The best of several noisy scores is biased upward (the winner's curse): with 16
problems x 1 sample, one of four candidates identical to the incoming harness beats it by chance
most of the time. So a candidate replaces the incoming harness only when a *paired* test on
*fresh* samples says it is better:

1. selection: candidates are ranked on the selection traces (same problems and sampling seeds
   for every candidate under one weights version: common random numbers);
2. confirmation: the top `harness.confirm_top` candidates that beat the incoming harness there,
   and the incoming harness itself, are re-run on the same problems with new seeds
   (`harness.confirm_samples` samples per problem; ledger purpose `confirm`);
3. acceptance: a candidate passes when its paired gain on the fresh samples exceeds
   `harness.accept_margin` and the one-sided sign-flip test gives p <= accept_alpha / (number of
   confirmed candidates) (Bonferroni); the passing candidate with the best fresh score wins.
   Without confirmation (`confirm_top: 0`) the same test runs on the selection traces, with
   alpha divided by the number of candidates the selection chose among.
4. sequential confirmation (`harness.confirm_rounds` R > 1): when no candidate passes, the
   candidates still ahead (paired gain > margin) and the incoming harness are re-run on new seeds
   again, and the test is repeated on the rounds pooled (per problem, the mean over rounds), up to
   R rounds. Every round tests at accept_alpha / (candidates x R): by the union bound over the
   rounds and candidates, an equal candidate is accepted with probability at most accept_alpha,
   however the rounds went. Dropping a candidate that is not ahead only removes chances to
   reject, so it keeps that bound. Why: one round sized for the typical phase is underpowered
   for a small true gain (+0.06 on 64 problems x 2 samples: accepted about 30% of the time at
   one round, 50-55% with R = 3 for 2.2-2.3 rounds on average, equal candidates still under
   0.05; tests/test_acceptance.py), and a clear gain or a clear loss still costs one round.

Why a sign-flip (paired permutation) test and not a bootstrap interval: under "no difference"
each problem's difference is as likely positive as negative, which the test enumerates exactly
(or samples, for many non-zero differences). A percentile bootstrap of a few non-zero
differences is too narrow: 3 problems won and none lost out of 32 gives a bootstrap lower bound
above zero, while the exact p-value is 1/8.

The null-engine probe (guard.py) uses the same test on fresh samples: real model against the
null engine, same problems and seeds.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

EXACT_MAX_SUMS = 20_000  # distinct values of the signed sum kept exactly
MC_DRAWS = 20_000


def per_problem(trajectories: Iterable[Any]) -> dict[str, float]:
    """problem id -> mean reward, from Trajectory objects or trace rows (dicts)."""
    sums: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        pid, reward = (t["problem_id"], t["reward"]) if isinstance(t, dict) else (t.problem_id, t.reward)
        sums[pid].append(float(reward))
    return {pid: sum(v) / len(v) for pid, v in sums.items()}


def sign_flip_p(diffs: list[float], seed: int = 0) -> float:
    """One-sided p-value of mean(diffs) > 0 under random signs (ties count against the gain).

    Exact: the distribution of the signed sum is built one difference at a time (per-problem
    rates are multiples of 1/k, so it has few distinct values); if it grows past EXACT_MAX_SUMS
    values (arbitrary floats), the p-value is estimated from MC_DRAWS seeded sign draws."""
    nonzero = [d for d in diffs if abs(d) > 1e-12]
    if not nonzero:
        return 1.0
    observed = sum(nonzero)
    dist: dict[float, float] = {0.0: 1.0}
    for d in nonzero:
        nxt: dict[float, float] = defaultdict(float)
        for total, prob in dist.items():
            nxt[round(total + d, 9)] += prob / 2
            nxt[round(total - d, 9)] += prob / 2
        dist = nxt
        if len(dist) > EXACT_MAX_SUMS:
            rng = random.Random(seed)
            hits = sum(1 for _ in range(MC_DRAWS)
                       if sum(x if rng.random() < 0.5 else -x for x in nonzero) >= observed - 1e-9)
            return (hits + 1) / (MC_DRAWS + 1)
    return min(1.0, sum(prob for total, prob in dist.items() if total >= observed - 1e-9))


@dataclass
class PairedTest:
    n: int  # problems in both
    mean_a: float
    mean_b: float
    gain: float  # mean over problems of a - b
    p: float  # one-sided sign-flip p-value of gain > 0

    def to_json(self) -> dict[str, Any]:
        """Rates to 4 decimals; p as `recorded_p`."""
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["p"] = recorded_p(self.p)
        return out


def recorded_p(p: float) -> float:
    """A p-value as metrics keep it: 3 significant digits (to 4 decimals a p of 2e-5 would be 0)."""
    return float(f"{p:.3g}")


def paired_test(a: dict[str, float], b: dict[str, float], seed: int = 0) -> PairedTest:
    """Compare per-problem rates of A against B on the problems both were run on."""
    common = sorted(set(a) & set(b))
    if not common:
        return PairedTest(0, 0.0, 0.0, 0.0, 1.0)
    diffs = [a[p] - b[p] for p in common]
    return PairedTest(len(common), sum(a[p] for p in common) / len(common), sum(b[p] for p in common) / len(common),
                      sum(diffs) / len(diffs), sign_flip_p(diffs, seed))


def pooled(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per-problem mean over rounds of equal samples per problem, on the problems every round has."""
    if not rounds:
        return {}
    common = set(rounds[0]).intersection(*rounds[1:])
    return {p: sum(r[p] for r in rounds) / len(rounds) for p in rounds[0] if p in common}


def choose(incoming: dict[str, float], candidates: dict[str, dict[str, float]], *, alpha: float,
           margin: float = 0.0, family: int | None = None) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """The candidate (id) that beats `incoming` by the rule above, or None; and every test.

    `candidates` is ordered by selection rank (ties in the fresh score go to the earlier one);
    alpha is split evenly over `family` tests (Bonferroni; default: one per candidate; sequential
    confirmation passes candidates x rounds)."""
    level = alpha / max(1, family if family is not None else len(candidates))
    tests, passing = {}, []
    for rank, (cid, rates) in enumerate(candidates.items()):
        t = paired_test(rates, incoming)
        ok = t.n > 0 and t.gain > margin and t.p <= level
        tests[cid] = {**t.to_json(), "level": round(level, 4), "passes": ok}
        if ok:
            passing.append((-t.mean_a, rank, cid))
    return (min(passing)[2] if passing else None), tests


def confirm_sequentially(draw: Callable[[str, int], dict[str, float]], incoming: str, chosen: list[str], *,
                         alpha: float, margin: float = 0.0, rounds: int = 1,
                         more: Callable[[list[str], int], bool] | None = None
                         ) -> tuple[dict[str, dict[str, float]], list[dict[str, dict[str, Any]]]]:
    """Rule 4: `draw(harness id, round index)` gives that harness's fresh per-problem rates of one
    round; `more(candidates still ahead, round index)`, asked before every round after the first,
    may refuse it (the budget), which ends the confirmation as it stands: a refused round only
    removes chances to accept, so the bound holds. Returns the pooled rates of the candidates
    tested last and every round's tests, in order (the last round's say which pass)."""
    base_rounds: list[dict[str, float]] = []
    cand_rounds: dict[str, list[dict[str, float]]] = {cid: [] for cid in chosen}
    alive, history, rates = list(chosen), [], {}
    for r in range(rounds):
        if r and more is not None and not more(alive, r):
            break
        base_rounds.append(draw(incoming, r))
        for cid in alive:
            cand_rounds[cid].append(draw(cid, r))
        rates = {cid: pooled(cand_rounds[cid]) for cid in alive}
        _, tests = choose(pooled(base_rounds), rates, alpha=alpha, margin=margin, family=len(chosen) * rounds)
        history.append(tests)
        alive = [cid for cid in alive if tests[cid]["gain"] > margin]
        if not alive or any(t["passes"] for t in tests.values()):
            break
    return rates, history
