"""A decoder layer's seven Linears under a LoRA adapter: peft's forward against the joined GEMM of
engine/adapted.py, both against the base layer's packed GEMMs, side by side in one process.

  base    the seven packed bf16 GEMMs (SmolLM2-135M's shapes), no adapter
  peft    peft's LoRA Linear forward on them (base GEMM, float32 rank-r GEMMs, scale, add, cast)
  joined  AdaptedLinears: a = x A^T, y = [x | a] [W | s B]^T (the joined GEMM packed up to 64 rows)

Prints ms per layer at several row counts, the ratios to base, and each path's error against a
float64 reference in units of an output's typical bf16 ulp (2^-8 x the row's rms), for an update
a few percent of the output's size and one ten times larger.

    OMP_NUM_THREADS=1 python benchmarks/lora_layers.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model

from fused_projections import H, I, KV, bench

from whale.engine import packed
from whale.engine.adapted import AdaptedLinears
from whale.engine.packed import PackedLinears

SHAPES = {"q": (H, H), "k": (KV, H), "v": (KV, H), "o": (H, H), "gate": (I, H), "up": (I, H), "down": (H, I)}


class Layer(nn.Module):
    """The seven Linears of a Llama decoder layer, each fed a fresh input of its width."""

    def __init__(self):
        super().__init__()
        for name, (out_f, in_f) in SHAPES.items():
            setattr(self, name, nn.Linear(in_f, out_f, bias=False))

    def forward(self, x, x_mlp):
        return [getattr(self, n)(x_mlp if n == "down" else x) for n in SHAPES]


def float64_outputs(model, x, x_mlp):
    outs = []
    for name in SHAPES:
        layer = model.base_model.model.get_submodule(name)
        w, a, b = (m.weight.double() for m in (layer.base_layer, layer.lora_A["default"], layer.lora_B["default"]))
        xx = (x_mlp if name == "down" else x).double()
        outs.append(xx @ w.T + layer.scaling["default"] * (xx @ a.T) @ b.T)
    return outs


def error(outs, exact) -> str:
    e = torch.cat([((o.double() - r).abs() / (2.0 ** -8 * r.pow(2).mean(-1, keepdim=True).sqrt())).flatten()
                   for o, r in zip(outs, exact)])
    return f"mean {e.mean():.3f} max {e.max():.2f}"


def main() -> None:
    if not packed.available():
        raise SystemExit("this torch's oneDNN does no bf16 on this CPU")
    torch.manual_seed(0)
    model = get_peft_model(Layer().to(torch.bfloat16), LoraConfig(r=16, lora_alpha=32, target_modules=list(SHAPES)))
    model.eval()
    packs, base_packs = PackedLinears(), PackedLinears(min_weight_numel=0)
    joined = AdaptedLinears(torch.bfloat16, packs)
    base_layers = [model.base_model.model.get_submodule(n).base_layer for n in SHAPES]
    print(f"torch threads {torch.get_num_threads()}; r = 16, s = 2, bf16 base, float32 adapter (peft's default)")
    with torch.no_grad():
        for b_std in (0.004, 0.04):
            gen = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    p.normal_(0, 0.02 if "lora_A" in name else b_std, generator=gen)
            for rows in (1, 8, 64, 256, 1024):
                x = torch.randn(rows, H).to(torch.bfloat16)
                x_mlp = torch.randn(rows, I).to(torch.bfloat16)
                inputs = [x_mlp if n == "down" else x for n in SHAPES]

                def run_base():
                    return [base_packs.forward(m, xx) for m, xx in zip(base_layers, inputs)]

                def run_peft():
                    return model(x, x_mlp)

                def run_joined():
                    with joined.installed(model):
                        return model(x, x_mlp)

                t = {k: bench(f) for k, f in (("base", run_base), ("peft", run_peft), ("joined", run_joined))}
                exact = float64_outputs(model, x, x_mlp)
                update = torch.stack([(r - xx.double() @ m.weight.double().T).norm() / r.norm()
                                      for r, xx, m in zip(exact, inputs, base_layers)]).mean()
                print(f"B std {b_std} (update {update:.1%} of the output) rows {rows:5d}: ms/layer base "
                      f"{t['base']:.3f}, peft {t['peft']:.3f} ({t['peft'] / t['base']:.2f}x), joined "
                      f"{t['joined']:.3f} ({t['joined'] / t['base']:.2f}x); joined/peft speed "
                      f"{t['peft'] / t['joined']:.2f}x | error vs float64: peft {error(run_peft(), exact)}, "
                      f"joined {error(run_joined(), exact)}", flush=True)


if __name__ == "__main__":
    main()
