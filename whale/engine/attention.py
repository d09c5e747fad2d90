"""The engine's attention on the KV slab (CPU): decode, one query token per row against its row's
columns; prefill, sdpa with the kernel's own grouped-query attention.

Decode (`slab_decode_attention`): torch's sdpa kernel, called directly with `enable_gqa`, over the
columns the live rows use (`decode_columns`: the longest row's; a strided view of the slab, no
copy), under a boolean mask. Until session 30 it was two plain matmuls over the slab's whole
contiguous [rows, heads, all columns] block, stale columns and the slab's growth headroom included
(about half of what they read on search QA): on the machine of 2026-12-01 they beat transformers'
sdpa path on the strided view by a quarter to a third per step. On the 2-core AMX Xeon of session
30 (torch 2.13) the direct sdpa call beat them at every decode shape measured: 1.3-3.8x per layer
in bfloat16, 1.06-1.9x in float32 (1 to 64 rows, slabs of 240-960 columns); search-QA replays
1.04x [1.03, 1.06] faster in float32 (same ids) and math's 1.11x [1.07, 1.15] in bfloat16
(docs/throughput.md). `SDPA_DECODE = False` restores the
matmuls (benchmarks/workloads.py's `matmul` variant compares them). The scheduler selects this
function for its own decode forwards only, on CPU, by switching the model's attention implementation
for the duration of the forward (the engine thread owns the model then); training keeps
transformers' sdpa.

Prefill (`slab_prefill_attention`): transformers' sdpa wrapper hands torch's kernel grouped-query
attention itself only where no mask is given; with the engine's 4D masks it repeats every KV head
for each query head it serves (`repeat_kv`: a copy of the layer's keys and values read from the
slab, ~0.3 s of a 9 s search-QA replay here). Torch's CPU kernels take the groups as they are
(`enable_gqa`), with the same bits (tests/test_engine_batching.py) and 10-55% less time per call.
In bfloat16 it goes further and computes prefill attention as the decode attention did before,
two batched matmuls around an fp32 softmax (`_grouped_attention`), the query heads of a group
stacked as rows of one GEMM: on a 2-core AMD EPYC (Zen 4, AVX512-BF16) torch's CPU flash kernel reached 44-66 GFLOP/s at the
engine's prefill shapes and this 1.34-1.76x that (benchmarks/prefill_attention.py). Its bits are
not sdpa's (another summation order), so bf16 samples change against the flash kernel, as batch
shapes already change them in bf16; float32 keeps sdpa and its bits.
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
GROUPED_PREFILL = True  # False: slab_prefill_attention is transformers' sdpa wrapper (benchmarks compare)
MATH_PREFILL = True  # bfloat16 prefill attention as matmul-softmax-matmul (False: sdpa's kernel; benchmarks compare)
SDPA_DECODE = True  # decode attention: sdpa's kernel over the live columns (False: two matmuls over the slab block; benchmarks compare)
MATH_PREFILL_MAX_SCORES = 1 << 25  # fp32 scores per call (128 MiB) past which the math path leaves it to sdpa


def slab_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [rows, q_heads, 1, dim]; key/value [rows, kv_heads, cols, dim]; the mask from
    `decode_mask`: boolean [rows, 1, 1, cols] for sdpa's kernel over the live columns (a strided
    view of the slab; the kernel reads the query heads' KV head itself), or additive fp32 for the
    two matmuls over the whole slab block. Returns [rows, 1, q_heads, dim] like transformers'
    attention functions."""
    if query.shape[2] != 1 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if attention_mask.dtype == torch.bool:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None
    rows, q_heads, _, dim = query.shape
    return _grouped_attention(query, key, value, attention_mask, scaling).reshape(rows, 1, q_heads, dim), None


