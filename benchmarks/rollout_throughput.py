"""Rollout throughput of the runner against the engine's raw batched generation, measured side by side.

Three ways to produce the same N completions (same prompts, same per-request seeds, so the same
tokens come out):
  raw       engine.generate on all requests at once (the engine batches continuously; no sandbox, no RPC)
  runner    RolloutRunner with N concurrent sandboxed episodes of a one-call harness
  serial    RolloutRunner with concurrency 1: one episode at a time
Targets: runner/raw >= 0.8 and runner/serial >= 4. benchmarks/workloads.py measures the
domains' own multi-call harnesses the same way.

    python benchmarks/rollout_throughput.py [--n 32] [--max-tokens 32] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from whale.config import load_config  # noqa: E402
from whale.domains import load_domain  # noqa: E402
from whale.engine import make_engine  # noqa: E402
from whale.engine.base import GenerationRequest  # noqa: E402
from whale.rollout.runner import RolloutRunner, derive_seed, sampling_from_config  # noqa: E402

HARNESS = '''
SYSTEM_PROMPT = "Answer the question with a short name."
USER_PROMPT = "{question}"

def run(env, llm):
    out = llm([{"role": "system", "content": SYSTEM_PROMPT},
               {"role": "user", "content": USER_PROMPT.format(question=env.question)}], max_tokens=MAXTOK)
    env.submit(str(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="episodes (= concurrent episodes for the runner)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--serial-n", type=int, default=8, help="episodes for the one-at-a-time loop")
    args = ap.parse_args()

    cfg = load_config(None, [f"model.name={args.model}", f"runner.concurrency={args.n}",
                             f"domain.splits.test={max(args.n, args.serial_n)}", "domain.splits.val=8",
                             "domain.splits.harness=8", "domain.splits.weight=64"])
    domain = load_domain(cfg)
    problems = domain.load_splits()["test"][: args.n]
    engine = make_engine(cfg)
    sampling = sampling_from_config(cfg)
    harness = HARNESS.replace("MAXTOK", str(args.max_tokens))
    seed = 1234

    def requests(ps):
        return [GenerationRequest(
            messages=[{"role": "system", "content": "Answer the question with a short name."},
                      {"role": "user", "content": p.question}],
            max_tokens=args.max_tokens, seed=derive_seed(seed, p.id, 0, 0)) for p in ps]

    # warm-up (first-call overheads: kernels, tokenizer caches)
    engine.generate(requests(problems[:2]), sampling)

    engine.load_weights(None, engine.weights_version)  # empty the prefix cache: no run reuses another's KV
    t0 = time.perf_counter()
    raw_tokens = sum(gens[0].completion_tokens for gens in engine.generate(requests(problems), sampling))
    raw_s = time.perf_counter() - t0

    runner = RolloutRunner(engine, domain, cfg)
    runner.run(harness, problems[:2], seed=seed)  # warm-up: grader pool, sandbox
    engine.load_weights(None, engine.weights_version)
    t0 = time.perf_counter()
    trajs = runner.run(harness, problems, seed=seed)
    runner_s = time.perf_counter() - t0
    runner_tokens = sum(t.completion_tokens for t in trajs)
    errors = sum(1 for t in trajs if t.error)
    runner.close()

    serial_cfg = cfg.model_copy(deep=True)
    serial_cfg.runner.concurrency = 1
    serial = RolloutRunner(engine, domain, serial_cfg)
    sp = problems[: args.serial_n]
    engine.load_weights(None, engine.weights_version)
    t0 = time.perf_counter()
    serial.run(harness, sp, seed=seed)
    serial_s = time.perf_counter() - t0
    serial.close()
    engine.close()

    raw_eps = len(problems) / raw_s
    run_eps = len(problems) / runner_s
    ser_eps = len(sp) / serial_s
    print(f"model {args.model}, {len(problems)} episodes, max_tokens {args.max_tokens}, cpu threads {os.cpu_count()}")
    print(f"raw engine : {raw_eps:7.3f} episodes/s  ({raw_s:.1f} s, {raw_tokens} generated tokens)")
    print(f"runner     : {run_eps:7.3f} episodes/s  ({runner_s:.1f} s, {runner_tokens} generated tokens, {errors} errors)")
    print(f"serial     : {ser_eps:7.3f} episodes/s  ({serial_s:.1f} s for {len(sp)} episodes)")
    print(f"runner / raw    = {run_eps / raw_eps:.2f}   (target >= 0.8)")
    print(f"runner / serial = {run_eps / ser_eps:.2f}   (target >= 4)")


if __name__ == "__main__":
    main()
