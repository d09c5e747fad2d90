"""When to switch between the weight phase and the harness phase.

All conditions of the paper run through this one state machine, so they differ only in the
decisions below, never in how a phase runs:

| kind          | phases                                                         |
|---------------|----------------------------------------------------------------|
| whale         | weight (E epochs) -> harness (I iterations) -> weight -> ...     |
| whale+adaptive| weight until patience -> harness until patience (min/max) -> ... |
| weight_only   | weight until the budget ends                                   |
| harness_only  | one harness phase until the budget ends, weights frozen (or,   |
|               | with repeat_harness_phases, phases of I iterations until then) |
| prompt_only   | as whale, but the search may edit only the prompt constants    |
| stagewise     | all weight epochs, then all harness iterations                 |
| gain          | after each phase, the side with the higher recent gain per rollout |

Adaptive (`schedule.adaptive: true`, any alternating kind): a weight phase lasts at least
`min_weight_steps` and ends when the training accept rate, smoothed over
`weight_patience.window` steps, has set no new phase-best for `weight_patience.patience` steps
after `burn_in` (weights/patience.py, the paper's early stop); a harness phase runs at least
1 + harness.min_iterations and at most 1 + harness.max_iterations iterations and ends after
harness.patience iterations without a new best success rate (harness/loop.py).

Cost-aware (`kind: gain`, new here: neither WHALE, Meta-Harness nor BetterTogether has it).
Phases keep their lengths (E steps / I iterations, or adaptive), but which side runs next is
decided from what each side bought per budget rollout the last time it ran:
- weight gain per rollout: the least-squares slope of the training accept rate over the
  phase's steps, divided by the rollouts of one step (a weight phase under `gain` has at least
  2 steps, so a slope exists);
- harness gain per rollout: the accepted harness's paired gain over the incoming one on fresh
  samples of D_harness (acceptance.py; 0 when the incoming harness is kept), divided by the
  phase's budget rollouts (re-scoring, candidates, confirmation).
Both are changes in the success rate of the current (harness, weights) on training-distribution
problems, measured on rollouts the phase spends anyway: no extra probe, and neither is the
selection score that made a candidate look good. Rule, after every phase:
1. each side runs once first (weight, then harness: the paper's order);
1b. a harness phase that replaced the harness is followed by a weight phase if the weight side
   has gained at all in this run, or has not yet run under a harness the search accepted: its
   last gain was measured under the harness that was replaced, and a better harness changes what
   RSFT can learn from (measured, comparison seed 0: under h0 the weight steps accepted 0-1 of
   32; under the accepted h4 the next ones accepted 11-27 of 32, while a second harness phase
   under the same weights, chosen on the stale estimate, spent 192 rollouts and found nothing).
   Why the second condition: round 3's seed 1 accepted 0 of 32 under h0 (a weight gain of
   exactly 0, so the first condition could not fire), the search replaced h0 (+0.22 fresh), and
   a second harness phase under the same weights spent 512 rollouts and found nothing. A weight
   side that has had its turn under a searched harness and still never paid is not forced
   again (harness-bound domains: one weight phase of retry, then WHH...);
2. exploration with backoff: once one side has run `gain_explore` phases in a row, the other
   runs next, so a stalled side is retried (its gain may have changed: the two sides are coupled);
   the wait doubles for each of the other side's latest phases in a row that gained nothing (at
   most 8x), so a side that keeps coming back empty costs less and less of the budget;
3. if either side gained last time it ran, the one with the higher gain per rollout runs next (a
   tie goes to the other side);
4. if neither did, the side with the higher gain per rollout over the whole run so far runs (a
   tie: alternate, as WHALE does), so one noisy non-positive weight phase does not hand the
   budget to a harness side that has never paid.
Why the backoff and rule 4 (measured, comparison seed 1): accept-rate slopes over 4 steps are
noisy (two of six readings came out < 0 while val rose 0.01 -> 0.39), and the plain rule
"alternate when nothing gained" gave three harness phases that found nothing 800 of 1,536
budget rollouts (576 candidate, 96 re-scoring, 128 confirmation).
Budgets are checked as for whale: a harness phase is chosen only when a weight step can follow.

Budgets (epochs of D_weight, weight steps, or total budget rollouts = weight + harness-search
rollouts) end a run only at a unit boundary; by default a whale run does not start a harness phase
it could not follow with a weight step, so it ends on a weight phase, as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict

from whale.config import Config


@dataclass
class Progress:
    """What the schedule looks at: counters the run keeps in state.json (`RunState.progress`)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # state.json's progress: an unknown key is an error

    weight_steps: int = 0  # total weight steps done
    phase_steps: int = 0  # weight steps in the current weight phase
    harness_phases: int = 0  # harness phases completed
    harness_iterations: int = 0  # total harness iterations done (incl. re-scoring)
    budget_rollouts: int = 0
    patience_stop: bool = False  # the weight-phase patience rule fired
    phase_start_rollouts: int = 0  # budget rollouts when the current phase began
    phase_accept_rates: list[float] = field(default_factory=list)  # accept rate of each step of this weight phase
    gains: list[dict[str, Any]] = field(default_factory=list)  # one row per finished phase (kind gain reads it)


