"""Prefill attention on the KV slab: torch's sdpa kernel vs the engine's bf16 math path.

At the shapes the hf engine's prefill forwards meet on search QA (a few to 32 rows of 12-400 new
tokens over 300-420 columns; SmolLM2's 9 query heads on 3 KV heads, head dim 64), per layer:
`F.scaled_dot_product_attention(..., enable_gqa=True)` under the 4D bool mask (what
engine/attention.py did before its math path) against `grouped_math_attention` (two batched GEMMs
around an fp32 softmax), best of `--repeat` alternating runs, and how far apart their outputs are.

    OMP_NUM_THREADS=1 python benchmarks/prefill_attention.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from machine import best_time  # noqa: E402
from whale.engine.attention import grouped_math_attention  # noqa: E402

SHAPES = ((4, 100, 300), (16, 30, 300), (8, 60, 320), (1, 400, 420), (32, 12, 320))  # (rows, new tokens, columns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch threads {torch.get_num_threads()}, {args.dtype}, 9 query heads on 3 KV heads, head dim 64")
    gen = torch.Generator().manual_seed(0)
    for rows, width, cols in SHAPES:
        q = torch.randn(rows, width, 9, 64, generator=gen).to(dtype).transpose(1, 2)  # as the model passes it
        slab = torch.randn(2, 64, 3, cols, 64, generator=gen).to(dtype)  # a 64-row slab, `rows` of them used
        k, v = slab[0, :rows], slab[1, :rows]
        seen = cols - width + torch.arange(width)  # each new token sees the prefix and the new tokens before it
        mask = (torch.arange(cols).view(1, 1, 1, cols) <= seen.view(1, 1, width, 1)).expand(rows, 1, width, cols)

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)

        def math():
            return grouped_math_attention(q, k, v, mask)

        t_sdpa, t_math = float("inf"), float("inf")
        for _ in range(args.repeat):
            t_sdpa = min(t_sdpa, best_time(sdpa, 10))
            t_math = min(t_math, best_time(math, 10))
        flops = 4 * rows * width * cols * 64 * 9
        diff = (sdpa().float() - math().float()).abs().max().item()
        print(f"rows {rows:3d} new {width:4d} cols {cols:4d}: sdpa {t_sdpa * 1e3:6.2f} ms ({flops / t_sdpa / 1e9:5.1f} "
              f"GFLOP/s), math {t_math * 1e3:6.2f} ms ({flops / t_math / 1e9:5.1f}), sdpa/math {t_sdpa / t_math:.2f}, "
              f"max |difference| {diff:.4f}", flush=True)


if __name__ == "__main__":
    main()
