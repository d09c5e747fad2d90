"""Would fusing a decoder layer's projections speed up a decode step? Side by side, one process.

separate: q, k, v, o, gate, up, down as seven GEMMs (what transformers' Llama layers run)
fused:    qkv as one 576 -> 960 GEMM, o, gate+up as one 576 -> 3072 GEMM, down (four GEMMs)
at SmolLM2-135M's shapes in bf16, for M = live decode rows. Prints ms per layer and the ratio.

    OMP_NUM_THREADS=1 python benchmarks/fused_projections.py
"""

import time

import torch
import torch.nn.functional as F

H, I, KV = 576, 1536, 192  # hidden, MLP width, k/v width (3 kv heads x 64)


def bench(fn, reps=40):
    for _ in range(3):
        fn()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1000


def main():
    for M in [8, 16, 24, 32]:
        x, h = torch.randn(M, H).bfloat16(), torch.randn(M, I).bfloat16()
        q, k, v, o = (torch.randn(n, H).bfloat16() for n in (H, KV, KV, H))
        g, u, d = torch.randn(I, H).bfloat16(), torch.randn(I, H).bfloat16(), torch.randn(H, I).bfloat16()
        qkv, gu = torch.cat([q, k, v]), torch.cat([g, u])
        sep = bench(lambda: (F.linear(x, q), F.linear(x, k), F.linear(x, v), F.linear(x, o),
                             F.linear(x, g), F.linear(x, u), F.linear(h, d)))
        fus = bench(lambda: (F.linear(x, qkv), F.linear(x, o), F.linear(x, gu), F.linear(h, d)))
        print(f"M={M}: separate {sep:.3f} ms/layer, fused {fus:.3f} ms/layer, separate/fused {sep / fus:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
