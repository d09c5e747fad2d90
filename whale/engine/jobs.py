"""What the hf engine's scheduler works on, and how one token or one choice is drawn.

A `Job` is one submitted request and its future; a sample job becomes `n` `Seq`s (one per sample,
each with its own uniform stream), a choice job one or more `ChoiceRow`s. Futures are resolved
exactly once, with generations (errors included), never with an exception.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from whale.engine.base import GenerationRequest, SamplingParams, error_generations
from whale.engine.kv import common_prefix


@dataclass(eq=False)
class Job:
    """One submitted request: `kind` "sample" (n sequences), "choice" (draw among choices) or
    "score" (return log p of each choice; `HFEngine.choice_logprobs`)."""

    future: Future
    kind: str
    prompt: list[int]
    sampling: SamplingParams
    request: GenerationRequest | None = None
    seeds: list[int] = field(default_factory=list)
    max_new: int = 0
    stop: list[str] = field(default_factory=list)
    choice_ids: list[list[int]] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    scores: torch.Tensor | None = None
    remaining: int = 0
    started: bool = False
    done: bool = False
    order: int | None = None  # admission order within a step under a lockstep (engine/lockstep.py)
    gate: Any = None  # that Lockstep, told when the job resolves (before its future is set)
    client: int = -1
    due: int | None = None  # the engine step it may be admitted at, under that lockstep


@dataclass(eq=False)
class Seq:
    """Sample `index` of a sample job. Its slab row holds the KV of (prompt + ids)[:kv_len]."""

    job: Job
    index: int
    prompt: list[int]
    prompt_np: np.ndarray
    uniforms: list[float]
    stop_window: int
    ids: list[int] = field(default_factory=list)
    kv_len: int = 0
    finish: str | None = None
    start: int = 0  # prompt columns copied from a shared prefix
    row: int = -1
    tree: list[list[int]] = field(default_factory=list)  # no choice tokens

    def next_token(self) -> int:
        """The token the next decode step feeds: the last prompt token while the prompt is not all
        in the KV (a row that joined from a shared prefix), then the last sampled one."""
        return self.prompt[self.kv_len] if self.kv_len < len(self.prompt) else self.ids[-1]


@dataclass(eq=False)
class ChoiceRow:
    """Some choices of a choice/score job, scored in one row after the prompt."""

    job: Job
    choices: list[int]  # indices into job.choice_ids
    prompt: list[int]
    prompt_np: np.ndarray
    start: int = 0
    row: int = -1

    @property
    def tree(self) -> list[list[int]]:
        return [self.job.choice_ids[c] for c in self.choices]


def shared_with_live(item: Seq | ChoiceRow, seq: Seq) -> int:
    """Leading tokens of `item`'s prompt whose KV the live sequence `seq` already holds: a common
    prefix of the prompts, continued into `seq`'s generated tokens when the prompt extends its
    prompt (an episode's next call while its previous one is still in the slab)."""
    n = common_prefix(item.prompt_np, seq.prompt_np)
    if n == len(seq.prompt):
        rest = item.prompt[n:]
        k = 0
        while k < len(rest) and k < len(seq.ids) and rest[k] == seq.ids[k]:
            k += 1
        n += k
    return min(n, seq.kv_len)


def choice_rows(job: Job, token_budget: int) -> list[ChoiceRow]:
    """A choice job's choices, in order, in rows of at most `token_budget` choice tokens each
    (a single longer choice gets a row of its own): one row is one sequence of a scoring forward."""
    prompt_np = np.asarray(job.prompt, dtype=np.int64)
    rows: list[ChoiceRow] = []
    group: list[int] = []
    size = 0
    for c, choice in enumerate(job.choice_ids):
        if group and size + len(choice) > token_budget:
            rows.append(ChoiceRow(job, group, job.prompt, prompt_np))
            group, size = [], 0
        group.append(c)
        size += len(choice)
    rows.append(ChoiceRow(job, group, job.prompt, prompt_np))
    return rows


def sample_rows(seqs: list[Seq], logits: torch.Tensor) -> list[int]:
    """Each sequence's next token from its row of `logits`, with its own uniform for this step and
    its own request's sampling parameters (rows with equal parameters are sampled together)."""
    u = torch.tensor([s.uniforms[len(s.ids)] for s in seqs], device=logits.device)
    first = seqs[0].job.sampling
    if all(s.job.sampling == first for s in seqs):
        return sample_tokens(logits, u, first).tolist()
    tokens = [0] * len(seqs)
    groups: dict[SamplingParams, list[int]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(s.job.sampling, []).append(i)
    for sampling, idx in groups.items():
        for i, tok in zip(idx, sample_tokens(logits[idx], u[idx], sampling).tolist()):
            tokens[i] = tok
    return tokens


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Next token per row by inverse-CDF sampling with the row's uniform `u` (greedy at T=0)."""
    if sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if sampling.temperature != 1.0:  # x / 1.0 is x: skip a pass over [rows, vocab]
        logits = logits / sampling.temperature
    order = None
    if 0 < sampling.top_k < logits.shape[-1]:
        logits, order = logits.topk(sampling.top_k, dim=-1)  # sorted, largest first
    elif sampling.top_p < 1.0:
        logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:  # nucleus: keep the smallest prefix with mass >= top_p
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= sampling.top_p, 0.0)
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp_(max=cdf.shape[-1] - 1)
    return (pick if order is None else order.gather(-1, pick)).squeeze(-1)


def weights_stamp(model: Any) -> tuple[int, int]:
    """Changes whenever a parameter is modified in place (autograd's version counters) or swapped."""
    return id(model), sum(p._version for p in model.parameters())


def start_job(job: Job) -> bool:
    """Mark a job as running; False if its future was cancelled (then it is dropped)."""
    if job.done:
        return False
    if not job.started:
        job.started = True
        if not job.future.set_running_or_notify_cancel():
            job.done = True
            return False
    return True


def _wake(job: Job) -> None:
    if job.gate is not None:
        job.gate.wake(job.client)


def resolve_job(job: Job) -> None:
    if not job.done:
        job.done = True
        _wake(job)
        job.future.set_result(job.results)


def fail_job(job: Job, message: str) -> None:
    if not job.done:
        job.done = True
        _wake(job)
        if not job.started and not job.future.set_running_or_notify_cancel():
            return
        job.future.set_result(error_generations(message))

