"""The hf engine's model forwards: a prefill chunk and a decode step.

Why apart from the scheduler: engine/scheduler.py decides WHAT runs at each step (admission,
prefix sources, prefill rounds, retirement); `Forwards` runs it. It builds each forward's inputs
over the KV slab, calls the model, draws every row's token from that row's own uniform and counts
the work in the scheduler's `stats`. It holds nothing of its own beyond references to its
`ModelHost` (what it needs of the engine, declared below), the slab and the stats, so the
scheduler's state stays in one place.

Two forwards:
- `prefill`: the prompt suffixes (and choice trees) of consecutive slab rows, padded to the
  longest (engine/prefill.py builds the inputs); on CPU in bfloat16 its attention is
  matmul-softmax-matmul (engine/attention.py), and it runs on the engine's prefill threads
  (every core by default: engine/hf.py `engine_prefill_threads`);
- `decode`: one token of every live row, its attention over the slab's live columns
  (engine/attention.py) on CPU.

On CPU in bfloat16 every forward runs its Linear layers of up to 64 rows on weights packed once
(engine/packed.py): decode steps, and prefill's lm_head over the kept rows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import torch

from whale.engine.adapted import AdaptedLinears
from whale.engine.attention import decode_allowed, decode_attention, prefill_attention
from whale.engine.jobs import ChoiceRow, Seq, sample_rows
from whale.engine.kv import KVSlab
from whale.engine.packed import PackedLinears
from whale.engine.prefill import choice_scores, prefill_inputs, tree_len


class ModelHost(Protocol):
    """What the forwards need of the engine that owns them (engine/hf.py's HFEngine): the model
    served now (it changes with `load_weights`) and how to call it, the token ids that end a
    sample, and its stop strings. Read at every forward, never written."""

    model: Any  # a transformers causal LM, possibly peft-wrapped
    cache_kwarg: str  # the forward argument that takes the KV cache
    device: torch.device
    dtype: torch.dtype
    prefill_threads: int | None  # CPU: OpenMP threads of a prefill forward (None: leave the thread's)
    pad_id: int
    eos_ids: set[int]
    packed_linears: PackedLinears | None
    adapted_linears: AdaptedLinears | None

    def hit_stop(self, ids: list[int], stop: list[str], window: int) -> bool: ...


@contextmanager
def omp_threads(threads: int | None) -> Iterator[None]:
    """Run the block on `threads` OpenMP threads (this thread's count: OpenMP keeps one per thread),
    then go back to the count before; None leaves it."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Forwards:
    """The forwards of the scheduler's thread (the only thread that runs the model)."""

    def __init__(self, host: ModelHost, slab: KVSlab, stats: dict[str, float]):
        self.host = host
        self.slab = slab
        self.stats = stats

    # ------------------------------------------------------------------ the forwards

    def prefill(self, chunk: list[Seq] | list[ChoiceRow]) -> None:
        """One forward over the suffixes (and choice tokens) of `chunk`, whose rows are consecutive."""
        dev = self.host.device
        m = len(chunk)
        ids, pos, cols, mask, keep = prefill_inputs(chunk, self.host.pad_id)
        width, cols_needed = ids.shape[1], mask.shape[-1]
        self._count_prefill(chunk, padded=m * width)
        first = chunk[0].row
        rows = torch.arange(first, first + m).unsqueeze(-1).expand(m, width)
        view = self.slab.view(first, m, rows.to(dev), cols.to(dev), cols_needed)
        t0 = time.perf_counter()
        with prefill_attention(self.host.model, enabled=dev.type == "cpu"), omp_threads(self.host.prefill_threads):
            logits = self.model_forward(view, input_ids=ids.to(dev), attention_mask=self._mask(mask.to(dev)),
                                        position_ids=pos.to(dev), logits_to_keep=keep)
        seqs = [(j, it) for j, it in enumerate(chunk) if isinstance(it, Seq)]
        if seqs:
            for _, seq in seqs:
                seq.kv_len = len(seq.prompt)
            self._sample([s for _, s in seqs], logits[[j for j, _ in seqs], -1])
        for j, it in enumerate(chunk):
            if isinstance(it, ChoiceRow):
                choice_scores(it, logits[j])
        self.stats["prefill_seconds"] += time.perf_counter() - t0

    def decode(self, rows: list[Seq]) -> None:
        """One decode step of `rows` (slab rows 0..n-1, in order)."""
        dev = self.host.device
        n = len(rows)
        kv = torch.tensor([s.kv_len for s in rows])
        width = int(kv.max()) + 1
        self.slab.reserve(n, width)
        tokens = torch.tensor([[s.next_token()] for s in rows], device=dev)
        self._count_decode(rows)
        cols = kv.unsqueeze(-1).to(dev)
        mask = self._mask(decode_allowed(kv, width).to(dev))  # its live columns (the longest row's)
        view = self.slab.view(0, n, torch.arange(n, device=dev).unsqueeze(-1), cols, width)
        t0 = time.perf_counter()
        with decode_attention(self.host.model, enabled=dev.type == "cpu"):  # engine/attention.py
            logits = self.model_forward(view, input_ids=tokens, attention_mask=mask, position_ids=cols)
        for s in rows:
            s.kv_len += 1
        self._sample(rows, logits[:, -1])
        self.stats["decode_seconds"] += time.perf_counter() - t0

    def model_forward(self, cache, **kwargs) -> torch.Tensor:
        """The model's logits for one forward over `cache` (a slab view), in eval mode."""
        model = self.host.model
        training = model.training
        if training:  # the trainer may have left it in train mode: sample without dropout
            model.eval()
        packed = self.host.packed_linears  # CPU, bfloat16: engine/packed.py
        adapted = self.host.adapted_linears  # CPU: LoRA layers on joined weights, engine/adapted.py
        try:
            with (packed.installed(model) if packed is not None else nullcontext(),
                  adapted.installed(model) if adapted is not None else nullcontext()):
                out = model(use_cache=True, return_dict=True, **{self.host.cache_kwarg: cache}, **kwargs)
        finally:
            if training:
                model.train()
        return out.logits

    # ------------------------------------------------------------------ helpers

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """The 4D mask as the attention implementation wants it: bool for sdpa, additive otherwise."""
        if self.host.model.config._attn_implementation == "sdpa":
            return allowed
        dtype = self.host.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        """Append each sequence's next token (its own uniform for this step) and mark finished ones."""
        tokens = sample_rows(seqs, logits)
        eos = self.host.eos_ids
        for s, tok in zip(seqs, tokens):
            s.ids.append(tok)
            if tok in eos:
                s.finish = "stop"
            elif s.job.stop and self.host.hit_stop(s.ids, s.job.stop, s.stop_window):
                s.finish = "stop"
            elif len(s.ids) >= s.job.max_new:
                s.finish = "length"

    def _count_prefill(self, chunk: list[Seq] | list[ChoiceRow], padded: int) -> None:
        """Count one prefill forward over `chunk` (before it runs: `start` is the copied prefix)."""
        stats = self.stats
        for it in chunk:
            stats["prefill_tokens_requested"] += len(it.prompt)
            stats["prefill_tokens_computed"] += len(it.prompt) - it.start
            stats["choice_tokens"] += tree_len(it)
        stats["prefill_tokens_padded"] += padded
        stats["prefill_forwards"] += 1

    def _count_decode(self, rows: list[Seq]) -> None:
        """Count one decode step of `rows` (before it runs): a row still feeding its last prompt
        token (it joined with all the rest copied) generates nothing countable at this step."""
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += sum(1 for s in rows if s.kv_len >= len(s.prompt))
