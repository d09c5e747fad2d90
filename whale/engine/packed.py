"""Linear layers on packed weights, for the hf engine's CPU forwards in bfloat16.

Why: a plain `F.linear` in bfloat16 hands oneDNN a weight in PyTorch's row-major layout, and
oneDNN reorders it into its kernel's layout (AMX tiles) on every call. At prefill widths that is
amortised over hundreds of rows; at the engine's decode widths (a few to 64 live rows) it is a
second pass over every weight at every step: on a Xeon with AMX plain bf16 was flat at ~40 ms for
SmolLM2-135M's 211 Linear weights from 1 to 32 rows. Packing each weight once
(`torch.ops.mkldnn._reorder_linear_weight`) and multiplying with the packed form
(`_linear_pointwise`) took 1.31-1.58x less time at 1-64 rows on one thread
(benchmarks/packed_gemm.py), and whole search-QA replays (benchmarks/workloads.py, 4 repeats, the
engine on one thread as by default) ran 1.05x [1.03, 1.08] faster with the same ids
(docs/performance.md). The joined LoRA layers (engine/adapted.py) multiply through the same packs.

Used up to `MAX_ROWS` rows (decode steps, prefill's lm_head over the kept rows); wider forwards
keep the plain path (a pack there showed no effect on whole replays, 1.02x [0.97, 1.08], and on
two threads oneDNN's packed and plain products differ at some widths from 96 rows up).

Numerics: the packed product has the plain product's bits, so nothing sampled changes; this is
checked, not assumed: each weight, when packed, is multiplied both ways at several row counts and
keeps the plain path if any bit differs (where oneDNN's plain path takes another kernel than its
packed one).

Where it applies: bfloat16 weights and inputs on CPU, no bias, gradients off (the engine's
forwards; the in-process trainer's forwards take the plain path), and a torch whose oneDNN does
bf16 on this CPU; elsewhere `available()` is False and nothing changes. Packs are keyed by the
weight's storage and autograd version counter, so a weight changed in place (an optimizer step, a
merged adapter) or swapped is packed again at its next use. Memory: one packed copy of each Linear
weight used (SmolLM2-135M: 0.25 GiB), up to `max_bytes` (an eighth of the machine's memory by
default); the layers past it keep the plain path.
"""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable

import torch

MAX_ROWS = 64  # packed up to this many rows (faster there); the plain path above
BITS_CHECK_ROWS = (1, 2, 5, 17, 24, MAX_ROWS)  # row counts at which a pack must give the plain bits
MIN_WEIGHT_NUMEL = 1 << 16  # smaller Linears (LoRA's rank-r factors) gain nothing from packing


def default_max_bytes() -> int:
    """An eighth of the machine's memory: what packs may add to the model's own weights."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):
        return 1 << 30


@lru_cache(maxsize=1)
def available() -> bool:
    """oneDNN built in, doing bf16 on this CPU, with the prepacked-Linear ops torch's inductor uses."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def _same_bits_at(weight: torch.Tensor, pack: torch.Tensor, rows: int) -> bool:
    """Whether `pack` gives `F.linear`'s bits on `rows` seeded random rows (at this thread's count)."""
    gen = torch.Generator().manual_seed(rows * 7919 + weight.shape[1])
    x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
    return torch.equal(packed_matmul(x, pack), torch.nn.functional.linear(x, weight))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed form of a bfloat16 `weight` [out, in], or None where its products would not
    have the plain `F.linear` bits: both are computed at `BITS_CHECK_ROWS` rows on seeded inputs."""
    weight = weight.detach().contiguous()
    pack = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return pack if all(_same_bits_at(weight, pack, m) for m in BITS_CHECK_ROWS) else None


def packed_matmul(x: torch.Tensor, pack: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T from `pack_weight(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, pack, None, "none", [], "")


class PackedLinears:
    """Packs of one model's bfloat16 Linear weights, and the forwards that use them (see the module
    docstring)."""

    def __init__(self, min_weight_numel: int = MIN_WEIGHT_NUMEL, max_bytes: int | None = None):
        self.min_weight_numel = min_weight_numel
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self._packs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (key, pack, bytes)
        self._lock = threading.Lock()
        self.packed_weights = 0  # packs made (a weight's first use, and again after each change)
        self.plain_weights = 0  # weights whose pack would not give the plain bits, kept plain

    def clear(self) -> None:
        """Drop every pack; each weight is packed again at its next use."""
        with self._lock:
            self._packs = weakref.WeakKeyDictionary()

    @property
    def nbytes(self) -> int:
        """Memory the packs hold, counted as their weights' bytes."""
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
                pack = pack_weight(weight)
                entry = (key, pack, size if pack is not None else 0)
                self._packs[module] = entry
                if pack is None:
                    self.plain_weights += 1
                else:
                    self.packed_weights += 1
            return entry[1]

    def forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """`module(x)`, on the packed weight where it applies, else exactly nn.Linear's forward."""
        weight = module.weight
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (torch.is_grad_enabled() or module.bias is not None or x.dtype != torch.bfloat16
                or weight.dtype != torch.bfloat16 or x.device.type != "cpu" or weight.device.type != "cpu"
                or rows > MAX_ROWS):
            return torch.nn.functional.linear(x, weight, module.bias)
        pack = self.pack_of(module)
        return torch.nn.functional.linear(x, weight, None) if pack is None else packed_matmul(x, pack)

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
