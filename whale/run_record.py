"""What a run writes as it goes: the unit of work in progress, its metrics rows, and the saves of its
state (run.py's table of units says when each is saved)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from whale.engine.base import Engine
from whale.memory_probe import MemoryProbe
from whale.run_state import RunState
from whale.store import RunDir
from whale.weights.patience import WeightPatience
from whale.weights.rsft import ProblemStream


@dataclass
class RunRecord:
    """The run directory, the run's state, and the unit in progress (`unit`, e.g. `w3`,
    `c0-h2`, `eval-initial-val`), which names the metrics rows, ledger keys and in-flight
    episodes. `save` also takes in the problem stream's and weight patience's states, so every
    save holds all of the run's state."""

    run_dir: RunDir
    state: RunState
    engine: Engine
    stream: ProblemStream
    patience: WeightPatience
    unit: str = "start"
    probe: MemoryProbe | None = None  # WHALE_MEMORY_LOG=1: a memory.jsonl row per event
    _recoveries_logged: int = field(default=0, init=False)  # of engine.recoveries (see _log_recoveries)

    def save(self) -> None:
        self._log_recoveries()
        self.sync_progress()
        self.state.stream = self.stream.state_dict()
        self.state.patience = self.patience.state_dict()
        self.run_dir.save_state(self.state)

    def sync_progress(self) -> None:
        """The schedule decides on the ledger as it is now (ledger.jsonl is ahead of state.json)."""
        self.state.progress.budget_rollouts = self.run_dir.ledger.budget_rollouts

    def log(self, event: str, **row: Any) -> None:
        st = self.state
        self.run_dir.log({"unit": self.unit, "event": event, "phase": st.phase, "cycle": st.cycle,
                          "step": st.progress.weight_steps, "harness": st.harness_id,
                          "weights_version": st.weights_version, **row})
        if self.probe is not None:
            self.probe.log(event, self.unit, self.run_dir.elapsed())

    def _log_recoveries(self) -> None:
        """An `engine_recovered` row per server recovery since the last unit (Engine.recoveries):
        which unit it hit and why, so an incident is in metrics.jsonl, not only on stderr."""
        recoveries = self.engine.recoveries
        for n in range(self._recoveries_logged, len(recoveries)):
            self.log("engine_recovered", id=f"recovery-{n}", reason=recoveries[n].reason, ok=recoveries[n].ok)
        self._recoveries_logged = len(recoveries)
