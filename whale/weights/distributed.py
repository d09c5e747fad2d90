"""The weight phase on several processes: a persistent FSDP2 group the driver sends each step's rows to.

`compute.train_ranks: N` (N > 1) starts N training workers once per run (`TrainGroup`), each a
spawned process holding one rank of a torch.distributed group (NCCL on GPUs, gloo on CPU) and a
`ShardedTrainer`: the `Trainer` of trainer.py with its model wrapped by FSDP2 (`fully_shard` per
decoder layer, then the root), so the fp32 master weights, gradients and AdamW state are sharded
over the ranks. The driver process stays the one that runs rollouts, search and the schedule; for
each weight step it sends the step's rows to every rank and gets back the loss, and for each
checkpoint rank 0 gathers the full state and writes it in trainer.py's layout (safetensors or a
PEFT adapter plus `trainer_state.pt`), which the engine then loads like any saved checkpoint.

The same gradient whatever N is: every rank sees the whole mini-batch (the same shuffle, from the
same seed), trains its share of the rows, and divides its summed token NLL by the loss-token
count all-reduced over the ranks, times N; FSDP's reduce-scatter averages the gradient over the N
ranks, which divides the N back out. (Scaling the loss rather than
`set_gradient_divide_factor`, which the gloo backend refuses.) With per-rank denominators the
update would be a mean of per-rank means, which tests/test_distributed.py tells apart. Ranks run
the same number of forwards (FSDP all-gathers each layer in every forward): a rank with fewer
micro-batches runs zero-weighted ones.

Faults: the driver waits on the workers' answers with a short poll and checks that every worker
is alive; a worker that died (killed, out of memory) stops the group, and the command is retried
once on a new group restored from the last checkpoint it saved or loaded (a step is a function of
that state, so the retry trains the same update). A second death, or an exception in a worker,
is one error naming the rank; nothing of the step has been saved, so `whale run --resume` redoes
it. Workers exit when the driver dies (they watch their parent), so a SIGKILLed run leaves no
processes behind.

Several nodes: ranks find each other through `init_method` (a TCP rendezvous on the driver's
node here); a launcher that starts ranks on other nodes (torchrun, Ray actors) would pass the
same rank, world size and address. One node is what is built and tested.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from whale.config import Config, WeightConfig
from whale.engine.default_model import resolve_model_path
from whale.engine.hf import resolve_dtype
from whale.store import kill_point
from whale.weights.rows import TrainingRow
from whale.weights.trainer import Trainer

COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a collective a peer never joins fails after this, never hangs


class RankDied(RuntimeError):
    """A training worker process is gone (killed, out of memory)."""


class ShardedTrainer(Trainer):
    """`Trainer` on one rank of an initialised process group, its model under FSDP2.

    The model must be loaded in float32: the sharded parameters are the fp32 masters, and a
    low-precision `param_dtype` (bf16 on GPUs) is FSDP's compute copy. Full logits, not the chunked
    cross-entropy: the chunked path calls the backbone and the head outside the root module's
    forward, where FSDP has not gathered the head's (often tied) weight.
    """

    in_process = False

    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: WeightConfig, seed: int = 0, *,
                 temperature: float = 1.0, param_dtype: torch.dtype | None = None):
        if next(model.parameters()).dtype != torch.float32:
            raise ValueError("a sharded trainer's model must be loaded in float32 (the fp32 master weights)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.param_dtype = param_dtype
        super().__init__(model, tokenizer, cfg, seed, temperature=temperature, chunked=False)

    def _shard(self) -> None:
        first: dict[int, str] = {}
        self._tied = [n for n, p in self.model.named_parameters(remove_duplicate=False)
                      if first.setdefault(id(p), n) != n]
        layer_types = set(self._base()._no_split_modules or ())
        layers = [m for m in self.model.modules() if type(m).__name__ in layer_types]
        if not layers:
            raise ValueError(f"{type(self._base()).__name__} names no decoder layer class (_no_split_modules) "
                             "to shard; use compute.train_ranks 1")
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(self.model, mp_policy=policy)

    def _rank_rows(self, batch: list[TrainingRow]) -> list[TrainingRow]:
        """Longest rows dealt round-robin: about equal tokens per rank."""
        return sorted(batch, key=lambda r: len(r.input_ids), reverse=True)[self.rank::self.world]

    def _reduce(self, value: float, op: dist.ReduceOp) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return float(t.item())

    def _all_sum(self, value: Any) -> Any:
        return type(value)(self._reduce(value, dist.ReduceOp.SUM))

    def _aligned(self, micros: list[list[TrainingRow]], batch: list[TrainingRow]) -> list[tuple[list[TrainingRow], float]]:
        most = int(self._reduce(len(micros), dist.ReduceOp.MAX))
        filler = [min(batch, key=lambda r: len(r.input_ids))]
        return [(m, 1.0) for m in micros] + [(filler, 0.0)] * (most - len(micros))

    def _clip(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.optimized, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def _full_state(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, on the CPU
        weights = get_model_state_dict(self.model, options=options)
        for name in self._tied:  # a tied weight once, under its first name, as save_pretrained writes it
            weights.pop(name, None)
        return weights, get_optimizer_state_dict(self.model, self.optimizer, options=options)

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def _after_save(self) -> None:
        dist.barrier()

    def _load_weights(self, directory: Path) -> None:
        """Every rank reads the checkpoint (one node: the same disk) and keeps its shards."""
        names = set(self.model.state_dict())
        if self.cfg.finetune == "lora":
            saved = load_file(directory / "adapter_model.safetensors")
            # PEFT files drop the adapter name from the module path; the model has it
            weights = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                       for k, v in saved.items()}
        else:
            weights = {}
            for f in sorted(directory.glob("*.safetensors")):
                weights.update(load_file(f))
        unknown = sorted(set(weights) - names)
        if not weights or unknown:
            raise ValueError(f"{directory}: weights do not fit this model (unexpected {unknown[:3]})")
        set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True, strict=False))

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------- a worker process
def rank_device(cfg: Config, rank: int) -> torch.device:
    if cfg.model.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def build_rank_trainer(cfg: Config, device: torch.device) -> ShardedTrainer:
    """This rank's trainer on the run's model (loaded in fp32; `model.dtype` is the compute dtype)."""
    path = str(resolve_model_path(cfg.model.name))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    compute = resolve_dtype(cfg.model.dtype, device)
    return ShardedTrainer(model, AutoTokenizer.from_pretrained(path), cfg.weight, seed=cfg.seed,
                          temperature=max(cfg.sampling.temperature, 1e-3),
                          param_dtype=None if compute == torch.float32 else compute)


def _exit_with_parent() -> None:
    """End this worker when the driver ends (its pipe to us closes), however it ends."""
    driver = mp.parent_process()

    def watch() -> None:
        driver.join()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="whale-parent-watch").start()


def worker_main(rank: int, world: int, init_method: str, cfg_json: str, generation: int,
                commands: Any, results: Any, environ: dict[str, str]) -> None:
    """One training rank: build the trainer, then answer the driver's commands until 'stop'."""
    _exit_with_parent()
    os.environ.clear()  # the driver's environment now, not the fork server's when it started
    os.environ.update(environ)
    cfg = Config.model_validate_json(cfg_json)
    device = rank_device(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        trainer = build_rank_trainer(cfg, device)
        results.put(("ok", rank, None))
        while True:
            command, args = commands.get()
            if command == "stop":
                return
            # the fault tests' hook (whale.store): e.g. train@rank1#0/step2 = rank 1 of the first group, in
            # the train command that starts at optimizer step 2
            kill_point(f"{command}@rank{rank}#{generation}/step{trainer.step}")
            if command == "train":
                answer: Any = trainer.train_step(args[0])
            elif command == "save":
                answer = str(trainer.save(args[0], args[1]))
            elif command == "load":
                answer = trainer.load(args[0])
            else:
                raise ValueError(f"unknown command {command!r}")
            results.put(("ok", rank, answer if rank == 0 else None))
    except Exception:  # noqa: BLE001 - reported to the driver, which raises it
        results.put(("error", rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- the driver's side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainGroup:
    """The driver's handle on N training ranks: `train_step`, `save`, `load` like `Trainer`.

    Parameters:
        cfg: the run's config (`compute.train_ranks` workers; each builds the model from `model.name`).
        restarts: new groups a command may use after workers died, before it raises.
        start_timeout_s: seconds the workers may take to load the model.
        worker: the function each rank runs (tests substitute variants of `worker_main`).
    """

    in_process = False  # the engine loads what rank 0 saved

    def __init__(self, cfg: Config, *, restarts: int = 1, start_timeout_s: float = 900.0,
                 worker: Callable[..., None] = worker_main):
        self.cfg = cfg
        self.ranks = cfg.compute.train_ranks
        self.restarts = restarts
        self.start_timeout_s = start_timeout_s
        self.worker = worker
        self.version: str | None = None
        self.generation = 0  # groups started so far, less one
        self._restore: Path | None = None  # the checkpoint a new group starts from (None: the base model)
        self._procs: list[Any] = []
        self._start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _start(self) -> None:
        # forkserver: one process imports torch and transformers once; every rank (and every restart)
        # is a fork of it, started in a fraction of a fresh interpreter's import time
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["whale.weights.distributed"])
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(self.ranks)]
        init = f"tcp://127.0.0.1:{_free_port()}"
        cfg_json = self.cfg.model_dump_json()
        self._procs = [ctx.Process(target=self.worker, daemon=True, name=f"whale-train-rank{r}",
                                   args=(r, self.ranks, init, cfg_json, self.generation, self._commands[r],
                                         self._results, dict(os.environ)))
                       for r in range(self.ranks)]
        for p in self._procs:
            p.start()
        self._wait("start", self.start_timeout_s)
        if self._restore is not None:
            self._call("load", str(self._restore))

    def _wait(self, command: str, timeout_s: float | None = None) -> Any:
        """Every rank's answer to `command` (rank 0's is returned); raises when a rank died or failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending, answer = set(range(self.ranks)), None
        while pending:
            try:
                status, rank, payload = self._results.get(timeout=1.0)
            except queue.Empty:
                self._raise_if_dead(command, pending)
                if deadline is not None and time.monotonic() > deadline:
                    self._stop()
                    raise RuntimeError(f"the training ranks did not finish '{command}' within {timeout_s:.0f} s")
                continue
            if status == "error":
                # a rank whose peer died fails in its next collective: report the death, which a restart mends
                for _ in range(5):
                    self._raise_if_dead(command, set(range(self.ranks)) - {rank})
                    time.sleep(1.0)
                self._stop()
                last = payload.strip().splitlines()[-1]
                raise RuntimeError(f"training rank {rank} failed during '{command}': {last}\n{payload}")
            pending.discard(rank)
            if rank == 0:
                answer = payload
        return answer

    def _raise_if_dead(self, command: str, ranks: set[int]) -> None:
        dead = [(r, p) for r, p in enumerate(self._procs) if r in ranks and not p.is_alive()]
        if dead:
            r, p = dead[0]
            self._stop()
            raise RankDied(f"training rank {r} (pid {p.pid}) died (exit code {p.exitcode}) during '{command}'")

    def _call(self, command: str, *args: Any) -> Any:
        for q in self._commands:
            q.put((command, args))
        kill_point(f"{command}@driver")  # the resume tests' hook: the whole run killed while the ranks work
        return self._wait(command)

    def _retrying(self, command: str, *args: Any) -> Any:
        for attempt in range(self.restarts + 1):
            try:
                return self._call(command, *args)
            except RankDied as e:
                if attempt == self.restarts:
                    raise RankDied(f"{e}; gave up after {self.restarts} restart(s). Nothing of this weight step "
                                   "was saved: `whale run --resume RUN_DIR` redoes it") from None
                print(f"whale: {e}; restarting the training group from "
                      f"{self._restore or 'the base model'}", file=sys.stderr)
                self.generation += 1
                self._start()
        raise AssertionError("unreachable")

    def train_step(self, rows: list[TrainingRow]) -> dict[str, float]:
        if not rows:
            raise ValueError("train_step needs at least one training row")
        return self._retrying("train", list(rows))

    def save(self, directory: str | Path, version: str) -> Path:
        path = Path(self._retrying("save", str(directory), version))
        self._restore, self.version = path, version
        return path

    def load(self, directory: str | Path) -> str:
        self._restore = Path(directory)
        self.version = self._retrying("load", str(directory))
        return self.version

    def _stop(self, grace_s: float = 10.0) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(grace_s)
            if p.is_alive():
                p.kill()
                p.join()

    def close(self) -> None:
        """Ask every rank to stop, then end any that does not."""
        for q, p in zip(self._commands, self._procs):
            if p.is_alive():
                q.put(("stop", ()))
        deadline = time.monotonic() + 30.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._stop()
