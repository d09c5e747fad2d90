"""Throughput of one RSFT weight update: whale's Trainer vs a plain PyTorch + peft loop.

Both variants train the same LoRA (all-linear, same r/alpha) on the same synthetic rows with the
same mini-batch (one optimizer step per `mini_batch_trajectories`) and the same micro-batches
(packed by padded token count). The only differences are what whale's Trainer adds: chunked
cross-entropy over loss positions only (the plain loop materialises full fp32 logits) and its
bookkeeping. Each variant runs in its own subprocess so that peak RSS is its own.

    python benchmarks/rsft_step.py            # SmolLM2-135M from ~/.cache/whale/models if present
    python benchmarks/rsft_step.py --tiny     # the tiny test model (seconds)
    python benchmarks/rsft_step.py --full-bf16 [--tiny]   # cost of fp32 master weights (below)

Prints tokens/s (input tokens through forward+backward; best step) by wall clock and by process
CPU time (steadier on a shared machine), the ratio trainer/plain (target >= 0.9) and peak memory
(process max RSS; on CUDA also torch's peak allocated memory).

`--full-bf16` measures what the fp32 master weights of full fine-tuning cost on a bf16 model:
whale's Trainer against the same Trainer with the masters removed (AdamW on the bf16 weights, the
code before masters, whose updates at lr 1e-7 round to nothing), in ONE process, their steps
interleaved so machine load hits both alike. Memory is counted exactly from the tensors
(parameters, masters, optimizer state), not from RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "whale" / "models" / "smollm2-135m-instruct"
WORDS = ("the capital of france is paris what is two plus three answer search query result "
         "move knight bishop checkmate python code print value list sum question because therefore").split()


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def make_rows(tok, n_rows: int, tokens: int, seed: int = 0):
    """Chat-templated prompts (~2/3 of the row) and completions ending in EOS (~1/3), lengths ±30%."""
    from whale.weights.rows import TrainingRow

    g = random.Random(seed)
    rows = []
    for i in range(n_rows):
        target = int(tokens * g.uniform(0.7, 1.3))
        text = " ".join(g.choice(WORDS) for _ in range(target))
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)[: (2 * target) // 3]
        answer = tok.encode(" ".join(g.choice(WORDS) for _ in range(target)), add_special_tokens=False)
        completion = answer[: target - len(prompt) - 1] + [tok.eos_token_id]
        rows.append(TrainingRow(prompt + completion, [0] * len(prompt) + [1] * len(completion), f"t{i}"))
    return rows


def plain_step(model, params, optimizer, rows, cfg, pad_id, device):
    """The textbook loop: full logits, CE with ignore_index, token mean over the mini-batch."""
    import torch
    import torch.nn.functional as F

    from whale.weights.trainer import pack_micro_batches

    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(r.trajectory_key, []).append(r)
    keys = list(groups)
    m = cfg.mini_batch_trajectories
    model.train()
    tokens = 0
    for i in range(0, len(keys), m):
        batch = [r for k in keys[i:i + m] for r in groups[k]]
        n_loss = sum(sum(r.loss_mask[1:]) for r in batch)
        for micro in pack_micro_batches(batch, cfg.micro_batch_tokens):
            width = max(len(r.input_ids) for r in micro)
            ids = torch.full((len(micro), width), pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for j, r in enumerate(micro):
                n = len(r.input_ids)
                ids[j, :n] = torch.tensor(r.input_ids)
                attn[j, :n] = 1
                labels[j, :n] = torch.tensor([t if mk else -100 for t, mk in zip(r.input_ids, r.loss_mask)])
            ids, attn, labels = ids.to(device), attn.to(device), labels.to(device)
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100, reduction="sum")
            (loss / n_loss).backward()
            tokens += int(attn.sum())
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return tokens


def run_variant(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from whale.config import WeightConfig
    from whale.weights.trainer import Trainer

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = WeightConfig(micro_batch_tokens=args.micro_batch_tokens, mini_batch_trajectories=64)
    rows = make_rows(tok, args.rows, args.tokens)
    warm = rows[: max(2, len(rows) // 16)]
    if args.variant == "trainer":
        trainer = Trainer(model, tok, cfg)
        step = lambda rs: trainer.train_step(rs)["input_tokens"]  # noqa: E731
    else:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        step = lambda rs: plain_step(model, params, optimizer, rs, cfg, pad, device)  # noqa: E731
    step(warm)  # warm-up (allocator, kernels), not timed
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_rss = rss_mb()
    walls, cpus, tokens = [], [], 0
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = step(rows)
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    out = {
        "variant": args.variant, "tokens": tokens, "wall_s": walls, "cpu_s": cpus,
        "tokens_per_s": tokens / min(walls), "tokens_per_cpu_s": tokens / min(cpus),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_mb": base_rss,
        "loss_tokens": sum(sum(r.loss_mask) for r in rows), "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def _without_masters(trainer):
    """The Trainer as it was before fp32 masters: AdamW over the bf16 parameters themselves."""
    import torch

    trainer.masters, trainer._low_precision, trainer.optimized = {}, [], trainer.params
    trainer.optimizer = torch.optim.AdamW(trainer.params, lr=trainer.cfg.lr, weight_decay=trainer.cfg.weight_decay)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
    return trainer


def _state_bytes(trainer) -> int:
    tensors = list(trainer.params) + list(trainer.masters.values())
    tensors += [t for st in trainer.optimizer.state.values() for t in st.values() if hasattr(t, "numel")]
    return sum(t.numel() * t.element_size() for t in tensors)


def full_bf16(args) -> None:
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from whale.config import WeightConfig
    from whale.weights.trainer import Trainer

    device = torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = WeightConfig(finetune="full", lr=1e-7, micro_batch_tokens=args.micro_batch_tokens, mini_batch_trajectories=64)
    rows = make_rows(tok, args.rows, args.tokens)
    trainers = {}
    for name in ("masters", "bf16_only"):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device)
        trainers[name] = t = Trainer(model, tok, cfg)
        if name == "bf16_only":
            _without_masters(t)
        t.train_step(rows[:2])  # warm-up; creates the optimizer state
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for rnd in range(args.rounds * args.repeats):
        for name in (("masters", "bf16_only") if rnd % 2 == 0 else ("bf16_only", "masters")):
            t0 = time.perf_counter()
            trainers[name].train_step(rows)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in trainers["masters"].params)
    result = {"params": n_params}
    for name, t in trainers.items():
        b = _state_bytes(t)
        result[name] = {"median_step_s": statistics.median(times[name]), "steps": len(times[name]),
                        "state_bytes": b, "bytes_per_param": b / n_params}
        print(f"{name:10s} median step {result[name]['median_step_s']:.3f} s over {len(times[name])} steps  "
              f"params+masters+optimizer state {b / 2**20:.1f} MiB ({b / n_params:.1f} bytes/param)")
    # paired by round (adjacent steps share the machine's load): mean log-ratio with a 95% t interval
    logs = [math.log(a / b) for a, b in zip(times["masters"], times["bf16_only"])]
    half = 2.0 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    mean = statistics.fmean(logs)
    result["time_ratio"] = math.exp(mean)
    result["time_ratio_95ci"] = [math.exp(mean - half), math.exp(mean + half)]
    result["memory_ratio"] = result["masters"]["state_bytes"] / result["bf16_only"]["state_bytes"]
    lo, hi = result["time_ratio_95ci"]
    print(f"masters / bf16-only: step time x{result['time_ratio']:.2f} (paired 95% CI {lo:.2f}-{hi:.2f}, "
          f"{len(logs)} pairs), state memory x{result['memory_ratio']:.2f}")
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="use the tiny random test model")
    ap.add_argument("--model", default=None, help="model folder (default: the cached SmolLM2-135M)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=300, help="mean row length")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per process (best counts)")
    ap.add_argument("--rounds", type=int, default=1, help="processes per variant, order alternating")
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--variant", choices=["trainer", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--full-bf16", action="store_true", help="cost of fp32 masters in full bf16 fine-tuning")
    args = ap.parse_args()

    if args.variant:  # child process
        print(json.dumps(run_variant(args)))
        return
    if args.model is None:
        if args.tiny or not DEFAULT_MODEL.exists():
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from tiny_model import build_tiny_model

            args.model = str(build_tiny_model(tempfile.mkdtemp(prefix="whale-bench-")))
        else:
            args.model = str(DEFAULT_MODEL)
    if args.full_bf16:
        full_bf16(args)
        return
    print(f"model {args.model}  rows {args.rows} x ~{args.tokens} tokens  micro-batch {args.micro_batch_tokens} "
          f"tokens  device {args.device}  repeats {args.repeats}")
    results: dict[str, list[dict]] = {"plain": [], "trainer": []}
    for rnd in range(args.rounds):  # alternate the order so drifting machine load hits both
        for variant in ("plain", "trainer") if rnd % 2 == 0 else ("trainer", "plain"):
            cmd = [sys.executable, __file__, "--variant", variant, "--model", args.model, "--rows",
                   str(args.rows), "--tokens", str(args.tokens), "--micro-batch-tokens",
                   str(args.micro_batch_tokens), "--repeats", str(args.repeats), "--device", args.device]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
            results[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    best = {}
    for name, runs in results.items():
        r = best[name] = {
            "tokens": runs[0]["tokens"], "loss_tokens": runs[0]["loss_tokens"],
            "tokens_per_s": max(x["tokens_per_s"] for x in runs),
            "tokens_per_cpu_s": max(x["tokens_per_cpu_s"] for x in runs),
            "max_rss_mb": max(x["max_rss_mb"] for x in runs), "rss_before_mb": max(x["rss_before_mb"] for x in runs),
            "wall_s": [w for x in runs for w in x["wall_s"]], "threads": runs[0]["threads"],
        }
        extra = ""
        if "cuda_peak_mb" in runs[0]:
            r["cuda_peak_mb"] = max(x["cuda_peak_mb"] for x in runs)
            extra = f"  cuda peak {r['cuda_peak_mb']:.0f} MB"
        print(f"{name:8s} {r['tokens_per_s']:9.1f} tokens/s wall  {r['tokens_per_cpu_s']:9.1f} tokens/cpu-s  "
              f"({r['tokens']} tokens/step; best of {len(r['wall_s'])})  max RSS {r['max_rss_mb']:.0f} MB "
              f"(after load+warm-up {r['rss_before_mb']:.0f} MB){extra}")
    ratio = best["trainer"]["tokens_per_s"] / best["plain"]["tokens_per_s"]
    cpu_ratio = best["trainer"]["tokens_per_cpu_s"] / best["plain"]["tokens_per_cpu_s"]
    print(f"ratio trainer/plain = {ratio:.2f} wall, {cpu_ratio:.2f} cpu-time  (target >= 0.9)")
    print(json.dumps({"ratio": ratio, "cpu_ratio": cpu_ratio, **best}))


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    main()
