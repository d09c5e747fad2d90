"""One forward for a decode step and a prefill together (CPU): the packed layout and its attention.

Why: on a CPU the cost of a forward is its Linear GEMMs, and every forward streams every weight
from memory. A decode step of ~30 rows does little work per weight byte (M = rows), and when
sequences join a running batch the scheduler ran the newcomers' prefill forward and then, a moment
later, the live rows' decode step: the weights twice. A mixed forward runs both at once: all the
step's tokens in ONE row of the batch ("packed": no padding), the live rows' next tokens first,
then each newcomer's prompt suffix, each token written to its own (slab row, column) by
`SlabView`. Every Linear then runs once, at M = live rows + newcomers' tokens.

Attention cannot be one call over a packed row (each token reads its own slab row), so per layer
it is two calls, each what the plain forwards do:
- the decode tokens: `slab_decode_attention` over the live rows' slab block;
- the prefill tokens: gathered into [newcomers, longest suffix] (left-padded), sdpa over their own
  rows' columns under the causal mask (`slab_prefill_attention`), and scattered back.
A token still sees only its own row's columns, so what it samples does not depend on who else is
in the forward, up to the rounding of a different GEMM shape (as for any batch).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from whale.engine.attention import decode_columns, decode_mask, slab_decode_attention, slab_prefill_attention
from whale.engine.jobs import Seq

NAME = "whale_mixed"
_local = threading.local()  # the plan of the forward running on this thread (the engine thread)


@dataclass
class MixedPlan:
    """Where each token of a packed forward sits and what it attends to."""

    n_decode: int  # the first n_decode tokens: one per live row 0..n_decode-1
    decode_cols: int  # slab columns the decode tokens' attention reads (attention.decode_columns)
    decode_mask: torch.Tensor  # [n_decode, 1, 1, decode_cols], as attention.decode_mask makes it
    first_row: int  # the newcomers' slab rows are first_row, first_row + 1, ...
    gather: torch.Tensor  # [newcomers, width]: packed index of each (newcomer, query slot); pads repeat one
    valid: torch.Tensor  # [newcomers, width] bool: slot holds a real query
    prefill_cols: int
    prefill_mask: torch.Tensor  # bool [newcomers, 1, width, prefill_cols]


def mixed_inputs(decode: list[Seq], newcomers: list[Seq], slab_cols: int, device: torch.device):
    """(ids, positions, write rows, write cols, each [1, T]; logits to keep [K]; plan) for one packed
    forward: the decode rows' next tokens (rows 0..n-1 in order), then each newcomer's prompt from
    its `start` on (consecutive rows). Kept logits: the decode rows', then each newcomer's last.
    The decode tokens attend over the slab columns a plain decode step reads (of `slab_cols`),
    masked beyond each row's own."""
    n = len(decode)
    assert all(s.row == i for i, s in enumerate(decode)), "decode rows must be the slab's first rows"
    first_row = newcomers[0].row
    assert all(s.row == first_row + j for j, s in enumerate(newcomers)), "newcomers' rows must be consecutive"
    lengths = [len(s.prompt) - s.start for s in newcomers]
    total = n + sum(lengths)
    ids = torch.empty(total, dtype=torch.long)
    pos = torch.empty(total, dtype=torch.long)
    rows = torch.empty(total, dtype=torch.long)
    kv = torch.tensor([s.kv_len for s in decode], dtype=torch.long)
    ids[:n] = torch.tensor([s.next_token() for s in decode], dtype=torch.long)
    pos[:n], rows[:n] = kv, torch.arange(n)
    width = max(lengths)
    prefill_cols = max(len(s.prompt) for s in newcomers) + 1
    gather = torch.zeros((len(newcomers), width), dtype=torch.long)
    valid = torch.zeros((len(newcomers), width), dtype=torch.bool)
    mask = torch.zeros((len(newcomers), 1, width, prefill_cols), dtype=torch.bool)
    arange = torch.arange(prefill_cols)
    keep, at = list(range(n)), n
    for j, (s, length) in enumerate(zip(newcomers, lengths)):
        ids[at : at + length] = torch.tensor(s.prompt[s.start :], dtype=torch.long)
        pos[at : at + length] = torch.arange(s.start, len(s.prompt))
        rows[at : at + length] = s.row
        pad = width - length
        gather[j, pad:] = torch.arange(at, at + length)
        gather[j, :pad] = at  # pads read a real query; their outputs are never scattered back
        valid[j, pad:] = True
        mask[j, 0, pad:] = arange <= pos[at : at + length].unsqueeze(-1)
        mask[j, 0, :pad, 0] = True  # a query that sees nothing would give NaN
        keep.append(at + length - 1)
        at += length
    decode_cols = decode_columns(kv, slab_cols)
    plan = MixedPlan(n, decode_cols, decode_mask(kv, decode_cols).to(device), first_row, gather.to(device), valid.to(device),
                     prefill_cols, mask.to(device))
    as_batch = [t.unsqueeze(0).to(device) for t in (ids, pos, rows, pos)]
    return (*as_batch, torch.tensor(keep, device=device), plan)


def mixed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, q_heads, T, dim] packed as `_local.plan` says; key/value [rows, kv_heads, cols, dim]
    from slab row 0 on. Returns [1, T, q_heads, dim] like transformers' attention functions."""
    plan: MixedPlan = _local.plan
    q = query[0]  # [q_heads, T, dim]
    out = query.new_empty((q.shape[1], q.shape[0], q.shape[2]))
    n = plan.n_decode
    if n:
        cols = plan.decode_cols
        od, _ = slab_decode_attention(module, q[:, :n].transpose(0, 1).unsqueeze(2), key[:n, :, :cols],
                                      value[:n, :, :cols], plan.decode_mask, scaling=scaling)
        out[:n] = od[:, 0]
    rows = slice(plan.first_row, plan.first_row + plan.gather.shape[0])
    qp = q[:, plan.gather].transpose(0, 1)  # [newcomers, q_heads, width, dim]
    op, _ = slab_prefill_attention(module, qp, key[rows, :, : plan.prefill_cols], value[rows, :, : plan.prefill_cols],
                                   plan.prefill_mask, scaling=scaling)
    out[plan.gather[plan.valid]] = op[plan.valid]  # op: [newcomers, width, q_heads, dim]
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, mixed_attention)


@contextmanager
def mixed_forward(model, plan: MixedPlan):
    """Run the forwards inside with `mixed_attention` following `plan` (the engine thread owns the model)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    _local.plan = plan
    try:
        yield
    finally:
        config._attn_implementation = previous
        _local.plan = None
