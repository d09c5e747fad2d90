"""LoRA layers in the hf engine's CPU forwards: the adapter's update inside the base layer's GEMM.

Why: after a run's first weight step every rollout carries the LoRA adapter, and peft's LoRA
Linear runs, per adapted layer, the base GEMM, then a cast of the input to the adapter's float32,
two rank-r GEMMs, a scale, an add over the whole [rows, out] output in float32 and a cast back.
Per decoder layer of SmolLM2-135M (its seven Linears, r = 16, bf16, one thread, the 2-core AMX
Xeon; benchmarks/lora_layers.py) that cost 2.1-2.3x the base layer's GEMMs at 1-8 rows, 3.0x at
64, 3.2x at 256 and 5.5-6.2x at 1,024: most of it the float32 passes over the output, which grow
with the rows of prefill forwards. Merging the update into the bf16 weights would be free but
loses most of it (the delta is far below a bf16 ulp of W; docs/design.md,
section 8).

What runs instead, for a layer with one active plain LoRA adapter (no DoRA or other variant, no
bias, dropout off as in eval):

    a = x A^T                   (float32 at decode widths, then rounded; bf16 at prefill widths)
    y = [x | a] [W | s B]^T     (ONE GEMM over in + r columns; `s B` rounded to bf16 once)

The joined GEMM goes through the engine's bf16 pack of [W | s B] where this CPU has packs
(engine/packed.py), at every width, and the plain [W | s B] is freed once packed (220 MiB of
`whale demo`'s peak on SmolLM2-135M; packs at prefill widths showed no speed effect of their own
on whole replays, 1.02x [0.97, 1.08]). The update is accumulated in float32 next to the base
product inside the GEMM and the output is rounded once; peft rounds the base product to bf16, adds
the float32 update, and rounds again. Against a float64 reference this is the more accurate of the
two (mean error 0.29-0.34 of an output's typical bf16 ulp, max 2.1-4.1, against peft's 0.38-0.40
and 3.5-7.1, for updates 3% and 26-28% of the output's size). Per layer 1.6-2.0x the base GEMMs:
1.2-1.3x faster than peft's at 1-8 rows, 1.5x at 64, 1.8-1.9x at 256, 3.6-3.9x at 1,024;
search-QA replays with an r = 16 adapter 1.21x [1.04, 1.41] faster (benchmarks/lora_generation.py)
and `whale demo` 1.07x [1.04, 1.10] (2026-12-06, the 2-core AMX Xeon; measured when the rank-r
product ran on MKL's packed float32 GEMM, since removed for showing no whole-run effect of its own;
docs/performance.md). It is not peft's bits, so adapted samples change by rounding as they do
between batch shapes in bf16 (docs/design.md); the trainer keeps peft's layers and arithmetic.

The joined weights [W | s B] and their packs are rebuilt when W, A, B or s change (after each
optimizer step, a loaded adapter): their keys are storages and autograd version counters, as for
the packs (1.0 s for SmolLM2-135M's 210 layers, most of it packing). Memory: about one more copy
of the adapted weights while an adapter is active (its pack, or the plain copy where there is no
pack). float32 (a CPU without fast bf16): no joined copy. There are no casts to save, and a joined [W | s B]
would double the adapted weights (432 MiB for SmolLM2-135M, a sixth of `whale demo`'s peak memory
on such a CPU, 2026-12-07); the layer runs y = x W^T, then y += (x A^T) (s B)^T as one in-place
GEMM (`addmm_`), on the parameters themselves (nothing copied but s B).

A layer that does not qualify
(its weights off the CPU included), a forward with gradients on, or an input of another dtype runs
peft's own forward.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from whale.engine.packed import MAX_ROWS, PackedLinears, packed_matmul, walk_modules


def lora_linear_type() -> type | None:
    """peft's LoRA Linear class, or None where peft's LoRA layers were never imported (then no
    model holds one, and nothing is imported here)."""
    return getattr(sys.modules.get("peft.tuners.lora.layer"), "Linear", None)


def _frozen_linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear around `weight` (no copy): what PackedLinears packs, per module."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _plain_adapter(module: Any) -> tuple[nn.Linear, nn.Linear, nn.Linear, float] | None:
    """(base, A, B, scaling) of a peft LoRA Linear whose forward is exactly base(x) + s B A x in
    eval, or None where it is anything else (merged, disabled, several adapters, a variant such
    as DoRA, biases, dropout in training mode, input casting off, a tuner layer under it). Called
    for every LoRA layer at every forward, so it reads each attribute once."""
    if module.merged or module.disable_adapters:
        return None
    active = module.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    modules = module._modules
    downs, ups = modules["lora_A"], modules["lora_B"]
    if name not in downs or name in getattr(module, "lora_variant", ()) or getattr(module, "use_dora", {}).get(name):
        return None
    base, down, up = modules["base_layer"], downs[name], ups[name]
    dropout = modules["lora_dropout"][name]
    if (type(base) is not nn.Linear or type(down) is not nn.Linear or type(up) is not nn.Linear
            or base.bias is not None or down.bias is not None or up.bias is not None
            or (dropout.training and not isinstance(dropout, nn.Identity))
            or not getattr(module, "cast_input_dtype_enabled", True)):
        return None
    return base, down, up, float(module.scaling[name])


def _lora_layers(model: nn.Module, lora_type: type) -> list[nn.Module]:
    """`model`'s peft LoRA Linears, without walking inside them: their adapters' ModuleDicts are
    most of a wrapped model's modules (2,497 in SmolLM2-135M under r = 16 on every Linear, ~400
    outside them), and this walk runs at every forward."""
    return [m for m in walk_modules(model, enter=lambda m: type(m) is not lora_type) if type(m) is lora_type]


class AdaptedLinears:
    """The joined weights of one model's plain LoRA layers, and the forwards that use them (see
    the module docstring). `packs` packs the joined weights (None: plain `F.linear` on a joined
    copy); the rank-r product x A^T of decode widths runs in float32."""

    def __init__(self, dtype: torch.dtype, packs: PackedLinears | None):
        self.dtype, self.packs = dtype, packs
        self._joined: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LoRA module -> _Joined
        self.builds = 0  # joined weights made (an adapter's first use, and again after each change)

    def clear(self) -> None:
        """Drop every joined weight (and so its pack); each is made again at its layer's next use."""
        self._joined = weakref.WeakKeyDictionary()

    @property
    def nbytes(self) -> int:
        """Memory the joined weights and their rank-r copies hold (their packs are the packs' own)."""
        return sum(e.up_t.nbytes if e.joined is None else e.joined.weight.nbytes + e.down.nbytes + e.wide_down.nbytes
                   for e in list(self._joined.values()))

    def _joined_of(self, module: Any) -> _Joined | None:
        """The module's joined weights, made now if its weights changed; None where it is not a plain
        LoRA layer on this CPU engine's dtype."""
        parts = _plain_adapter(module)
        if parts is None:
            return None
        base, down, up, scaling = parts
        w, a, b = base.weight, down.weight, up.weight
        if w.dtype != self.dtype or w.device.type != "cpu" or a.device.type != "cpu" or b.device.type != "cpu":
            return None
        key = (w.data_ptr(), w._version, a.data_ptr(), a._version, b.data_ptr(), b._version, scaling)
        entry = self._joined.get(module)
        if entry is None or entry.key != key:
            with torch.no_grad():
                entry = self._joined[module] = _Joined(self, module, key, w.detach(), a.detach(), b.detach(), scaling)
            self.builds += 1
        return entry

    def forward(self, entry: "_Joined", x: torch.Tensor) -> torch.Tensor:
        """[x | x A^T] [W | s B]^T for a forward on this engine's CPU, gradients off, in its dtype."""
        if entry.joined is None:  # float32: the base GEMM, then the update added inside a second one
            y = torch.nn.functional.linear(x, entry.base)
            a = torch.nn.functional.linear(x, entry.down)
            y.view(-1, y.shape[-1]).addmm_(a.view(-1, a.shape[-1]), entry.up_t)
            return y
        narrow = x.numel() <= MAX_ROWS * x.shape[-1]  # decode widths: the packs take it
        if narrow:  # float32 (oneDNN's bf16 call costs ~18 us even at 1 row)
            a = torch.nn.functional.linear(x.float(), entry.down)
        else:  # prefill widths: the base dtype (float32's GEMM grows 4x slower by 512 rows)
            a = torch.nn.functional.linear(x, entry.wide_down)
        xa = torch.cat([x, a.to(x.dtype)], dim=-1)
        if entry.joined_pack is not None:  # every width: the plain joined copy is not kept (module docstring)
            return packed_matmul(xa, entry.joined_pack)
        return torch.nn.functional.linear(xa, entry.joined.weight)

    @contextmanager
    def installed(self, model: nn.Module):
        """Route `model`'s plain LoRA layers through `forward` inside (the engine thread owns the
        model then); the modules are as before afterwards. A module whose forward is already
        replaced on the instance is left alone."""
        lora_type = lora_linear_type()
        bound = []
        if lora_type is not None:
            for m in _lora_layers(model, lora_type):
                if "forward" not in m.__dict__:
                    entry = self._joined_of(m)
                    if entry is not None:
                        m.__dict__["forward"] = entry  # an instance attribute, as Module.__setattr__ would store it
                        bound.append(m)
        try:
            yield
        finally:
            for m in bound:
                m.__dict__.pop("forward", None)


