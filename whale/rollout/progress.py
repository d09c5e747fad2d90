"""A rich progress bar for a batch of episodes, with the running mean reward (or nothing)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class ProgressBar:
    """A rich progress bar (or nothing when label is None)."""

    def __init__(self, label: str | None, total: int):
        self.bar = None
        self.rewards = 0.0
        self.n = 0
        if label:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("mean reward {task.fields[mean]:.3f}"), TimeElapsedColumn(),
                                transient=False)
            self.task = self.bar.add_task(label, total=total, mean=0.0)
            self.bar.start()

    def advance(self, reward: float) -> None:
        self.n += 1
        self.rewards += reward
        if self.bar:
            self.bar.update(self.task, advance=1, mean=self.rewards / self.n)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
