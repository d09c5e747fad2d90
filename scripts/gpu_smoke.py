"""GPU smoke test: one RSFT weight step and one evaluation with the hf engine on CUDA, in minutes.

Uses only what the GPU machine has (torch, transformers, peft; pydantic and friends carried as
wheels, see scripts/gpu_smoke.sh). The model is built from a config (no hub access) and the task
is the toy parity domain of the tests, so no retrieval or chess packages are needed.

    python scripts/gpu_smoke.py [--device cuda] [--hidden 512]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("CUDA is not available here")
    from tiny_model import build_tiny_model
    from whale.config import load_config
    from whale.run import run_experiment
    from whale.store import read_metrics

    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="whale-gpu-smoke-"))
    model_dir = build_tiny_model(work / "model")
    cfg_json = json.loads((model_dir / "config.json").read_text())
    cfg_json.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4)
    (model_dir / "config.json").write_text(json.dumps(cfg_json))
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(model_dir)
    cfg = load_config(None, [
        f"model.name={model_dir}", f"model.device={args.device}", "model.max_model_len=480",
        "domain.module=toy:ParityDomain", "domain.splits.weight=16", "domain.splits.harness=4",
        "domain.splits.val=8", "domain.splits.test=8", "sampling.max_tokens=16",
        "weight.problems_per_step=16", "weight.samples_per_problem=4", "weight.mini_batch_trajectories=16",
        "schedule.kind=weight_only", "schedule.budget_steps=1", "eval.k=4", "eval.splits=[test]",
    ])
    run_dir = run_experiment(cfg, out=work / "run")
    rows = read_metrics(run_dir)
    step = next(r for r in rows if r.get("event") == "weight_step")
    evals = [r for r in rows if r.get("event") == "eval"]
    print(f"device {args.device} ({torch.cuda.get_device_name(0) if args.device.startswith('cuda') else 'cpu'})")
    print(f"weight step: accept {step['accept_rate']:.3f}, rows {step['rows']}, trained tokens "
          f"{step['trained_tokens']}, loss {step['loss']}, gen {step['gen_seconds']:.1f} s, train {step['train_seconds']:.1f} s")
    for r in evals:
        print(f"eval {r['unit']}: mean@{r['k']} {r['mean_at_k']:.3f} on {r['n']} problems, weights {r['weights_version']}")
    assert step["rollouts"] == 64 and evals, "smoke run incomplete"
    print(f"total {time.time() - t0:.1f} s; run dir {run_dir}")


if __name__ == "__main__":
    main()
