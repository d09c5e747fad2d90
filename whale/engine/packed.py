"""Linear layers on packed weights, for the hf engine's CPU forwards in float32 and bfloat16.

Why: a plain `F.linear` hands the GEMM library (MKL for float32, oneDNN for bfloat16) a weight in
PyTorch's row-major layout, and the library re-packs it into its kernel's layout on every call. At
prefill widths that is amortised over hundreds of rows; at the engine's decode widths (a few to 64
live rows) it is a second pass over every weight at every step. Packing each weight once and
multiplying with the packed form is faster there (benchmarks/packed_gemm.py, over SmolLM2-135M's
211 Linear weights read from memory in model order):

- float32, MKL (`cblas_sgemm_pack` / `cblas_sgemm_compute`), a 2.8 GHz AVX-512 Xeon: one thread
  1.46-1.92x at 4-16 rows, 1.27-1.41x at 24-64, 0.85-0.87x at 1-3 rows; two threads 1.8-2.7x at
  4-32 rows.
- bfloat16, oneDNN (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`), a Xeon with
  AMX: 1.31-1.58x at 1-64 rows on one thread, 1.34-1.48x on two (a whole search-QA replay: 1.05x
  [1.03, 1.08] at one thread, no effect shown at two; docs/throughput.md).

Both are used up to `MAX_ROWS` rows (decode steps, prefill's lm_head over the kept rows). Wider
forwards (prefill, mixed forwards) keep the plain path in float32 (two runs disagreed on a gain
there). In bfloat16 they use the pack up to `WIDE_MAX_ROWS` rows where it gives the plain bits at
that very width: on two threads oneDNN's packed and plain products differ at some widths from 96
rows up (on one thread, the engine's default on 2 cores, at none scanned), so each (weight shape,
thread count, width) is checked at its first use, on that forward's input, and the verdict remembered.

Numerics. bfloat16: the packed product has the plain product's bits, so nothing sampled changes;
this is checked, not assumed: each weight, when packed, is multiplied both ways at several row
counts and keeps the plain path if any bit differs (where oneDNN's plain path takes another
kernel than its packed one). float32: plain sgemm takes a small-matrix kernel under 16 rows, so a
row's outputs depended on how many rows shared its GEMM (a sample on its batch-mates, by a few
ulps); the packed compute gives each row the same bits at any number of rows
(tests/test_packed_gemm.py) and the plain bits from 16 rows up. Against plain sgemm everywhere, only
GEMMs of under 16 rows round differently: recorded ids change where a float32 ulp moves a sampled
token across its inverse-CDF boundary (measured in docs/throughput.md).

Where it applies: float32 or bfloat16 weights and inputs on CPU, no bias, gradients off (the
engine's forwards; the in-process trainer's forwards take the plain path), and a torch whose MKL
exports the packed sgemm and gives each row the same bits at every row count on this CPU (float32;
not so on an AMD EPYC) or whose oneDNN does bf16 (bfloat16); elsewhere
`available(dtype)` is False and nothing changes. Packs are keyed by the weight's storage and
autograd version counter, so a weight changed in place (an optimizer step, a merged adapter) or
swapped is packed again at its next use. Memory: one packed copy of each Linear weight used
(SmolLM2-135M: 0.5 GiB in float32, 0.25 GiB in bfloat16), up to `max_bytes` (an eighth of the
machine's memory by default); the layers past it keep the plain path.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Callable, NamedTuple

import torch

MAX_ROWS = 64  # packed up to this many rows (faster there); the plain path above, except bfloat16's checked widths
WIDE_MAX_ROWS = 4096  # bfloat16: widths past MAX_ROWS up to this are packed once checked; wider ones stay plain
BITS_CHECK_ROWS = (1, 2, 5, 17, 24, MAX_ROWS)  # bfloat16: row counts at which a pack must give the plain bits
MIN_WEIGHT_NUMEL = 1 << 16  # smaller Linears (LoRA's rank-r factors) gain nothing from packing
_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151  # CBLAS enums
_INT = ctypes.c_int  # MKL's LP64 interface (the cblas_* names; the ILP64 ones end in _64)


def default_max_bytes() -> int:
    """An eighth of the machine's memory: what packs may add to the model's own weights."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):
        return 1 << 30


@lru_cache(maxsize=1)
def _mkl() -> ctypes.CDLL | None:
    """torch's own MKL (statically linked into libtorch_cpu), or None where it lacks the packed GEMM."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    get_size.restype, get_size.argtypes = ctypes.c_size_t, [_INT] * 4
    pack.restype = None
    pack.argtypes = [_INT] * 6 + [ctypes.c_float, ctypes.c_void_p, _INT, ctypes.c_void_p]
    compute.restype = None
    compute.argtypes = [_INT] * 6 + [ctypes.c_void_p, _INT, ctypes.c_void_p, _INT, ctypes.c_float, ctypes.c_void_p, _INT]
    return lib


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch packs Linear weights of `dtype` (float32 or bfloat16); see `_KINDS`."""
    kind = _KINDS.get(dtype)
    return kind is not None and kind.available()


