"""When to switch between the weight phase and the harness phase.

All conditions of the paper run through this one state machine, so they differ only in the
decisions below, never in how a phase runs:

| kind          | phases                                                         |
|---------------|----------------------------------------------------------------|
| whale         | weight (E epochs) -> harness (I iterations) -> weight -> ...     |
| whale+adaptive| weight until patience -> harness until patience (min/max) -> ... |
| weight_only   | weight until the budget ends                                   |
| harness_only  | one harness phase until the budget ends, weights frozen        |
| prompt_only   | as whale, but the search may edit only the prompt constants    |
| stagewise     | all weight epochs, then all harness iterations                 |

Budgets (epochs of D_weight, weight steps, or total budget rollouts = weight + harness-search
rollouts) end a run only at a unit boundary; by default a whale run does not start a harness phase
it could not follow with a weight step, so it ends on a weight phase, as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from whale.config import Config


@dataclass
class Progress:
    """What the schedule looks at: counters the run keeps in state.json."""

    weight_steps: int = 0  # total weight steps done
    phase_steps: int = 0  # weight steps in the current weight phase
    harness_phases: int = 0  # harness phases completed
    harness_iterations: int = 0  # total harness iterations done (incl. re-scoring)
    budget_rollouts: int = 0
    patience_stop: bool = False  # the weight-phase patience rule fired


class Schedule:
    def __init__(self, cfg: Config, steps_per_epoch: int, harness_iteration_cost: int, weight_step_cost: int):
        self.cfg = cfg.schedule
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.harness_iteration_cost = harness_iteration_cost  # rollouts of one harness iteration
        self.weight_step_cost = weight_step_cost

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
        return max(1, round(self.cfg.weight_epochs * self.steps_per_epoch))

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
            return p.phase_steps >= self.cfg.min_weight_steps and p.patience_stop
        return p.phase_steps >= self.phase_steps_fixed()

    def after_weight_phase(self, p: Progress) -> str:
        if self.kind == "weight_only":
            return "done"
        if self.kind == "stagewise":
            return "harness" if p.harness_phases == 0 else "done"
        if self.weight_budget_spent(p):
            return "done"
        left = self.budget_left(p)
        if left is not None and self.cfg.end_with_weight_phase:
            need = self.harness_iterations_planned() * self.harness_iteration_cost + self.weight_step_cost
            if left < need:
                return "done" if p.phase_steps == 0 else "weight_more"
        return "harness"

    def after_harness_phase(self, p: Progress) -> str:
        if self.kind in ("harness_only", "stagewise"):
            return "done"
        if self.weight_budget_spent(p):
            return "done"
        return "weight"

    def harness_iterations_planned(self) -> int:
        """Iterations of one harness phase (adaptive: its maximum)."""
        h = self.cfg
        if self.kind == "harness_only" and self.cfg.budget_rollouts is not None and self.harness_iteration_cost:
            return max(1, self.cfg.budget_rollouts // self.harness_iteration_cost)
        return h.harness_iterations

    def harness_phase_over(self, p: Progress, iterations_this_phase: int) -> bool:
        """Between harness iterations (non-adaptive): budget check for rollout budgets."""
        left = self.budget_left(p)
        if left is not None and left < self.harness_iteration_cost:
            return True
        return False
