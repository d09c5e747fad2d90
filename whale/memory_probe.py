"""Where a run's resident memory is, one row per metrics event, in memory.jsonl: the probe behind
docs/performance.md's memory budget. Off unless WHALE_MEMORY_LOG=1, because reading /proc for every
process of the tree at each event costs time a normal run should not pay."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from whale.engine.base import Engine
from whale.engine.hf import HFEngine
from whale.store import append_line
from whale.sysmem import descendants, heap_stats, peak_rss_kb, process_memory
from whale.weights.versions import WeightVersions
from whale.weights.trainer import Trainer

MIB = 1 << 20


def memory_log_on() -> bool:
    return os.environ.get("WHALE_MEMORY_LOG") == "1"


class MemoryProbe:
    """Writes a row per event: this process (PSS, anonymous, peak RSS since the last row, glibc's
    heap, threads), what the hf engine holds, the trainer's optimizer state, and the child
    processes' PSS by name."""

    def __init__(self, path: Path, engine: Engine, weights: WeightVersions):
        self.path, self.engine, self.weights = path, engine, weights

    def log(self, event: str, unit: str, elapsed: float) -> None:
        row: dict[str, Any] = {"event": event, "unit": unit, "t": round(elapsed, 1),
                               **{k: v // 1024 for k, v in process_memory().items()},
                               "peak_rss": peak_rss_kb(reset=True) // 1024, **heap_stats(),
                               "threads": len(os.listdir("/proc/self/task"))}
        if isinstance(self.engine, HFEngine):
            row.update({k: v // MIB for k, v in self.engine.memory_bytes().items()})
        trainer = self.weights.trainer
        if isinstance(trainer, Trainer):
            row["optimizer"] = sum(t.nbytes for st in trainer.optimizer.state.values()
                                   for t in st.values() if isinstance(t, torch.Tensor)) // MIB
        children: dict[str, int] = {}
        for pid in descendants():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:  # the child ended between the listing and the read
                continue
            children[name] = children.get(name, 0) + process_memory(pid).get("pss", 0) // 1024
        row["children_pss"] = children
        append_line(self.path, row)
