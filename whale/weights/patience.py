"""Adaptive length of the weight phase (the paper's `online_rsft.early_stop`).

Feed the training-batch reward (accept rate) of every weight step. The signal is smoothed by a
sliding mean over `window` steps; the phase stops once, after `burn_in` steps, the smoothed value
has set no new phase-best for `patience` steps. Smoothing matters because a single batch's accept
rate is noisy: a steadily improving policy keeps setting new windowed bests even when individual
steps dip. Bests are tracked only from the first full window, so one lucky early batch cannot set
an unbeatable best. Pure python, so its state goes into the run checkpoint as plain JSON.
"""

from __future__ import annotations

from typing import Any


class WeightPatience:
    def __init__(self, window: int, burn_in: int, patience: int):
        if window < 1 or patience < 1 or burn_in < 0:
            raise ValueError(f"weight patience needs window >= 1, patience >= 1, burn_in >= 0 "
                             f"(got window={window}, burn_in={burn_in}, patience={patience})")
        self.window = window
        self.burn_in = burn_in
        self.patience = patience
        self.rewards: list[float] = []
        self.best: float | None = None
        self.best_step = 0  # number of steps seen when the best was set

    def reset(self) -> None:
        """A new weight phase: its signal starts from nothing (the rule is per phase)."""
        self.rewards, self.best, self.best_step = [], None, 0

    @property
    def steps(self) -> int:
        return len(self.rewards)

    def window_mean(self) -> float | None:
        if len(self.rewards) < self.window:
            return None
        recent = self.rewards[-self.window:]
        return sum(recent) / len(recent)

    def update(self, reward: float) -> None:
        self.rewards.append(float(reward))
        mean = self.window_mean()
        if mean is not None and (self.best is None or mean > self.best):
            self.best = mean
            self.best_step = self.steps

    def steps_since_best(self) -> int:
        return self.steps - self.best_step if self.best is not None else 0

    def should_stop(self) -> bool:
        if self.steps < max(self.burn_in, self.window) or self.best is None:
            return False
        return self.steps_since_best() >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "burn_in": self.burn_in, "patience": self.patience,
                "rewards": list(self.rewards), "best": self.best, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window, self.burn_in, self.patience = state["window"], state["burn_in"], state["patience"]
        self.rewards = [float(r) for r in state["rewards"]]
        self.best = state["best"]
        self.best_step = int(state["best_step"])
