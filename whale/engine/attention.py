"""The engine's attention on the KV slab (CPU): decode, one query token per row against its row's
live columns; prefill in bfloat16, matmul-softmax-matmul.

Decode (`slab_decode_attention`): torch's sdpa kernel, called directly with `enable_gqa`, over the
columns the live rows use (the longest row's; a strided view of the slab, no copy), under a
boolean mask. It replaced two plain matmuls over the slab's whole contiguous block (stale columns
and growth headroom included): whole search-QA replays 1.04x [1.03, 1.06] faster in float32 (same
ids) and math replays 1.11x [1.07, 1.15] in bfloat16 (benchmarks/workloads.py, 2026-12-06, the
2-core AMX Xeon; docs/performance.md). The scheduler selects this function for its own decode
forwards only, on CPU, by switching the model's attention implementation for the duration of the
forward (the engine thread owns the model then); training keeps transformers' sdpa.

Prefill (`slab_prefill_attention`): in bfloat16 the prefill attention is two batched matmuls
around an fp32 softmax (`grouped_math_attention`), the query heads of a group stacked as rows of
one GEMM: on a 2-core AMD EPYC (Zen 4, AVX512-BF16) torch's CPU flash kernel reached 44-66 GFLOP/s
at the engine's prefill shapes and this 1.34-1.76x that (benchmarks/prefill_attention.py); whole
search-QA replays 1.09x [1.04, 1.16] and chess replays 1.07x [1.03, 1.10] faster there (no effect
shown on the AMX Xeon: 1.02x [0.94, 1.10]). Its bits are not sdpa's (another summation order), so
bf16 samples change against the flash kernel, as batch shapes already change them in bf16.
Everything else (float32, no mask, one query token, another device, softcap, sinks, a position
bias, dropout, scores past `MATH_PREFILL_MAX_SCORES`) goes to transformers' sdpa wrapper unchanged.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "whale_slab_decode"
PREFILL_NAME = "whale_slab_prefill"
MATH_PREFILL_MAX_SCORES = 1 << 25  # fp32 scores per call (128 MiB) past which the math path leaves it to sdpa


def slab_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [rows, q_heads, 1, dim]; key/value [rows, kv_heads, cols, dim] (the live columns, a
    strided view of the slab); the boolean mask [rows, 1, 1, cols] of `decode_allowed`. sdpa's
    kernel reads each query head's KV head itself. Returns [rows, 1, q_heads, dim] like
    transformers' attention functions."""
    if (query.shape[2] != 1 or attention_mask.dtype != torch.bool or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2), None


AttentionInterface.register(NAME, slab_decode_attention)


def slab_prefill_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Prefill attention of query [rows, q_heads, width, dim] over key/value [rows, kv_heads, cols,
    dim] under a 4D mask: `grouped_math_attention` where `math_prefill_serves`, else transformers'
    sdpa wrapper unchanged (so its bits). Returns [rows, width, q_heads, dim]."""
    if (attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu" or dropout
            or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None
            or query.shape[1] % key.shape[1] or not math_prefill_serves(query, key, attention_mask)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    return grouped_math_attention(query, key, value, attention_mask, scaling), None


def math_prefill_serves(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether `grouped_math_attention` takes this prefill call: bfloat16, scores within
    MATH_PREFILL_MAX_SCORES, and every query sees a column (a fully masked row would be NaN here)."""
    rows, q_heads, width, _ = query.shape
    return (query.dtype == torch.bfloat16
            and rows * q_heads * width * key.shape[2] <= MATH_PREFILL_MAX_SCORES and _prepared(mask)[0])


class _PreparedMask(threading.local):
    """The last mask `_prepared` saw (a forward passes the same one to every layer) and what it made of it."""

    key: tuple | None = None
    ref: weakref.ref | None = None
    value: tuple[bool, torch.Tensor] | None = None


_last_mask = _PreparedMask()


def _prepared(mask: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """(every query sees a column, the mask as an fp32 additive one), made once per mask: building
    them per layer cost as much as a fifth of the attention (and `masked_fill_` on the broadcast
    scores four times an `add_` of this)."""
    key = (id(mask), mask._version, tuple(mask.shape))
    if _last_mask.key == key and _last_mask.ref() is mask:
        return _last_mask.value
    if mask.dtype == torch.bool:
        sees = bool(mask.any(-1).all())
        additive = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    else:
        sees = bool((mask > torch.finfo(mask.dtype).min).any(-1).all())
        additive = mask.float()
    _last_mask.key, _last_mask.ref, _last_mask.value = key, weakref.ref(mask), (sees, additive)
    return sees, additive


def grouped_math_attention(query, key, value, mask, scaling=None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for query [rows, q_heads, width, dim] over key/value [rows,
    kv_heads, cols, dim] under a 4D mask [rows, 1, width, cols] (bool: True attends; else
    additive), the query heads of a KV head stacked into one [group * width, dim] GEMM operand
    (query head h reads KV head h // group, as transformers' repeat_kv has it); fp32 scores and
    softmax. Returns [rows, width, q_heads, dim] (contiguous)."""
    rows, q_heads, width, dim = query.shape
    kv_heads, cols = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    q = query.reshape(rows, kv_heads, group * width, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float().mul_(scale).view(rows, q_heads, width, cols)
    scores.add_(_prepared(mask)[1])
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(rows, kv_heads, group * width, cols)
    return torch.matmul(probs, value).view(rows, q_heads, width, dim).transpose(1, 2).contiguous()


AttentionInterface.register(PREFILL_NAME, slab_prefill_attention)


def decode_allowed(kv_len: torch.Tensor, cols: int) -> torch.Tensor:
    """Which of `cols` columns each decode token (at position kv_len[i]) attends, as a boolean
    [rows, 1, 1, cols]: its columns 0..kv_len[i] (its own token included), none of the stale ones."""
    return (torch.arange(cols) <= kv_len.unsqueeze(-1)).view(kv_len.shape[0], 1, 1, cols)


@contextmanager
def decode_attention(model, enabled: bool = True):
    """Use `slab_decode_attention` for the forwards inside, in place of sdpa; yields whether it does."""
    with _attention(model, NAME, enabled) as used:
        yield used


@contextmanager
def prefill_attention(model, enabled: bool = True):
    """Use `slab_prefill_attention` for the forwards inside, in place of sdpa; yields whether it does."""
    with _attention(model, PREFILL_NAME, enabled) as used:
        yield used


@contextmanager
def _attention(model, name: str, enabled: bool):
    config = model.config
    previous = config._attn_implementation
    if not enabled or previous != "sdpa":
        yield False
        return
    config._attn_implementation = name
    try:
        yield True
    finally:
        config._attn_implementation = previous
