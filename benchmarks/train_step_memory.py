#!/usr/bin/env python3
"""Peak memory and time of one RSFT weight step, per variant, each in its own process (so its peak
RSS is its own): glibc's mmap threshold and gradient checkpointing.

    python benchmarks/train_step_memory.py RUN/rows/step_1.jsonl [--set weight.micro_batch_tokens=1024]
    python benchmarks/train_step_memory.py --synthetic 8 --set model.dtype=float32 --mmap-threshold-kib 4096 1024
    python benchmarks/train_step_memory.py --synthetic 8 --checkpointing both

The model, LoRA and weight settings are `whale demo`'s (configs/demo.yaml, plus `--set`), on the
default model in the engine's dtype for this CPU (float32 without fast bf16). Rows are a run's saved
rows, or `--synthetic N` trajectories of random tokens shaped like the demo's search-QA episodes (two
calls of 180-300 prompt and 10-32 sampled tokens; the loss is meaningless, the shapes are what
memory depends on). Prints, per variant: the step's wall and CPU seconds, the process's RSS before
the step (model loaded, LoRA wrapped) and its peak during it, and, sampled every 5 ms, the most
memory glibc had handed out (`live`: heap in use + blocks mapped on their own) and the heap it held
free at the RSS peak: a peak far above `live` is heap fragmentation, not tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synthetic_rows(path: Path, trajectories: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for t in range(trajectories):
            ids, mask = [], []
            for _ in range(2):
                prompt, sampled = rng.randint(180, 300), rng.randint(10, 32)
                ids += [rng.randint(100, 40000) for _ in range(prompt + sampled)]
                mask += [0] * prompt + [1] * sampled
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask, "trajectory_key": f"h0/p{t // 4}/{t % 4}"}) + "\n")


def rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def one(rows_path: str, overrides: list[str]) -> dict:
    from whale.config import load_config
    from whale.engine.hf import HFEngine
    from whale.sysmem import heap_bytes, map_large_blocks, peak_rss_kb
    from whale.weights.rows import load_rows
    from whale.weights.trainer import Trainer

    map_large_blocks()  # as the CLI does at start (a MALLOC_MMAP_THRESHOLD_ in the env wins)
    cfg = load_config(ROOT / "configs" / "demo.yaml", overrides)
    engine = HFEngine(cfg.model.name, dtype=cfg.model.dtype, device="cpu")
    trainer = Trainer(engine.model, engine.tokenizer, cfg.weight, seed=cfg.seed)
    rows = load_rows(rows_path)
    samples: list[tuple[int, int, int]] = []  # (rss kB, live bytes, heap free bytes)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            live, free = heap_bytes()
            samples.append((rss_kb(), live, free))

    live_before, _ = heap_bytes()
    before = rss_kb()
    peak_rss_kb(reset=True)
    sampler = threading.Thread(target=sample, daemon=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    sampler.start()
    stats = trainer.train_step(rows)
    done.set()
    sampler.join()
    at_peak = max(samples) if samples else (0, 0, 0)
    mib = 1 << 20
    return {"seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(time.process_time() - cpu0, 1),
            "rss_before_mib": before // 1024, "peak_rss_mib": peak_rss_kb() // 1024,
            "live_before_mib": live_before // mib, "peak_live_mib": max((s[1] for s in samples), default=0) // mib,
            "heap_free_at_peak_mib": at_peak[2] // mib, "rows": len(rows), "input_tokens": stats["input_tokens"],
            "dtype": str(engine.dtype)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="?", help="a run's rows/step_N.jsonl (or use --synthetic)")
    ap.add_argument("--synthetic", type=int, default=0, metavar="N", help="N trajectories of random tokens")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--mmap-threshold-kib", type=int, nargs="+", default=[None],
                    help="glibc mmap thresholds to compare (default: the CLI's, sysmem.MMAP_THRESHOLD_BYTES)")
    ap.add_argument("--checkpointing", choices=["config", "both"], default="config",
                    help="both: also run each variant with gradient checkpointing on and off")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.rows, args.overrides)))
        return
    if bool(args.rows) == bool(args.synthetic):
        ap.error("give one of: a rows file, --synthetic N")
    rows = args.rows
    if args.synthetic:
        rows = str(Path(tempfile.mkdtemp(prefix="whale-rows-")) / "rows.jsonl")
        synthetic_rows(Path(rows), args.synthetic)
    checkpointing = [None] if args.checkpointing == "config" else ["true", "false"]
    for kib in args.mmap_threshold_kib:
        for ckpt in checkpointing:
            env = dict(os.environ)
            if kib is not None:
                env["MALLOC_MMAP_THRESHOLD_"] = str(kib * 1024)
            sets = [x for o in args.overrides for x in ("--set", o)]
            if ckpt is not None:
                sets += ["--set", f"weight.gradient_checkpointing={ckpt}"]
            cmd = [sys.executable, __file__, rows, "--one", *sets]
            run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            out = run.stdout.strip().splitlines()[-1]
            name = f"mmap threshold {'default' if kib is None else f'{kib} KiB'}" + (
                f", gradient_checkpointing={ckpt}" if ckpt else "")
            print(f"{name}: {out}", flush=True)


if __name__ == "__main__":
    main()