class _Joined:
    """One LoRA layer's joined weights for its current W, A, B and s (`key`), their packs, and its
    forward in the engine: `AdaptedLinears.forward`, or peft's own for a call that is not one of
    the engine's (gradients on, another dtype, extra arguments). Holds the module weakly."""

    __slots__ = ("adapted", "module", "key", "dtype", "down", "wide_down", "joined", "joined_pack", "base", "up_t")

    def __init__(self, adapted: AdaptedLinears, module: Any, key: tuple, w: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor, scaling: float):
        self.adapted, self.module, self.key, self.dtype = adapted, weakref.ref(module), key, w.dtype
        if w.dtype == torch.float32:  # no joined copy of W (module docstring, "float32"): W and A as they are
            self.base, self.down, self.wide_down = w, a, a
            self.up_t = (b * scaling).t().contiguous()  # [r, out]
            self.joined = self.joined_pack = None
            return
        self.base = self.up_t = None
        self.down = a.to(torch.float32, copy=True)  # decode widths: x -> a in float32
        self.wide_down = a.to(w.dtype, copy=True)  # wider forwards: x -> a in the base dtype
        self.joined = _frozen_linear(torch.cat([w, (b.float() * scaling).to(w.dtype)], dim=1))  # [W | s B]
        # packed once here: the weights above never change (new ones make a new _Joined)
        self.joined_pack = adapted.packs.pack_of(self.joined) if adapted.packs is not None else None
        if self.joined_pack is not None:  # the pack serves every width: the plain copy is freed (its
            self.joined.weight.data = self.joined.weight.data.new_empty(0)  # module stays, keying the pack)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or x.dtype != self.dtype or torch.is_grad_enabled():
            module = self.module()
            return type(module).forward(module, x, *args, **kwargs)
        return self.adapted.forward(self, x)
