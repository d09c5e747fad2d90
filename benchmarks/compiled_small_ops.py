"""Would fusing a decode step's small ops pay here? The pointwise groups of SmolLM2's decoder layer
(RMSNorm, rotary, SiLU(gate) * up), as transformers computes them, eager against torch.compile
(inductor, dynamic rows), bf16, one thread, at decode widths; and what they add up to per decode
step (61 RMSNorms, 30 rotaries, 30 SiLU*up). Needs a C++ compiler (inductor's CPU backend).

    python benchmarks/compiled_small_ops.py
"""

from __future__ import annotations

import time

import torch


def rms_norm(x, weight):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    return weight * h.to(x.dtype)


def rotary(q, k, cos, sin):
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_up(gate, up):
    return torch.nn.functional.silu(gate) * up


PER_STEP = {"rmsnorm": 61, "rotary": 30, "silu*up": 30}  # calls per decode step of the 30-layer model


def per_call_us(fn, *args, n=300) -> float:
    for _ in range(10):
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    bf = torch.bfloat16
    for rows in (1, 20, 64):
        cases = {"rmsnorm": (rms_norm, (torch.randn(rows, 1, 576, dtype=bf), torch.randn(576, dtype=bf))),
                 "rotary": (rotary, (torch.randn(rows, 9, 1, 64, dtype=bf), torch.randn(rows, 3, 1, 64, dtype=bf),
                                     torch.randn(rows, 1, 64, dtype=bf), torch.randn(rows, 1, 64, dtype=bf))),
                 "silu*up": (silu_up, (torch.randn(rows, 1, 1536, dtype=bf), torch.randn(rows, 1, 1536, dtype=bf)))}
        eager_ms = compiled_ms = 0.0
        parts = []
        for name, (fn, args) in cases.items():
            eager = per_call_us(fn, *args)
            t0 = time.perf_counter()
            compiled_fn = torch.compile(fn, dynamic=True)
            compiled_fn(*args)
            compile_s = time.perf_counter() - t0
            compiled = per_call_us(compiled_fn, *args)
            a, b = fn(*args), compiled_fn(*args)
            same = all(torch.equal(x, y) for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)))
            eager_ms += PER_STEP[name] * eager / 1000
            compiled_ms += PER_STEP[name] * compiled / 1000
            parts.append(f"{name} {eager:.1f} us eager, {compiled:.1f} compiled (first call {compile_s:.1f} s, same bits {same})")
        print(f"rows {rows}: " + "; ".join(parts) + f" | per decode step {eager_ms:.2f} ms eager, {compiled_ms:.2f} ms compiled",
              flush=True)


if __name__ == "__main__":
    main()
