"""The run's weights versions: the trainer that makes them, restoring one into the engine, and which
stay on disk.

A weight step saves `weights/w<step>` before the state naming it is saved (weights/rsft.py);
pruning runs only after that save, and `RunDir.prune_weights` never deletes a version the saved
state.json names, so a kill at any point leaves a loadable run.
"""

from __future__ import annotations

from whale.config import Config, ConfigError
from whale.engine.base import Engine
from whale.run_state import RunState
from whale.store import RunDir
from whale.weights.distributed import TrainGroup
from whale.weights.from_disk import training_model
from whale.weights.trainer import Trainer


class WeightVersions:
    def __init__(self, cfg: Config, run_dir: RunDir, engine: Engine):
        self.cfg = cfg
        self.run_dir = run_dir
        self.engine = engine
        self.trainer: Trainer | TrainGroup | None = None  # made by the first weight step or restore

    def ensure_trainer(self) -> Trainer | TrainGroup:
        """The trainer, made once: the served model itself (hf), an hf copy whose saves the vLLM
        server loads, or rank processes (`compute.train_ranks` > 1) whose rank 0 saves."""
        if self.trainer is None:
            sync = self.engine.weight_sync
            if sync not in ("in_place", "from_disk"):
                raise ConfigError(f"model.backend {self.cfg.model.backend!r} serves inference only; "
                                  "weight phases need backend hf or vllm")
            if self.cfg.compute.train_ranks > 1:  # ranks in their own processes; the engine loads rank 0's saves
                self.trainer = TrainGroup(self.cfg)
                return self.trainer
            if sync == "in_place":  # hf: train the served model object itself, no copy
                model, tokenizer = self.engine.model, self.engine.tokenizer
            else:  # vLLM: train an hf copy; RSFT saves adapters, the server loads them
                model, tokenizer = training_model(self.cfg)
            self.trainer = Trainer(model, tokenizer, self.cfg.weight, seed=self.cfg.seed,
                                   temperature=max(self.cfg.sampling.temperature, 1e-3))
            if sync == "in_place":
                self.trainer.attach(self.engine)
        return self.trainer

    def restore(self, version: str) -> None:
        """Load saved version `version` into the trainer and the engine (resume, val-best measurement)."""
        path = self.run_dir.weights_path(version)
        if not path.exists():
            raise ConfigError(f"state.json names weights {version} but {path} is missing")
        trainer = self.ensure_trainer()
        trainer.load(path)
        in_place = self.engine.weight_sync == "in_place" and trainer.in_process
        self.engine.load_weights(None if in_place else str(path), version)

    def needed(self, state: RunState) -> set[str]:
        """Versions kept on disk: the current one (resume loads it), the val-best (selection), each
        weight phase's end (the columns of `whale matrix`);
        with LoRA also the last `weight.keep_versions` adapters (small). Full fine-tuning keeps no
        others: each of its checkpoints holds the whole model and the optimizer state."""
        keep = {state.weights_version, *state.phase_end_weights}
        if state.val_best is not None:
            keep.add(state.val_best.weights_version)
        n = self.cfg.weight.keep_versions
        if self.cfg.weight.finetune == "lora" and n > 0:
            keep.update(self.run_dir.weights_on_disk()[-n:])
        return keep

    def prune(self, state: RunState) -> None:
        """Called only after `state` is saved, so state.json already names every version still needed."""
        self.run_dir.prune_weights(self.needed(state))

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
