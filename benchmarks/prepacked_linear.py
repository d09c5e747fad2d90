"""Prepacked Linear weights on CPU: faster GEMMs at decode widths, and are the outputs the same bits?

Why: a plain `F.linear` hands oneDNN (bf16) or MKL (fp32) a weight in PyTorch's row-major layout,
and the library may repack it into its blocked layout on every call; at decode widths (M = 1-64
rows) that repacking can be a large part of a GEMM. `torch.ops.mkldnn._reorder_linear_weight`
packs a weight once; `torch.ops.mkldnn._linear_pointwise` then multiplies with it. This measures,
per SmolLM2-135M Linear shape and per M, the time of both side by side (alternated, best of
`--repeat`) and whether the two outputs are bitwise equal: a faster GEMM with other bits would
change the sampled ids.

    OMP_NUM_THREADS=1 python benchmarks/prepacked_linear.py [--dtype bfloat16 float32] [--m 1 21 64 256]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"q/o 576->576": (576, 576), "k/v 576->192": (576, 192), "gate/up 576->1536": (576, 1536),
          "down 1536->576": (1536, 576), "lm_head 576->49152": (576, 49152)}


def best(fn, repeat: int) -> float:
    fn()
    out = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 21, 32, 64, 256])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, mkldnn bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    for name in args.dtype:
        dtype = getattr(torch, name)
        for label, (k, n) in SHAPES.items():
            w = (torch.randn(n, k) / k ** 0.5).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            for m in args.m:
                x = torch.randn(m, k).to(dtype)
                inner = max(1, 2048 // m) if n < 10000 else max(1, 64 // m)
                plain_t = best(lambda: [F.linear(x, w) for _ in range(inner)], args.repeat) / inner
                pack_t = best(lambda: [torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                                       for _ in range(inner)], args.repeat) / inner
                same = torch.equal(F.linear(x, w), torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
                print(f"{name:8s} {label:20s} M={m:4d}  plain {plain_t * 1e6:9.1f} us  packed {pack_t * 1e6:9.1f} us"
                      f"  plain/packed {plain_t / pack_t:5.2f}  bitwise equal {same}", flush=True)


if __name__ == "__main__":
    main()
