"""The weight phase on a GPU: a Qwen-shaped model built from a config (nothing downloaded).

What the CPU suite cannot show, checked in one run on whatever GPU is at hand:
1. `Trainer` (one process, bf16 weights + fp32 masters, full fine-tuning) steps on CUDA: step time
   and peak memory.
2. `TrainGroup` with every visible GPU as a rank (NCCL, FSDP2, bf16 compute over fp32 shards) trains
   the same weights as (1) on the same rows: the max weight difference of the saved checkpoints.
3. The hf engine on CUDA serves the checkpoint (load_weights) and generates from it.
4. Where vLLM is importable: a vLLM server on the same GPU (`colocate`, `full_sync="rpc"`) sleeps
   while the trainer steps, wakes, reloads the new checkpoint in place, and its log-probs on a fixed
   completion equal the trainer's model's (max |diff|).

    python scripts/gpu_train_check.py [--layers 28 --hidden 2048] [--out gpu_train.json]
    python scripts/gpu_train_check.py --device cpu --layers 2 --hidden 64   # the script itself, on CPU

The default shape is Qwen3-1.7B's (28 layers, 2048 hidden, 16/8 heads, 6144 MLP) with the tests'
tiny tokenizer: a 2B-class full fine-tune, without the 151k vocabulary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from whale.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from whale.engine.hf import HFEngine  # noqa: E402
from whale.weights import Trainer  # noqa: E402
from whale.weights.distributed import TrainGroup  # noqa: E402


def qwen_shaped(folder: Path, layers: int, hidden: int) -> Path:
    build_tiny_model(folder)  # the tokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    heads = max(2, hidden // 128)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                      max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def max_difference(a: Path, b: Path) -> float:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "layers": args.layers,
                    "hidden": args.hidden}
    work = Path(tempfile.mkdtemp(prefix="whale-gpu-train-"))
    model_dir = qwen_shaped(work / "model", args.layers, args.hidden)
    ranks = torch.cuda.device_count() if cuda else 2
    dtype = "bfloat16" if cuda else "float32"
    cfg = tiny_config(model_dir, **{"weight.finetune": "full", "weight.lr": 1e-5, "weight.mini_batch_trajectories": 4,
                                    "weight.micro_batch_tokens": 2048, "model.dtype": dtype,
                                    "model.device": args.device, "compute.train_ranks": ranks})
    vocab = AutoTokenizer.from_pretrained(model_dir).vocab_size
    steps = [random_rows(16, 512, vocab, n_traj=8, seed=s) for s in range(args.steps)]
    report["parameters"] = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())

    # 1. one process
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(args.device)
    trainer = Trainer(model, AutoTokenizer.from_pretrained(model_dir), cfg.weight, seed=0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for rows in steps:
        t = time.perf_counter()
        trainer.train_step(rows)
        times.append(round(time.perf_counter() - t, 3))
    one = trainer.save(work / "one", "w")
    report["one_process"] = {"step_seconds": times,
                             "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
    del trainer, model
    if cuda:
        torch.cuda.empty_cache()

    # 2. a group of every GPU
    t = time.perf_counter()
    group = TrainGroup(cfg)
    ready = time.perf_counter() - t
    times = []
    for rows in steps:
        t = time.perf_counter()
        group.train_step(rows)
        times.append(round(time.perf_counter() - t, 3))
    t = time.perf_counter()
    grouped = group.save(work / "group", "w")
    report["group"] = {"ranks": ranks, "ready_seconds": round(ready, 1), "step_seconds": times,
                       "save_seconds": round(time.perf_counter() - t, 3),
                       "max_weight_difference_vs_one_process": max_difference(one, grouped)}
    group.close()

    # 3. the hf engine serves the checkpoint
    engine = HFEngine(str(model_dir), dtype=dtype, device=args.device)
    engine.load_weights(str(grouped), "w")
    [[g]] = engine.generate([GenerationRequest([{"role": "user", "content": "What is 2 + 3?"}], seed=0)],
                            SamplingParams(max_tokens=8))
    report["hf_engine"] = {"weights_version": g.weights_version, "tokens": len(g.completion_ids)}
    engine.close()

    # 4. colocated vLLM: sleep, wake, reload in place
    if cuda and importlib.util.find_spec("vllm") is not None:
        report["vllm"] = colocated_vllm(model_dir, grouped, work)
    else:
        report["vllm"] = "skipped: vllm is not importable" if cuda else "skipped: CPU"
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


def colocated_vllm(model_dir: Path, trained: Path, work: Path) -> dict:
    from whale.engine.vllm import VLLMEngine

    engine = VLLMEngine(str(model_dir), colocate=True, full_sync="rpc", gpu_memory_utilization=0.3,
                        max_model_len=2048, log_path=str(work / "vllm.log"))
    try:
        prompt = engine.tokenize_chat([{"role": "user", "content": "What is 2 + 3?"}])
        completion = engine.tokenize_text("The answer is 5.")
        before = torch.cuda.mem_get_info()[0]
        engine.sleep()
        freed = torch.cuda.mem_get_info()[0] - before
        engine.wake_up()
        t = time.perf_counter()
        engine.load_weights(str(trained), "w")
        reload_s = time.perf_counter() - t
        served = engine.token_logprobs(prompt, completion)
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.bfloat16).cuda()
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    mine = logp.gather(1, ids[0, len(prompt):, None])[:, 0].tolist()
    return {"sleep_freed_gib": round(freed / 2**30, 2), "reload_seconds": round(reload_s, 3),
            "max_logprob_difference": max(abs(a - b) for a, b in zip(served, mine))}


if __name__ == "__main__":
    main()
