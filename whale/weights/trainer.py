"""The SFT half of online RSFT: one epoch over accepted rows, in place on the served model.

What it computes (the paper's `update_sft_policy`): rows are grouped by trajectory into
mini-batches of `mini_batch_trajectories` trajectories; each mini-batch is ONE clipped AdamW step
whose loss is the summed NLL of its loss-mask tokens divided by the number of loss-mask tokens in
the whole mini-batch (a token mean over the mini-batch, not a mean of per-micro-batch means).
Micro-batches packed by padded token count only bound memory; they do not change the gradient.

Why a trainer of our own rather than TRL's `SFTTrainer`: the model is trained in place, between
rollouts, on the same object the hf engine serves, and the optimizer and scheduler state must live
across steps and phases (and across a kill, via `save`/`load`). `SFTTrainer` owns its model,
dataset and loop per `train()` call.

Chunked cross-entropy: Qwen3.5's ~248k vocabulary over long rows would make fp32 logits the largest
tensor in training. We run the backbone to hidden states, keep only the positions that carry loss,
and project them onto the lm_head in chunks under activation checkpointing, so at most one chunk of
logits exists at a time, forward or backward. Prompt and tool-output positions are never projected.
Architectures whose logits are not a plain `lm_head(hidden)` (soft-capping, logit scaling) fall back
to the full-logits path; both give the same loss (tested).

fp32 master weights: a model served in bf16 (the hf engine's "auto" dtype on CUDA, vLLM) cannot
be updated in bf16. bf16 keeps 8 significant bits, so an Adam step of ~lr = 1e-7 (the paper's
full fine-tuning rate) on a weight of 0.02 (spacing 1.2e-4) rounds to no change at all, step after
step. Every trainable parameter stored below fp32 therefore gets an fp32 master copy: gradients
are accumulated into the master in fp32 after each micro-batch, the optimizer (and its state)
updates the masters, and the rounded result is copied into the served parameter after each step,
so the engine serving that object sees it at once. The masters are saved next to the weights
(`fp32_master/`) so a resume continues from them, not from the rounded copy. peft
already keeps LoRA adapters in fp32 on a bf16 base (`autocast_adapter_dtype`), so LoRA needs no
masters; the same rule would cover it if it did. Cost: 4 bytes per low-precision trainable
parameter for the master, and Adam's two moments in fp32 instead of bf16 (+4), i.e. full bf16
fine-tuning holds 14 instead of 6 bytes per parameter besides activations.

LoRA (our default where the paper fine-tunes fully; `weight.finetune: full` is the paper's): all
linear layers of the language model, never the lm_head, never a vision tower, no `modules_to_save`,
so the adapter stays a plain PEFT folder that vLLM can load at runtime.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.pytorch_utils import Conv1D

from whale.config import LoraConfig, WeightConfig
from whale.errors import storage_error
from whale.sysmem import release_free_memory
from whale.weights.rows import TrainingRow

# Module-name parts that mark a non-language tower of a multimodal model.
_NON_TEXT_PARTS = ("visual", "vision", "multi_modal_projector", "mm_projector", "audio")
# Config keys that make logits something other than lm_head(hidden): chunked CE would be wrong.
# In a subfolder: vLLM (and other loaders) read every top-level *.safetensors of a checkpoint.
MASTERS_FILE = "fp32_master/master_weights.safetensors"
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def is_non_text_module(name: str) -> bool:
    return any(tag in part for part in name.split(".") for tag in _NON_TEXT_PARTS)


def lora_target_modules(model: nn.Module, spec: str | list[str]) -> tuple[list[str], list[str]]:
    """Pick LoRA targets on the language model only.

    Returns (target suffixes, excluded full names) for peft's `target_modules`/`exclude_modules`.
    Suffixes keep the adapter config conventional (q_proj, down_proj, ...); the exclusion list
    removes same-named layers of a vision tower and the output head.
    """
    names = [spec] if isinstance(spec, str) and spec != "all-linear" else spec
    head = model.get_output_embeddings()
    kept, dropped = [], []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)):
            continue
        if names != "all-linear" and name.split(".")[-1] not in names:
            continue
        (dropped if module is head or is_non_text_module(name) else kept).append(name)
    if not kept:
        raise ValueError(f"weight.lora.target_modules={spec!r} matches no linear layer of the language model")
    suffixes = sorted({n.split(".")[-1] for n in kept})
    excluded = [n for n in dropped if n.split(".")[-1] in suffixes]
    return suffixes, excluded


def wrap_lora(model: nn.Module, lora: LoraConfig, seed: int = 0) -> nn.Module:
    """Return a peft model around `model` (modified in place); adapter init is seeded."""
    suffixes, excluded = lora_target_modules(model, lora.target_modules)
    config = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=suffixes, exclude_modules=excluded or None,
                            bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def pack_micro_batches(rows: list[TrainingRow], max_tokens: int) -> list[list[TrainingRow]]:
    """Greedy packing by padded size (rows x longest row <= max_tokens), longest rows first so
    similar lengths share a micro-batch. A row longer than max_tokens gets a micro-batch alone."""
    out: list[list[TrainingRow]] = []
    for row in sorted(rows, key=lambda r: len(r.input_ids), reverse=True):
        if out and (len(out[-1]) + 1) * len(out[-1][0].input_ids) <= max_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def _chunk_nll(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    return F.cross_entropy(logits, targets, reduction="sum")


class Trainer:
    """Online SFT on the engine's model. `train_step(rows)` is one RSFT weight update.

    One process, one device. whale/weights/distributed.py's `ShardedTrainer` is this class on one
    rank of an FSDP2 group: it overrides the hooks marked "rank hook" below (which rows this
    process trains, the token count across ranks, the full state for a checkpoint), so the loss,
    mini-batches and checkpoint layout stay the ones written here.

    Parameters:
        model: the causal LM the engine serves (wrapped with LoRA here unless `finetune: full`).
        tokenizer: its tokenizer (pad id; saved next to full checkpoints).
        cfg: `WeightConfig`.
        seed: adapter init and mini-batch shuffling.
        temperature: logits are divided by it, as in the paper (T = sampling temperature = 1.0).
        chunked: use chunked cross-entropy; None = when the architecture allows it.
        chunk_tokens: loss positions per lm_head chunk.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, cfg: WeightConfig, seed: int = 0, *,
                 temperature: float = 1.0, chunked: bool | None = None, chunk_tokens: int = 1024):
        if temperature <= 0:
            raise ValueError(f"training temperature must be > 0, got {temperature}")
        if cfg.mini_batch_trajectories < 1 or cfg.micro_batch_tokens < 1:
            raise ValueError("weight.mini_batch_trajectories and weight.micro_batch_tokens must be >= 1")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.step = 0  # optimizer steps taken, across train_step calls and phases
        self.version: str | None = None
        self._rng = random.Random(seed)

        if cfg.finetune == "lora":
            self.model = model if isinstance(model, PeftModel) else wrap_lora(model, cfg.lora, seed)
        else:
            self.model = model
            for name, p in model.named_parameters():
                p.requires_grad_(not is_non_text_module(name))
        if cfg.gradient_checkpointing:
            self._base().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if cfg.finetune == "lora":
                self.model.enable_input_require_grads()
        self._shard()
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        if not self.params:
            raise ValueError("nothing to train: the model has no trainable parameters")
        # fp32 masters of the parameters stored in lower precision (module docstring)
        self.masters = {n: p.detach().float().clone() for n, p in named if p.dtype != torch.float32}
        self._low_precision = [(p, self.masters[n]) for n, p in named if n in self.masters]
        self.optimized = [self.masters.get(n, p) for n, p in named]  # what AdamW updates
        self.optimizer = torch.optim.AdamW(self.optimized, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        supported = self._head_split() is not None and self.world == 1  # sharded: see ShardedTrainer
        if chunked and not supported:
            raise ValueError("chunked cross-entropy is not supported for this architecture")
        self.chunked = supported if chunked is None else chunked
        self.model.eval()

    # ------------------------------------------------------------------ rank hooks (one process: identities)
    in_process = True  # the engine of this process may serve `self.model` itself (attach)
    world = 1  # training processes sharing each mini-batch (ShardedTrainer: the group's size)

    def _shard(self) -> None:
        """Rank hook: wrap the model for data-parallel training before the optimizer sees its parameters."""

    def _rank_rows(self, batch: list[TrainingRow]) -> list[TrainingRow]:
        """Rank hook: the rows of a mini-batch this process trains."""
        return batch

    def _all_sum(self, value: Any) -> Any:
        """Rank hook: an int or float summed over the ranks (a loss-token count, the step's stats)."""
        return value

    def _aligned(self, micros: list[list[TrainingRow]], batch: list[TrainingRow]) -> list[tuple[list[TrainingRow], float]]:
        """Rank hook: (micro-batch, loss weight) pairs; every rank must run as many forwards."""
        return [(m, 1.0) for m in micros]

    def _clip(self, max_norm: float) -> float:
        """Rank hook: clip the gradient to `max_norm` and return its norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.optimized, max_norm))

    def _full_state(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
        """Rank hook: (model state dict or None for `save_pretrained`'s own, optimizer state dict)."""
        return None, self.optimizer.state_dict()

    @property
    def writer(self) -> bool:
        """Rank hook: whether this process writes checkpoints."""
        return True

    def _after_save(self) -> None:
        """Rank hook: wait until the writer has written."""

    def close(self) -> None:
        """Nothing to release in one process (a training group stops its workers)."""

    # ------------------------------------------------------------------ model plumbing
    def _base(self) -> nn.Module:
        """The transformers causal LM inside the (possibly peft-wrapped) model."""
        return self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model

    def _head_split(self) -> tuple[nn.Module, nn.Linear] | None:
        """(backbone returning hidden states, lm_head) when logits == lm_head(hidden), else None."""
        base = self._base()
        head = base.get_output_embeddings()
        backbone = getattr(base, "model", None)
        if not isinstance(head, nn.Linear) or not isinstance(backbone, nn.Module):
            return None
        configs = [base.config, base.config.get_text_config()]
        for c in configs:
            for key in _LOGIT_TRANSFORMS:
                if getattr(c, key, None) not in (None, 1, 1.0):
                    return None
        return backbone, head

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def attach(self, engine: Any) -> None:
        """Make an in-process engine serve the trained object (the peft wrapper after LoRA wrapping)."""
        if engine.weight_sync != "in_place":
            raise ValueError(f"attach needs an engine with weight_sync 'in_place', not {engine.weight_sync!r}")
        engine.serve_model(self.model)

    def _collate(self, rows: list[TrainingRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(r.input_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            n = len(r.input_ids)
            ids[i, :n] = torch.tensor(r.input_ids)
            attn[i, :n] = 1
            mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.bool)
        dev = self.device
        return ids.to(dev), attn.to(dev), mask.to(dev)

    def _nll_sum(self, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor,
                 chunked: bool | None = None) -> torch.Tensor:
        """Summed NLL of the tokens with mask 1 (token t predicted from positions < t)."""
        chunked = self.chunked if chunked is None else chunked
        select = mask[:, 1:]
        targets = ids[:, 1:][select]
        if chunked:
            backbone, head = self._head_split()  # type: ignore[misc]
            out = backbone(input_ids=ids, attention_mask=attn, use_cache=False)
            hidden = out.last_hidden_state[:, :-1][select]
            total = hidden.new_zeros((), dtype=torch.float32)
            for i in range(0, hidden.shape[0], self.chunk_tokens):
                total = total + checkpoint(_chunk_nll, hidden[i:i + self.chunk_tokens], head.weight, head.bias,
                                           targets[i:i + self.chunk_tokens], self.temperature, use_reentrant=False)
            return total
        logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        return _chunk_nll_from_logits(logits[:, :-1][select], targets, self.temperature)

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def mean_nll(self, rows: list[TrainingRow], chunked: bool | None = None) -> float:
        """Token-mean NLL over the loss-mask tokens of `rows`, without training (eval mode)."""
        total, count = 0.0, 0
        for micro in pack_micro_batches(rows, self.cfg.micro_batch_tokens):
            ids, attn, mask = self._collate(micro)
            total += float(self._nll_sum(ids, attn, mask, chunked))
            count += int(mask[:, 1:].sum())
        return total / max(count, 1)

    def minibatches(self, rows: list[TrainingRow]) -> list[list[TrainingRow]]:
        """Rows grouped by trajectory, trajectories shuffled, `mini_batch_trajectories` per batch."""
        groups: dict[str, list[TrainingRow]] = {}
        for r in rows:
            groups.setdefault(r.trajectory_key, []).append(r)
        keys = list(groups)
        self._rng.shuffle(keys)
        m = self.cfg.mini_batch_trajectories
        return [[r for k in keys[i:i + m] for r in groups[k]] for i in range(0, len(keys), m)]

    def _grads_to_masters(self) -> None:
        """Add the low-precision gradients of the last backward into the fp32 masters."""
        for p, master in self._low_precision:
            if p.grad is not None:
                grad = p.grad.float()
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                p.grad = None

    @torch.no_grad()
    def _masters_to_params(self) -> None:
        """Round the fp32 masters into the served parameters (in place: the engine sees them)."""
        for p, master in self._low_precision:
            p.copy_(master)

    def train_step(self, rows: list[TrainingRow]) -> dict[str, float]:
        """One epoch over `rows`: one clipped optimizer step per mini-batch of trajectories."""
        if not rows:
            raise ValueError("train_step needs at least one training row")
        t0 = time.perf_counter()
        total_nll, loss_tokens, input_tokens, steps, norms = 0.0, 0, 0, 0, []
        self.model.train()
        try:
            for batch in self.minibatches(rows):
                mine = self._rank_rows(batch)
                # the token mean over the whole mini-batch: every rank divides by the same count and
                # scales by the group's size, which the gradient's average over ranks divides out
                n_loss = self._all_sum(sum(int(sum(r.loss_mask[1:])) for r in mine))
                if n_loss == 0:
                    continue
                for micro, weight in self._aligned(pack_micro_batches(mine, self.cfg.micro_batch_tokens), batch):
                    ids, attn, mask = self._collate(micro)
                    nll = self._nll_sum(ids, attn, mask)
                    (nll / n_loss * (self.world * weight)).backward()
                    self._grads_to_masters()
                    if weight:
                        total_nll += float(nll.detach())
                        input_tokens += int(attn.sum())
                max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
                norms.append(self._clip(max_norm))
                self.optimizer.step()
                self._masters_to_params()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                loss_tokens += n_loss
                steps += 1
                self.step += 1
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            self.model.eval()
            release_free_memory()  # the step's activations were freed into the heap: give the pages back
        total_nll, input_tokens = self._all_sum(total_nll), self._all_sum(input_tokens)
        return {
            "loss": total_nll / max(loss_tokens, 1),
            "trained_tokens": loss_tokens,
            "input_tokens": input_tokens,
            "rows": len(rows),
            "optimizer_steps": steps,
            "grad_norm": max(norms) if norms else 0.0,
            "lr": self.scheduler.get_last_lr()[0],
            "seconds": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path, version: str) -> Path:
        """Write the adapter (PEFT folder) or full weights plus `trainer_state.pt`, atomically:
        into a temp sibling that replaces `directory` only once complete. In a training group every
        rank calls it (gathering the state is a collective) and the writer rank writes."""
        directory = Path(directory)
        weights, optimizer = self._full_state()
        if self.writer:
            self._write_atomically(directory, version, weights, optimizer)
        self._after_save()
        self.version = version
        return directory

    def _write_atomically(self, directory: Path, version: str, weights: dict[str, torch.Tensor] | None,
                          optimizer: dict[str, Any]) -> None:
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._write(tmp, version, weights, optimizer)
        except Exception as exc:  # safetensors and torch.save hide the errno; ask the disk (errors.py)
            failure = storage_error(exc, directory, f"saving weights {version}")
            shutil.rmtree(tmp, ignore_errors=True)  # never a half checkpoint; state.json still names the last one
            if failure is None:
                raise
            raise failure from exc
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)

    def _write(self, tmp: Path, version: str, weights: dict[str, torch.Tensor] | None,
               optimizer: dict[str, Any]) -> None:
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp, state_dict=weights)
        if self.cfg.finetune == "full" and self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        state = {
            "finetune": self.cfg.finetune,
            "version": version,
            "step": self.step,
            "world": self.world,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "python_rng": self._rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        torch.save(state, tmp / "trainer_state.pt")
        if self.masters:
            (tmp / MASTERS_FILE).parent.mkdir()
            save_file(self.masters, tmp / MASTERS_FILE)

    def load(self, directory: str | Path) -> str:
        """Restore weights, fp32 masters, optimizer, scheduler, step and RNG from `save`; returns
        the version. A checkpoint without masters (saved before they existed) restarts them from
        the weights."""
        directory = Path(directory)
        state_path = directory / "trainer_state.pt"
        if not state_path.exists():
            raise ValueError(f"{directory} is not a trainer checkpoint (no trainer_state.pt)")
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state["finetune"] != self.cfg.finetune:
            raise ValueError(f"{directory} holds a '{state['finetune']}' checkpoint but weight.finetune "
                             f"is '{self.cfg.finetune}'")
        if state.get("world", 1) != self.world:
            raise ValueError(f"{directory} was saved by {state.get('world', 1)} training ranks, this trainer has "
                             f"{self.world}: keep compute.train_ranks as the run started with")
        self._load_weights(directory)
        self._load_optimizer(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self._rng.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.version = state["version"]
        return self.version

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        """Rank hook: restore the optimizer from what `_full_state` returned."""
        self.optimizer.load_state_dict(state)

    def _load_weights(self, directory: Path) -> None:
        """Rank hook: the saved adapter or full weights (and fp32 masters) into the model."""
        device = str(self.device)
        if self.cfg.finetune == "lora":
            weights = load_file(directory / "adapter_model.safetensors", device=device)
            result = set_peft_model_state_dict(self.model, weights)
            if result.unexpected_keys:
                raise ValueError(f"{directory}: adapter does not fit this model "
                                 f"(unexpected {result.unexpected_keys[:3]})")
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{directory} has no *.safetensors weights")
            weights = {}
            for f in files:
                weights.update(load_file(f, device=device))
            result = self.model.load_state_dict(weights, strict=False)
            current = self.model.state_dict()
            loaded = {current[k].data_ptr() for k in weights if k in current}
            untied = [k for k in result.missing_keys if current[k].data_ptr() not in loaded]
            if result.unexpected_keys or untied:
                raise ValueError(f"{directory}: weights do not fit this model "
                                 f"(unexpected {result.unexpected_keys[:3]}, missing {untied[:3]})")
        self._load_masters(directory)

    def _load_masters(self, directory: Path) -> None:
        path = directory / MASTERS_FILE
        if not self.masters:
            return
        if not path.exists():
            with torch.no_grad():
                for p, master in self._low_precision:
                    master.copy_(p.float())
            return
        saved = load_file(path, device=str(self.device))
        if set(saved) != set(self.masters):
            raise ValueError(f"{path}: master weights do not fit this model "
                             f"(differ in {sorted(set(saved) ^ set(self.masters))[:3]})")
        with torch.no_grad():
            for name, master in self.masters.items():
                master.copy_(saved[name])
        self._masters_to_params()


def _chunk_nll_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return F.cross_entropy(logits, targets, reduction="sum")
