"""Plain GEMMs vs packed weights (whale/engine/packed.py) on the default model's Linear layers.

One decode step's Linear work: the model's own Linear layers (lm_head included) in bfloat16
(oneDNN's packed weights) called in order on M rows, so each weight comes from memory as in a real
step; plain `F.linear` and the packed GEMM alternate
`--repeat` times, best of each. Also says, per M, whether the two give the same bits (every layer)
and whether a row's packed bits are those it gets among 256 more rows (lm_head).

    OMP_NUM_THREADS=1 python benchmarks/packed_gemm.py

`--bits-scan` instead compares packed and plain bits, one weight of each shape, at every width
1-129 and every 8th up to 1096: where the packs could serve beyond MAX_ROWS without changing ids
(whole replays showed no effect from packs past 64 rows, so the engine stops there).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from machine import best_time  # noqa: E402
from whale.engine import packed  # noqa: E402
from whale.engine.default_model import resolve_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16,24,32,48,64,128,256")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bits-scan", action="store_true")
    args = ap.parse_args()
    dtype = torch.bfloat16
    if not packed.available():
        raise SystemExit("this torch cannot pack bfloat16 weights on this CPU (packed.available() is False)")
    pack = packed.pack_weight
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=dtype)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    packs = [pack(lin.weight) for lin in linears]
    pack_s = time.perf_counter() - t0
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    weights = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears) / 2**20
    kept_plain = sum(pk is None for pk in packs)
    print(f"torch threads {torch.get_num_threads()}; {len(linears)} bfloat16 Linear weights, {weights:.0f} MiB; "
          f"packing them took {pack_s:.2f} s and grew peak RSS by {grew:.0f} MiB; {kept_plain} kept plain "
          f"(their packs would change bits)")
    if kept_plain:
        raise SystemExit("some weights could not be packed with the plain bits; the timing would mix paths")
    if args.bits_scan:
        bits_scan(linears, packs, dtype)
        return
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in (int(r) for r in args.rows.split(",")):
            inputs = {lin.in_features: torch.randn(m, lin.in_features, generator=gen).to(dtype) for lin in linears}
            flops = sum(2 * m * lin.in_features * lin.out_features for lin in linears)

            def plain():
                for lin in linears:
                    torch.nn.functional.linear(inputs[lin.in_features], lin.weight)

            def with_packs():
                for lin, pk in zip(linears, packs):
                    packed.packed_matmul(inputs[lin.in_features], pk)

            t_plain, t_packed = float("inf"), float("inf")
            for _ in range(args.repeat):
                t_plain = min(t_plain, best_time(plain, 1))
                t_packed = min(t_packed, best_time(with_packs, 1))
            same_bits = all(torch.equal(torch.nn.functional.linear(inputs[lin.in_features], lin.weight),
                                        packed.packed_matmul(inputs[lin.in_features], pk))
                            for lin, pk in zip(linears, packs))
            lin, pk = linears[-1], packs[-1]
            x = inputs[lin.in_features]
            wide = torch.cat([x, torch.randn(256, lin.in_features, generator=gen).to(dtype)])
            invariant = torch.equal(packed.packed_matmul(x, pk), packed.packed_matmul(wide, pk)[:m])
            print(f"M={m:4d}  plain {t_plain * 1e3:7.1f} ms ({flops / t_plain / 1e9:5.1f} GFLOP/s)  packed "
                  f"{t_packed * 1e3:7.1f} ms ({flops / t_packed / 1e9:5.1f})  plain/packed {t_plain / t_packed:.2f}  "
                  f"same bits as plain: {same_bits}  rows' bits as in 256 more: {invariant}", flush=True)


def bits_scan(linears, packs, dtype) -> None:
    """Widths at which a packed product's bits differ from plain `F.linear`'s, per weight shape."""
    one_per_shape = {}
    for lin, pk in zip(linears, packs):
        one_per_shape.setdefault(tuple(lin.weight.shape), (lin, pk))
    widths = list(range(1, 130)) + list(range(136, 1100, 8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for shape, (lin, pk) in one_per_shape.items():
            differ = [m for m in widths
                      if not torch.equal(packed.packed_matmul(x := torch.randn(m, shape[1], generator=gen).to(dtype), pk),
                                         torch.nn.functional.linear(x, lin.weight))]
            print(f"weight {shape[0]}x{shape[1]}: {len(widths)} widths, packed bits differ from plain at "
                  f"{len(differ)}: {differ}", flush=True)


if __name__ == "__main__":
    main()
