"""One online RSFT step: sample under the current harness, keep the verified, fine-tune, push.

    problems = next(stream)                                  # prompt batch of D_weight
    trajs = runner.run(harness, problems, k, purpose="weight")  # the same runner as everywhere
    accepted = [t for t in trajs if t.reward > threshold]    # binary verifier, threshold 0.5
    rows = rows_from_trajectories(accepted)                  # the ids actually sampled
    on_rollouts(meta); save_rows(rows_dir / f"step_{i}.jsonl", rows)  # counted, then persisted
    trainer.train_step(rows); trainer.save(weights_dir / f"w{i}")      # skipped when nothing was accepted
    engine.load_weights(...)

Nothing accepted means no optimizer step and no weight push, as in the paper's code.

The step is the weight phase's resume unit, and all of its resume logic lives here:
- the caller saves `stream.state_dict()` only once the step is complete, so a step re-entered
  after a kill draws the same prompt batch (the stream is drawn either way, so the sequence of
  batches never depends on where a run was interrupted);
- `on_rollouts(meta)` (the ledger) is called *before* the rows are written: the ledger is never
  behind the disk. A kill between the two redoes the rollouts, which the ledger, seeing the
  step's key again, records as redone;
- rows (and a small meta file with the rollout counts) are persisted before training: a step
  re-entered after a kill mid-training finds them, skips the rollouts and trains on the same rows
  from the checkpoint of the previous step, so neither rollouts nor ledger entries are redone;
- the new weights are saved to `weights_dir / w<step>` (adapter or full checkpoint, with the
  optimizer and RNG state) before the step returns, so the state that names them can be saved next.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from whale.config import WeightConfig
from whale.domains.base import Problem
from whale.rollout.trajectory import Trajectory
from whale.store import atomic_write, kill_point
from whale.weights.rows import load_rows, rows_from_trajectories, save_rows


class ProblemStream:
    """Prompt batches of D_weight, epoch after epoch; resumable.

    Each epoch is a fresh shuffle seeded by (seed, epoch); the remainder that does not fill a batch
    is dropped (verl's dataloader), so `steps_per_epoch = len(problems) // batch_size` and a batch
    never mixes two epochs. The whole state is the number of batches drawn.
    """

    def __init__(self, problems: list[Problem], batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"problems per step must be >= 1, got {batch_size}")
        if len(problems) < batch_size:
            raise ValueError(f"weight.problems_per_step={batch_size} exceeds the {len(problems)} problems "
                             "of D_weight; lower it or enlarge domain.splits.weight")
        self.problems = list(problems)
        self.batch_size = batch_size
        self.seed = seed
        self.batches_drawn = 0
        self._cached: tuple[int, list[int]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.problems) // self.batch_size

    @property
    def epoch(self) -> float:
        """Progress in epochs of D_weight (1.5 = halfway through the second epoch)."""
        return self.batches_drawn / self.steps_per_epoch

    def _order(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            order = list(range(len(self.problems)))
            random.Random(f"problem-stream:{self.seed}:{epoch}").shuffle(order)
            self._cached = (epoch, order)
        return self._cached[1]

    def __iter__(self) -> "ProblemStream":
        return self

    def __next__(self) -> list[Problem]:
        epoch, k = divmod(self.batches_drawn, self.steps_per_epoch)
        order = self._order(epoch)
        self.batches_drawn += 1
        return [self.problems[i] for i in order[k * self.batch_size:(k + 1) * self.batch_size]]

    def _fingerprint(self) -> int:
        return zlib.crc32("\n".join(p.id for p in self.problems).encode())

    def state_dict(self) -> dict[str, Any]:
        return {"batches_drawn": self.batches_drawn, "seed": self.seed, "batch_size": self.batch_size,
                "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["seed"], state["batch_size"], state["fingerprint"]) != (
                self.seed, self.batch_size, self._fingerprint()):
            raise ValueError("problem stream state does not match: the seed, problems per step or D_weight "
                             "changed since it was saved")
        self.batches_drawn = int(state["batches_drawn"])


@dataclass
class StepResult:
    step: int
    accept_rate: float
    accepted: int
    rollouts: int
    rows: int
    trained_tokens: int
    loss: float | None
    gen_seconds: float
    train_seconds: float
    weights_version: str | None  # the version pushed by this step; None when nothing was trained
    reason: str  # "trained", "no accepted trajectories", ...
    trajectories: list[Trajectory] = field(default_factory=list)  # empty when resumed
    resumed: bool = False  # trained on rows saved by an interrupted attempt; rollouts not redone
    optimizer_steps: int = 0
    epoch: float = 0.0  # stream progress after this step
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("trajectories")
        return row


class RSFT:
    """The weight phase's step. See the module docstring.

    `weights_dir` receives every trained version (`w<step>`): the checkpoint resume restores and,
    when the engine does not serve the trainer's model object (a vLLM server), what it loads.
    Without one (tests of the in-place path) nothing is saved.
    `on_rollouts(meta)` is called once per step that ran rollouts, before its rows are written, so
    the caller's ledger counts them at the point that makes the step resumable (see above).
    """

    def __init__(self, runner: Any, trainer: Any, engine: Any, cfg: WeightConfig, stream: ProblemStream,
                 harness_source: str, harness_id: str, rows_dir: str | Path, *,
                 weights_dir: str | Path | None = None,
                 on_rollouts: Callable[[dict[str, Any]], None] | None = None, colocated: bool = False):
        self.runner = runner
        self.trainer = trainer
        self.engine = engine
        self.cfg = cfg
        self.stream = stream
        self.harness_source = harness_source
        self.harness_id = harness_id
        self.rows_dir = Path(rows_dir)
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.on_rollouts = on_rollouts
        self.colocated = colocated  # the engine is a vLLM server on the trainer's GPU (model.colocate)

    def set_harness(self, source: str, harness_id: str) -> None:
        self.harness_source = source
        self.harness_id = harness_id

    def rows_path(self, step_index: int) -> Path:
        return self.rows_dir / f"step_{step_index}.jsonl"

    def step(self, step_index: int, seed: int) -> StepResult:
        problems = next(self.stream)
        saved = self._saved_rows(step_index, problems)
        trajs: list[Trajectory] = []
        if saved is not None:
            rows, meta = saved
        else:
            trajs, rows, meta = self._rollouts(step_index, problems, seed)
        resumed = saved is not None
        result = StepResult(
            step=step_index, accept_rate=meta["accepted"] / max(meta["rollouts"], 1),
            accepted=meta["accepted"], rollouts=meta["rollouts"], rows=len(rows), trained_tokens=0,
            loss=None, gen_seconds=0.0 if resumed else meta["gen_seconds"], train_seconds=0.0,
            weights_version=None, reason="", trajectories=trajs, resumed=resumed, epoch=self.stream.epoch,
            llm_calls=meta["llm_calls"], prompt_tokens=meta["prompt_tokens"],
            completion_tokens=meta["completion_tokens"])
        if not rows:
            result.reason = ("no accepted trajectories" if meta["accepted"] == 0 else
                             "accepted trajectories have no trainable token ids")
            return result

        if self.colocated:  # one GPU: the server gives its memory to the trainer for the step
            self.engine.sleep()
        elif self.engine.weight_sync == "in_place" and self.trainer.in_process:  # the trainer steps on the served model
            self.engine.free_caches()
        try:
            stats = self.trainer.train_step(rows)
        finally:
            if self.colocated:
                self.engine.wake_up()
        version = f"w{step_index}"
        self._push(version)
        result.trained_tokens = int(stats["trained_tokens"])
        result.loss = float(stats["loss"])
        result.optimizer_steps = int(stats["optimizer_steps"])
        result.train_seconds = float(stats["seconds"])
        result.weights_version = version
        result.reason = "trained on saved rows (resumed)" if resumed else "trained"
        return result

    def _saved_rows(self, step_index: int, problems: list[Problem]) -> tuple[list, dict[str, Any]] | None:
        """Rows and meta an interrupted attempt at this step left on disk, or None."""
        rows_path = self.rows_path(step_index)
        meta_path = rows_path.with_suffix(".meta.json")
        if not (rows_path.exists() and meta_path.exists()):
            return None
        meta = json.loads(meta_path.read_text())
        if meta.get("problem_ids") != [p.id for p in problems]:
            raise ValueError(f"{rows_path} was made from other problems than the stream now yields; "
                             "the problem stream state and the saved rows are out of sync")
        return load_rows(rows_path), meta

    def _rollouts(self, step_index: int, problems: list[Problem], seed: int) -> tuple[list, list, dict[str, Any]]:
        t0 = time.perf_counter()
        trajs = self.runner.run(self.harness_source, problems, self.cfg.samples_per_problem,
                                harness_id=self.harness_id, seed=seed, purpose="weight",
                                progress=f"weight step {step_index}")
        accepted = [t for t in trajs if t.reward > self.cfg.accept_threshold]
        rows = rows_from_trajectories(accepted, self.cfg.max_length)
        meta = {
            "step": step_index, "harness_id": self.harness_id, "rollouts": len(trajs),
            "accepted": len(accepted), "rows": len(rows), "gen_seconds": time.perf_counter() - t0,
            "llm_calls": sum(len(t.calls) for t in trajs),
            "prompt_tokens": sum(t.prompt_tokens for t in trajs),
            "completion_tokens": sum(t.completion_tokens for t in trajs),
            "problem_ids": [p.id for p in problems],
        }
        if self.on_rollouts is not None:
            self.on_rollouts(meta)  # counted before persisted: the ledger is never behind the disk
        rows_path = self.rows_path(step_index)
        atomic_write(rows_path.with_suffix(".meta.json"), json.dumps(meta, indent=1))  # meta first: the rows file marks completion
        save_rows(rows_path, rows)
        kill_point(f"rows@w{step_index}")
        return trajs, rows, meta

    def _push(self, version: str) -> None:
        """Checkpoint the new version (resume restores it), then serve it: in place (hf engine
        serving the trainer's model) only the version tag changes; otherwise the engine loads the
        saved adapter/checkpoint."""
        path = self.trainer.save(self.weights_dir / version, version) if self.weights_dir is not None else None
        if self.engine.weight_sync == "in_place" and self.trainer.in_process:  # it serves the trainer's model
            self.engine.load_weights(None, version)
            self.trainer.version = version
            return
        if path is None:
            raise ValueError("the engine does not serve the trained model in place; RSFT needs a weights_dir "
                             "to save the new weights for it")
        self.engine.load_weights(str(path), version)


def steps_for_epochs(stream: ProblemStream, epochs: float) -> int:
    """Weight steps that make `epochs` epochs of D_weight (at least one)."""
    return max(1, math.ceil(epochs * stream.steps_per_epoch - 1e-9))