def _grouped_attention(query, key, value, additive_mask, scaling=None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for query [rows, q_heads, width, dim] over key/value [rows,
    kv_heads, cols, dim], the `group` query heads of a KV head stacked into one [group * width, dim]
    GEMM operand (query head h reads KV head h // group, as transformers' repeat_kv has it); fp32
    scores and softmax, under an fp32 additive mask [rows, 1, width, cols]. Returns [rows, q_heads,
    width, dim] (contiguous). The decode and the bf16 prefill attention are this one computation."""
    rows, q_heads, width, dim = query.shape
    kv_heads, cols = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else dim ** -0.5
    q = query.reshape(rows, kv_heads, q_heads // kv_heads * width, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float().mul_(scale).view(rows, q_heads, width, cols)
    scores.add_(additive_mask)
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(rows, kv_heads, q_heads // kv_heads * width, cols)
    return torch.matmul(probs, value).view(rows, q_heads, width, dim)


AttentionInterface.register(NAME, slab_decode_attention)


def slab_prefill_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """sdpa over query [rows, q_heads, width, dim] and key/value [rows, kv_heads, cols, dim] under a
    4D mask, the query heads of a group reading their KV head in the kernel (no `repeat_kv` copy).
    Anything else (no mask, one query token, which the wrapper packs without a copy, another device,
    softcap, sinks, a position bias, dropout) goes to transformers' sdpa wrapper unchanged, so its
    bits are the wrapper's. Returns [rows, width, q_heads, dim]."""
    if (not GROUPED_PREFILL or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu" or dropout
            or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None
            or query.shape[1] % key.shape[1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if math_prefill_serves(query, key, attention_mask):
        return grouped_math_attention(query, key, value, attention_mask, scaling), None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def math_prefill_serves(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether `grouped_math_attention` takes this prefill call: bfloat16, scores within
    MATH_PREFILL_MAX_SCORES, and every query sees a column (a fully masked row would be NaN here)."""
    rows, q_heads, width, _ = query.shape
    return (MATH_PREFILL and query.dtype == torch.bfloat16
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
    """Prefill attention of query [rows, q_heads, width, dim] over key/value [rows, kv_heads, cols,
    dim] under a 4D mask [rows, 1, width, cols] (bool: True attends; else additive) as the decode
    attention computes it (`_grouped_attention`). Returns [rows, width, q_heads, dim]."""
    return _grouped_attention(query, key, value, _prepared(mask)[1], scaling).transpose(1, 2).contiguous()


AttentionInterface.register(PREFILL_NAME, slab_prefill_attention)


def decode_allowed(kv_len: torch.Tensor, cols: int) -> torch.Tensor:
    """Which of `cols` columns each decode token (at position kv_len[i]) attends, as a boolean
    [rows, 1, 1, cols]: its columns 0..kv_len[i] (its own token included), none of the stale ones."""
    return (torch.arange(cols) <= kv_len.unsqueeze(-1)).view(kv_len.shape[0], 1, 1, cols)


def decode_columns(kv_len: torch.Tensor, slab_cols: int) -> int:
    """Slab columns a decode step's attention reads: the live rows' (sdpa's kernel, `SDPA_DECODE`)
    or every column of the slab (the two matmuls, which want the contiguous block)."""
    return int(kv_len.max()) + 1 if SDPA_DECODE else slab_cols


def decode_mask(kv_len: torch.Tensor, cols: int) -> torch.Tensor:
    """The mask `slab_decode_attention` takes over `cols` columns: `decode_allowed` itself for
    sdpa's kernel, or as the additive fp32 mask the matmuls add to their scores."""
    allowed = decode_allowed(kv_len, cols)
    return allowed if SDPA_DECODE else torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


def slab_decode_pays(slab_cols: int, width: int) -> bool:
    """Whether `slab_decode_attention` serves a decode step whose live rows use `width` of the slab's
    `slab_cols` columns: always with sdpa over the live columns; the matmuls read every column,
    which loses to transformers' sdpa over `width` where most are beyond every live row."""
    return SDPA_DECODE or slab_cols <= 2 * width


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
