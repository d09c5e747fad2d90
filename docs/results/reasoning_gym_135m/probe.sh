#!/usr/bin/env bash
# Measure the offline 135M model on six reasoning-gym tasks with h0 and the answer-prefill probe.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/rg-probe}
mkdir -p "$OUT"
for h in h0 docs/results/reasoning_gym_135m/answer_prefill.py; do
  name=$(basename "$h" .py)
  python3 -m whale.cli eval --domain reasoning_gym --config docs/results/reasoning_gym_135m/probe.yaml \
    --harness "$h" --k 4 --out "$OUT/$name" --json | tail -1 > "$OUT/$name.json"
done