@lru_cache(maxsize=1)
def _float32_available() -> bool:
    """MKL with `cblas_sgemm_compute` exported, one weight packed once giving x @ weight.T at every
    row count probed (MKL documents the pack for the `m` it was made with; the engine calls it with 1
    to MAX_ROWS rows), and each row's bits the same at every row count (the reason float32 packs may
    change ids against plain sgemm). Both are checked, not assumed: on an AMD EPYC (Zen 4) MKL's
    packed compute rounds 1-3-row products differently from wider ones, as its plain sgemm does, so
    there float32 stays plain (docs/throughput.md)."""
    if _mkl() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen)
    packed = pack_weight(weight)
    for m in (1, 2, 3, 5, 16, 17, MAX_ROWS):
        x = torch.randn(m, 80, generator=gen)
        if not torch.allclose(packed_matmul(x, packed, 96), x @ weight.T, rtol=1e-4, atol=1e-4):
            return False
    full = packed_matmul(x, packed, 96)
    return all(torch.equal(packed_matmul(x[:m], packed, 96), full[:m]) for m in range(1, MAX_ROWS + 1))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed form of a float32 `weight` [out, in] as the B operand of x @ weight.T (a flat byte buffer)."""
    lib = _mkl()
    n, k = weight.shape
    weight = weight.detach().contiguous()
    size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, MAX_ROWS, n, k)
    buffer = torch.empty(size, dtype=torch.uint8)  # pages MKL does not write are never touched
    lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, MAX_ROWS, n, k, 1.0, weight.data_ptr(), k,
                         buffer.data_ptr())
    return buffer


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., in] @ weight.T from `pack_weight(weight)`: [..., out_features]."""
    k = x.shape[-1]
    a = x.reshape(-1, k).contiguous()
    m = a.shape[0]
    out = torch.empty((m, out_features), dtype=torch.float32)
    if m:
        _mkl().cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, out_features, k, a.data_ptr(), k,
                                   packed.data_ptr(), k, 0.0, out.data_ptr(), out_features)
    return out.view(*x.shape[:-1], out_features)


@lru_cache(maxsize=1)
def _bfloat16_available() -> bool:
    """oneDNN built in, doing bf16 on this CPU, with the prepacked-Linear ops torch's inductor uses."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def _same_bits_at(weight: torch.Tensor, pack: torch.Tensor, matmul: Callable, rows: int) -> bool:
    """Whether `pack` gives `F.linear`'s bits on `rows` seeded random rows (at this thread's count)."""
    gen = torch.Generator().manual_seed(rows * 7919 + weight.shape[1])
    x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
    return torch.equal(matmul(x, pack, weight.shape[0]), torch.nn.functional.linear(x, weight))


def pack_bfloat16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed form of a bfloat16 `weight` [out, in], or None where its products would not
    have the plain `F.linear` bits: both are computed at `BITS_CHECK_ROWS` rows on seeded inputs."""
    weight = weight.detach().contiguous()
    pack = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return pack if all(_same_bits_at(weight, pack, bfloat16_packed_matmul, m) for m in BITS_CHECK_ROWS) else None


