"""Decode attention on the KV slab: one query token per row against all of its row's columns.

Why not sdpa here: for a single query token (a few query heads per KV head), torch's CPU
flash-attention kernel fed the slab's strided [rows, heads, :width] view ran about twice as slow as
two plain matmuls over the contiguous [rows, heads, all columns] block, stale columns included and
masked (benchmarks/kv_cache_decode.py). The scheduler selects this function for its own decode
forwards only, on CPU, by switching the model's attention implementation for the duration of the
forward (the engine thread owns the model then); prefill and training keep sdpa.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "whale_slab_decode"


def slab_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [rows, q_heads, 1, dim]; key/value [rows, kv_heads, cols, dim]; additive fp32 mask
    [rows, 1, 1, cols]. Returns [rows, 1, q_heads, dim] like transformers' attention functions."""
    if query.shape[2] != 1 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    rows, q_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim ** -0.5
    q = query.reshape(rows, kv_heads, q_heads // kv_heads, dim)  # query head h reads kv head h // group
    scores = torch.matmul(q, key.transpose(-1, -2)).float().mul_(scale).add_(attention_mask)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    return out.reshape(rows, 1, q_heads, dim), None


AttentionInterface.register(NAME, slab_decode_attention)


def decode_allowed(kv_len: torch.Tensor, cols: int) -> torch.Tensor:
    """Which of `cols` columns each decode token (at position kv_len[i]) attends, as a boolean
    [rows, 1, 1, cols]: its columns 0..kv_len[i] (its own token included), none of the stale ones."""
    return (torch.arange(cols) <= kv_len.unsqueeze(-1)).view(kv_len.shape[0], 1, 1, cols)


def slab_decode_mask(kv_len: torch.Tensor, cols: int) -> torch.Tensor:
    """`decode_allowed` as the additive fp32 mask `slab_decode_attention` adds to its scores."""
    allowed = decode_allowed(kv_len, cols)
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


def slab_decode_pays(slab_cols: int, width: int) -> bool:
    """Whether reading all `slab_cols` columns (contiguous) beats sdpa over the `width` columns the
    live rows use: yes unless most of the columns are beyond every live row."""
    return slab_cols <= 2 * width


@contextmanager
def decode_attention(model, enabled: bool = True):
    """Use `slab_decode_attention` for the forwards inside, in place of sdpa; yields whether it does."""
    config = model.config
    previous = config._attn_implementation
    if not enabled or previous != "sdpa":
        yield False
        return
    config._attn_implementation = NAME
    try:
        yield True
    finally:
        config._attn_implementation = previous
