"""A weight step in one process against a group of training ranks, on the same rows, side by side.

    python benchmarks/train_ranks.py [--ranks 2] [--finetune full] [--layers 4 --hidden 256] [--steps 4]

Reports the group's start time, each step's seconds for both (alternated, so load on the machine
hits both alike), their ratio, the group's checkpoint time, and the max weight difference of the
two checkpoints. On CPU the ranks split the cores (each gets cores / ranks threads), so the ratio
shows the group's overhead (process hops, collectives, full logits), not a speed-up: that needs a
GPU per rank (scripts/gpu_train_check.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_run import tiny_config  # noqa: E402
from test_weights import random_rows  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from whale.weights import Trainer  # noqa: E402
from whale.weights.distributed import TrainGroup  # noqa: E402


def model_folder(folder: Path, layers: int, hidden: int) -> Path:
    build_tiny_model(folder)
    cfg = LlamaConfig.from_pretrained(folder)
    cfg.update(dict(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                    num_attention_heads=max(2, hidden // 64), num_key_value_heads=max(1, hidden // 128)))
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--finetune", default="full", choices=["full", "lora"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="whale-ranks-"))
    folder = model_folder(work / "model", args.layers, args.hidden)
    cfg = tiny_config(folder, **{"weight.finetune": args.finetune, "weight.lr": 1e-4, "compute.train_ranks": args.ranks,
                                 "weight.mini_batch_trajectories": 8, "weight.micro_batch_tokens": 1024})
    vocab = AutoTokenizer.from_pretrained(folder).vocab_size
    steps = [random_rows(16, 256, vocab, n_traj=16, seed=s) for s in range(args.steps)]
    trainer = Trainer(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), cfg.weight)
    t = time.perf_counter()
    group = TrainGroup(cfg)
    start = time.perf_counter() - t
    one, many = [], []
    try:
        for rows in steps:
            t = time.perf_counter()
            trainer.train_step(rows)
            one.append(time.perf_counter() - t)
            t = time.perf_counter()
            group.train_step(rows)
            many.append(time.perf_counter() - t)
        t = time.perf_counter()
        saved = group.save(work / "group", "w")
        save_s = time.perf_counter() - t
    finally:
        group.close()
    ref = trainer.save(work / "one", "w")
    name = "adapter_model.safetensors" if args.finetune == "lora" else "model.safetensors"
    a, b = load_file(ref / name), load_file(saved / name)
    print(json.dumps({
        "ranks": args.ranks, "finetune": args.finetune, "layers": args.layers, "hidden": args.hidden,
        "group_start_s": round(start, 1), "one_process_step_s": [round(x, 3) for x in one],
        "group_step_s": [round(x, 3) for x in many],
        "group_over_one_median": round(statistics.median(m / o for m, o in zip(many, one)), 2),
        "group_save_s": round(save_s, 3),
        "max_weight_difference": max(float((a[k] - b[k]).abs().max()) for k in a)}, indent=1))


if __name__ == "__main__":
    main()
