#!/usr/bin/env python3
"""Peak memory and time of one RSFT weight step on rows a run saved, with and without gradient
checkpointing (each variant in its own process, so its peak RSS is its own).

    python benchmarks/train_step_memory.py RUN/rows/step_1.jsonl [--set weight.micro_batch_tokens=1024]

The model, LoRA and weight settings are `whale demo`'s (configs/demo.yaml, plus `--set`), on the
default model in the engine's dtype for this CPU (float32 without fast bf16). Prints, per variant,
the step's seconds, the process's peak RSS during the step and its RSS before it (model loaded,
LoRA wrapped).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(rows_path: str, overrides: list[str]) -> dict:
    from whale.config import load_config
    from whale.engine.hf import HFEngine
    from whale.sysmem import map_large_blocks, peak_rss_kb
    from whale.weights.rows import load_rows
    from whale.weights.trainer import Trainer

    map_large_blocks()  # as the CLI does at start (sysmem.py), so the step is measured as a run takes it
    cfg = load_config(ROOT / "configs" / "demo.yaml", overrides)
    engine = HFEngine(cfg.model.name, dtype=cfg.model.dtype, device="cpu")
    trainer = Trainer(engine.model, engine.tokenizer, cfg.weight, seed=cfg.seed)
    rows = load_rows(rows_path)
    before = peak_rss_kb(reset=True)
    t0 = time.perf_counter()
    stats = trainer.train_step(rows)
    return {"seconds": round(time.perf_counter() - t0, 1), "peak_rss_mib": peak_rss_kb() // 1024,
            "rss_before_mib": before // 1024, "rows": len(rows), "input_tokens": stats["input_tokens"],
            "loss": stats["loss"], "dtype": str(engine.dtype)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.rows, args.overrides)))
        return
    for checkpointing in ("false", "true"):
        sets = [x for o in args.overrides for x in ("--set", o)]
        cmd = [sys.executable, __file__, args.rows, "--one", *sets,
               "--set", f"weight.gradient_checkpointing={checkpointing}"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(f"gradient_checkpointing={checkpointing}: {out}", flush=True)


if __name__ == "__main__":
    main()