def bfloat16_packed_matmul(x: torch.Tensor, pack: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T from `pack_bfloat16_weight(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, pack, None, "none", [], "")


class _Kind(NamedTuple):
    """How one dtype's weights are packed and multiplied."""

    available: Callable[[], bool]
    pack: Callable[[torch.Tensor], torch.Tensor | None]  # None: keep the plain path for this weight
    matmul: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (x, pack, out_features)
    wide: bool  # whether forwards wider than MAX_ROWS may use the pack where it gives the plain bits


_KINDS = {torch.float32: _Kind(_float32_available, pack_weight, packed_matmul, wide=False),
          torch.bfloat16: _Kind(_bfloat16_available, pack_bfloat16_weight, bfloat16_packed_matmul, wide=True)}


class PackedLinears:
    """Packs of one model's Linear weights of one dtype, and the forwards that use them (see the
    module docstring)."""

    def __init__(self, dtype: torch.dtype = torch.float32, min_weight_numel: int = MIN_WEIGHT_NUMEL,
                 max_bytes: int | None = None):
        if dtype not in _KINDS:
            raise ValueError(f"packed Linear weights are float32 or bfloat16, not {dtype}")
        self.dtype, self._kind = dtype, _KINDS[dtype]
        self.min_weight_numel = min_weight_numel
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self._packs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (key, pack, bytes)
        self._lock = threading.Lock()
        self.packed_weights = 0  # packs made (a weight's first use, and again after each change)
        self.plain_weights = 0  # weights whose pack would not give the plain bits (bfloat16), kept plain
        self._wide: dict[tuple, bool] = {}  # (weight shape, threads, rows) -> the pack gives the plain bits there

    @property
    def nbytes(self) -> int:
        """Memory the packs hold, counted as their weights' bytes: MKL asks for a buffer up to ~4x
        larger, but the pages it does not write are never touched (measured: resident memory grew by
        the weights' size)."""
        return sum(entry[2] for entry in list(self._packs.values()))

    def pack_of(self, module: torch.nn.Linear) -> torch.Tensor | None:
        """The module's current pack, made now if its weight changed; None past `max_bytes` or where
        the pack would not give the plain bits (then remembered, and the weight runs plain)."""
        weight = module.weight
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        with self._lock:
            entry = self._packs.get(module)
            if entry is None or entry[0] != key:
                size = weight.numel() * weight.element_size()
                if self.nbytes - (entry[2] if entry else 0) + size > self.max_bytes:
                    return None
                pack = self._kind.pack(weight)
                entry = (key, pack, size if pack is not None else 0)
                self._packs[module] = entry
                if pack is None:
                    self.plain_weights += 1
                else:
                    self.packed_weights += 1
            return entry[1]

    def matmul(self, x: torch.Tensor, pack: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [..., in] times the weight `pack` holds (from `pack_of`), for up to MAX_ROWS rows."""
        return self._kind.matmul(x, pack, out_features)

    @property
    def wide_widths(self) -> tuple[int, int]:
        """(widths past MAX_ROWS checked and packed, checked and kept plain), over shapes and thread counts."""
        verdicts = list(self._wide.values())
        return sum(verdicts), len(verdicts) - sum(verdicts)

    def forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """`module(x)`, on the packed weight where it applies, else exactly nn.Linear's forward."""
        weight = module.weight
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (torch.is_grad_enabled() or module.bias is not None or x.dtype != self.dtype
                or weight.dtype != self.dtype or x.device.type != "cpu" or weight.device.type != "cpu"
                or rows > (WIDE_MAX_ROWS if self._kind.wide else MAX_ROWS)):
            return torch.nn.functional.linear(x, weight, module.bias)
        pack = self.pack_of(module)
        if pack is None:
            return torch.nn.functional.linear(x, weight, None)
        if rows > MAX_ROWS:
            # Checked once per weight shape, thread count and width, at its first use, on that
            # forward's own input (whose plain product it serves): the bits differ only where oneDNN
            # takes another kernel for the plain product than for the packed one, which depends on
            # those three, not on the values. (A seeded random input cost a third GEMM and its draw.)
            key = (tuple(weight.shape), torch.get_num_threads(), rows)
            verdict = self._wide.get(key)
            if verdict is None:
                plain = torch.nn.functional.linear(x, weight, None)
                self._wide[key] = torch.equal(self._kind.matmul(x, pack, weight.shape[0]), plain)
                return plain
            if not verdict:
                return torch.nn.functional.linear(x, weight, None)
        return self._kind.matmul(x, pack, weight.shape[0])

    @contextmanager
    def installed(self, model: torch.nn.Module):
        """Route `model`'s large nn.Linear layers through `forward` inside (the engine thread owns the
        model then); the modules are as before afterwards. A module whose forward is already replaced
        on the instance (accelerate's hooks do that) is left alone."""
        linears = [m for m in walk_modules(model)
                   if type(m) is torch.nn.Linear and m.weight.numel() >= self.min_weight_numel
                   and "forward" not in m.__dict__]
        for m in linears:
            m.__dict__["forward"] = _Bound(self, m)  # an instance attribute, as Module.__setattr__ would store it
        try:
            yield
        finally:
            for m in linears:
                m.__dict__.pop("forward", None)


def walk_modules(model: torch.nn.Module, enter: Callable[[torch.nn.Module], bool] | None = None) -> list[torch.nn.Module]:
    """Every module in `model` once, as `model.modules()` finds them, not looking inside a module
    for which `enter` is False: an unnamed walk (a third of the time of `modules()`'s named one)
    for the walks made at every forward."""
    found, stack, seen = [], [model], {id(model)}
    while stack:
        m = stack.pop()
        found.append(m)
        if enter is not None and not enter(m):
            continue
        for c in m._modules.values():
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                stack.append(c)
    return found


class _Bound:
    """`PackedLinears.forward` bound to one module without a reference cycle through the module."""

    __slots__ = ("packs", "module")

    def __init__(self, packs: PackedLinears, module: torch.nn.Linear):
        self.packs, self.module = packs, weakref.ref(module)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packs.forward(self.module(), x)