class Schedule:
    def __init__(self, cfg: Config, steps_per_epoch: int, harness_iteration_cost: int, weight_step_cost: int,
                 harness_phase_extra: int = 0):
        self.cfg = cfg.schedule
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.harness_iteration_cost = harness_iteration_cost  # rollouts of one harness iteration
        self.weight_step_cost = weight_step_cost
        self.harness_phase_extra = harness_phase_extra  # at most this many confirmation rollouts per phase

    @classmethod
    def for_config(cls, cfg: Config, steps_per_epoch: int, harness_problems: int) -> "Schedule":
        """The schedule of `cfg` with its rollout costs: one harness iteration (M candidates on the
        harness split), one weight step, and a phase's confirmation re-run (the top candidates and
        the incoming harness on fresh seeds: its first round; none without confirmation). Later
        rounds of a sequential confirmation are not reserved: they run only if `can_spend` allows."""
        h, w = cfg.harness, cfg.weight
        iteration_cost = h.candidates_per_iteration * harness_problems * h.samples_per_example
        confirm_cost = (h.confirm_top + 1) * harness_problems * h.confirm_samples if h.confirm_top else 0
        return cls(cfg, steps_per_epoch, iteration_cost, w.problems_per_step * w.samples_per_problem, confirm_cost)

    @property
    def kind(self) -> str:
        return self.cfg.kind

    @property
    def prompt_only(self) -> bool:
        return self.cfg.kind == "prompt_only"

    @property
    def trains_weights(self) -> bool:
        return self.cfg.kind != "harness_only"

    @property
    def searches_harness(self) -> bool:
        return self.cfg.kind != "weight_only"

    # ------------------------------------------------------------------ budgets
    def max_weight_steps(self) -> int | None:
        limits = []
        if self.cfg.budget_steps is not None:
            limits.append(self.cfg.budget_steps)
        if self.cfg.budget_epochs is not None and self.trains_weights:
            limits.append(math.ceil(self.cfg.budget_epochs * self.steps_per_epoch - 1e-9))
        return min(limits) if limits else None

    def budget_left(self, p: Progress) -> int | None:
        if self.cfg.budget_rollouts is None:
            return None
        return self.cfg.budget_rollouts - p.budget_rollouts

    def weight_budget_spent(self, p: Progress) -> bool:
        cap = self.max_weight_steps()
        if cap is not None and p.weight_steps >= cap:
            return True
        left = self.budget_left(p)
        return left is not None and left <= 0

    def phase_steps_fixed(self) -> int:
        """Weight steps per weight phase under the fixed schedule (at least one)."""
        least = 2 if self.kind == "gain" else 1  # a gain-per-rollout slope needs two accept rates
        return max(least, round(self.cfg.weight_epochs * self.steps_per_epoch))

    # ------------------------------------------------------------------ decisions
    def first_phase(self) -> str:
        return "harness" if self.kind == "harness_only" else "weight"

    def weight_phase_over(self, p: Progress) -> bool:
        """After each weight step: does the weight phase end here?"""
        if self.weight_budget_spent(p):
            return True
        if self.kind in ("weight_only",):
            return False
        if self.kind == "stagewise":
            return False  # stagewise: one weight stage, ended by the budget only
        if self.cfg.adaptive:
            least = max(self.cfg.min_weight_steps, 2 if self.kind == "gain" else 1)
            return p.phase_steps >= least and p.patience_stop
        return p.phase_steps >= self.phase_steps_fixed()

    def after_weight_phase(self, p: Progress) -> str:
        if self.kind == "weight_only":
            return "done"
        if self.kind == "stagewise":
            return "harness" if p.harness_phases == 0 else "done"
        if self.weight_budget_spent(p):
            return "done"
        if self.kind == "gain" and self.gain_next(p, "weight") == "weight":
            return "weight"
        if not self.harness_phase_fits(p):
            return "done" if p.phase_steps == 0 else "weight_more"
        return "harness"

    def after_harness_phase(self, p: Progress) -> str:
        if self.kind == "harness_only" and self.cfg.repeat_harness_phases:
            # a phase that spent nothing (its incoming harness's scores reused, a proposer with nothing
            # left to write: Proposer.exhausted) changed nothing; under frozen weights the next would repeat it
            left = self.budget_left(p)
            spent = p.budget_rollouts - p.phase_start_rollouts
            return "harness" if spent > 0 and left is not None and \
                left >= self.harness_iteration_cost + self.harness_phase_extra else "done"
        if self.harness_phase_ends_run():
            return "done"
        if self.weight_budget_spent(p):
            return "done"
        if self.kind == "gain" and self.gain_next(p, "harness") == "harness" and self.harness_phase_fits(p):
            return "harness"
        return "weight"

    def harness_phase_fits(self, p: Progress) -> bool:
        """A rollout budget leaves room for a harness phase of at least the re-scoring and one
        proposer iteration (and its confirmation), and one weight step after it. The phase then
        runs as many of its planned iterations as the budget allows (`harness_phase_over`
        between iterations). Why not the whole planned phase: with 64 harness problems a phase
        of I = 3 costs 576 budget rollouts, and the seed-0 `gain` run of the comparison reached
        its exploration point with 576 left (a phase and a step need 608): the harness side,
        whose turn it was, never got one (2026-12-02); a phase of one proposer iteration still
        tries M candidates."""
        left = self.budget_left(p)
        if left is None or not self.cfg.end_with_weight_phase:
            return True
        iterations = min(self.harness_iterations_planned(), 2)
        need = iterations * self.harness_iteration_cost + self.harness_phase_extra
        return left >= need + self.weight_step_cost

    # ------------------------------------------------------------------ kind: gain
    def record_weight_phase(self, p: Progress) -> dict[str, Any]:
        """After a weight phase: its gain per rollout, the accept-rate slope per step over the
        rollouts of one step. Idempotent (a phase extended by `weight_more` replaces its row)."""
        return self._record(p, "weight", _slope(p.phase_accept_rates) / max(1, self.weight_step_cost))

    def record_harness_phase(self, p: Progress, gain: float) -> dict[str, Any]:
        """After a harness phase: the fresh paired gain of the accepted harness per phase rollout."""
        spent = max(1, p.budget_rollouts - p.phase_start_rollouts)
        return self._record(p, "harness", gain / spent)

    def _record(self, p: Progress, phase: str, per_rollout: float) -> dict[str, Any]:
        spent = p.budget_rollouts - p.phase_start_rollouts
        row = {"phase": phase, "start_rollouts": p.phase_start_rollouts, "rollouts": spent,
               "per_rollout": round(per_rollout, 7), "gain": round(per_rollout * spent, 4)}
        if p.gains and p.gains[-1]["phase"] == phase and p.gains[-1]["start_rollouts"] == p.phase_start_rollouts:
            p.gains[-1] = row
        else:
            p.gains.append(row)
        return row

    def gain_next(self, p: Progress, last: str) -> str:
        """Which side runs after a `last` phase under kind gain (the rule in the module docstring)."""
        other = "harness" if last == "weight" else "weight"
        latest = {row["phase"]: row["per_rollout"] for row in p.gains}
        if other not in latest:
            return other
        if last == "harness" and p.gains[-1]["gain"] > 0 and (
                self._run_rate(p, "weight") > 0 or not self._weights_ran_under_a_searched_harness(p)):
            return "weight"  # the harness was replaced: the weight side's estimate is of the old one
        streak = 0
        for row in reversed(p.gains):
            if row["phase"] != last:
                break
            streak += 1
        if streak >= self.explore_after(p, other):
            return other
        mine, theirs = latest.get(last, 0.0), latest[other]
        if max(mine, theirs) > 0:
            return last if mine > theirs else other
        return last if self._run_rate(p, last) > self._run_rate(p, other) else other

    def explore_after(self, p: Progress, side: str) -> int:
        """Phases in a row on the other side before `side` is retried: gain_explore, doubled for
        each of `side`'s latest phases in a row that gained nothing (at most three doublings)."""
        empty = 0
        for row in reversed([r for r in p.gains if r["phase"] == side]):
            if row["per_rollout"] > 0:
                break
            empty += 1
        return self.cfg.gain_explore * 2 ** min(empty, 3)

    @staticmethod
    def _weights_ran_under_a_searched_harness(p: Progress) -> bool:
        """Has a weight phase run after some harness phase replaced the harness?"""
        replaced = False
        for row in p.gains:
            if row["phase"] == "harness" and row["gain"] > 0:
                replaced = True
            elif row["phase"] == "weight" and replaced:
                return True
        return False

    @staticmethod
    def _run_rate(p: Progress, side: str) -> float:
        """A side's gain per rollout over all its phases so far."""
        rows = [r for r in p.gains if r["phase"] == side]
        return sum(r["gain"] for r in rows) / max(1, sum(r["rollouts"] for r in rows))

    def harness_iterations_planned(self) -> int:
        """Iterations of one harness phase (adaptive: its maximum)."""
        h = self.cfg
        if self.kind == "harness_only" and self.cfg.budget_rollouts is not None and self.harness_iteration_cost \
                and not self.cfg.repeat_harness_phases:
            return max(1, (self.cfg.budget_rollouts - self.harness_phase_extra) // self.harness_iteration_cost)
        return h.harness_iterations

    def harness_phase_over(self, p: Progress, iterations_this_phase: int) -> bool:
        """Between harness iterations: no room for another iteration and the confirmation, and,
        where a weight phase is to follow (`end_with_weight_phase`), one weight step after them.
        Without that reserve the seed-0 `gain_v3` run's last harness phase (2026-12-02) ran its
        third iteration with exactly the rollouts for it and its confirmation, and the run ended
        without training under the harness it accepted."""
        left = self.budget_left(p)
        if left is None:
            return False
        return left < self.harness_iteration_cost + self.harness_phase_extra + self._after_harness_reserve()

    def can_spend(self, p: Progress, rollouts: int) -> bool:
        """May a harness phase spend `rollouts` more on deciding (a further confirmation round)?
        Only out of what is left after the weight step that must follow it, if one must: an extra
        round never overruns the budget, and never takes the last weight phase's step (see above)."""
        left = self.budget_left(p)
        return left is None or left >= rollouts + self._after_harness_reserve()

    def _after_harness_reserve(self) -> int:
        """Rollouts a harness phase must leave: one weight step, where a weight phase follows."""
        return self.weight_step_cost if self.weight_phase_follows() else 0

    def harness_phase_ends_run(self) -> bool:
        """Kinds whose harness phase is their last: harness-only, and stagewise's second stage."""
        return self.kind in ("harness_only", "stagewise")

    def weight_phase_follows(self) -> bool:
        """Does a weight phase come after a harness phase (for budget reserves)?"""
        return self.cfg.end_with_weight_phase and not self.harness_phase_ends_run()


def _slope(ys: list[float]) -> float:
    """Least-squares slope of ys against 0, 1, 2, ... (0 for fewer than two points)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))
