"""What this machine can do for the default model: the limits the engine's tokens/s are held against.

- FLOPs per token: 2 x the weights of every Linear layer, lm_head included (attention scores
  are left out: at these context lengths they are a few percent);
- weight bytes per decode step: every Linear weight is read once per step whatever the batch;
- matmul GFLOP/s: a bf16/fp32 Linear of the model's MLP shape at a prefill-sized M and at decode
  batch sizes, on the threads torch uses, best of a few runs;
- memory bandwidth: a large tensor copy (bytes read + written per second).

Prefill limit = GFLOP/s(M=256) / FLOPs per token. A decode step of `rows` rows takes at least
max(weight bytes / bandwidth, rows x FLOPs per token / GFLOP/s(M=rows)).

    python benchmarks/machine.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from whale.engine.default_model import resolve_model_path  # noqa: E402
from whale.engine.hf import resolve_dtype  # noqa: E402

DECODE_M = (1, 4, 8, 16, 32, 64)


def best_time(fn, repeat: int = 5, warmup: bool = True) -> float:
    """The fastest of `repeat` timed calls of `fn` (after one untimed call when `warmup`)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    lin = torch.nn.Linear(k, n, bias=False).to(dtype)
    x = torch.randn(m, k, dtype=dtype)
    inner = max(1, 4096 // m)
    with torch.no_grad():
        seconds = best_time(lambda: [lin(x) for _ in range(inner)]) / inner
    return 2 * m * k * n / seconds / 1e9


def memory_gbps(mib: int = 512) -> float:
    src = torch.empty(mib * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / best_time(lambda: dst.copy_(src), 3) / 1e9


def model_costs(name: str = "smollm2-135m") -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch.float32)
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    cfg = model.config
    return {"params": sum(p.numel() for p in model.parameters()), "linear_params": sum(w.numel() for w in linear),
            "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size}


def model_linear_gflops(name: str = "smollm2-135m", rows=(8, 21, 32, 64, 128, 256), dtype: str = "auto") -> dict:
    """GFLOP/s of one decode step's Linear work: the model's own Linear layers called in order on
    `rows` rows, so each weight comes from memory as in a real step (a single repeated GEMM, as in
    matmul_gflops, keeps its weight in cache and reads up to 1.7x faster at M = 21). Best of 3."""
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch_dtype)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    out = {}
    with torch.no_grad():
        for m in rows:
            inputs = {lin.in_features: torch.randn(m, lin.in_features, dtype=torch_dtype) for lin in linears}
            flops = sum(2 * m * lin.in_features * lin.out_features for lin in linears)

            def step():
                for lin in linears:
                    torch.nn.functional.linear(inputs[lin.in_features], lin.weight)
            out[m] = flops / best_time(step, 3) / 1e9
    return out


def machine_limits(name: str = "smollm2-135m", dtype: str = "auto") -> dict:
    costs = model_costs(name)
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    elem = torch.tensor([], dtype=torch_dtype).element_size()
    flops_tok = 2 * costs["linear_params"]
    weight_bytes = costs["linear_params"] * elem
    h, i = costs["hidden"], costs["intermediate"]
    prefill = matmul_gflops(256, h, i, torch_dtype)
    decode = {m: matmul_gflops(m, h, i, torch_dtype) for m in DECODE_M}
    bw = memory_gbps()

    def decode_limit(rows: float) -> float:
        m = min(DECODE_M, key=lambda x: abs(x - rows))
        step = max(weight_bytes / (bw * 1e9), rows * flops_tok / (decode[m] * 1e9))
        return rows / step

    summary = (f"{torch.get_num_threads()} threads, {str(torch_dtype).removeprefix('torch.')}: matmul "
               f"{prefill:.0f} GFLOP/s at M=256, " + ", ".join(f"{decode[m]:.0f} at M={m}" for m in DECODE_M)
               + f"; memory {bw:.1f} GB/s; model {flops_tok / 1e6:.0f} MFLOP and {weight_bytes / 2**20:.0f} MiB "
               f"of weights per token -> prefill limit {prefill * 1e9 / flops_tok:.0f} tok/s, decode limit "
               f"{decode_limit(1):.0f} tok/s at 1 row, {decode_limit(32):.0f} at 32 rows")
    return {"dtype": str(torch_dtype), "threads": torch.get_num_threads(), "matmul_gflops_prefill": prefill,
            "matmul_gflops_decode": decode, "memory_gbps": bw, "flops_per_token": flops_tok,
            "weight_bytes": weight_bytes, "prefill_limit_tok_s": prefill * 1e9 / flops_tok,
            "decode_limit": decode_limit, "summary": summary}


if __name__ == "__main__":
    print(machine_limits()["summary"])
    print("the model's Linear layers in order (weights from memory): " + ", ".join(
        f"{g:.0f} GFLOP/s at M={m}" for m, g in model_linear_gflops().items()))
