#!/usr/bin/env bash
# Measure the offline 135M model on six reasoning-gym tasks: the answer-prefill probe harness on
# 16 test problems per task (k=4), h0 on the first 8 of them per task (k=2; its replies run to
# 256 tokens, the costly part on a shared 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/rg-probe}
CFG=docs/results/reasoning_gym_135m/probe.yaml
mkdir -p "$OUT"
python3 -m whale.cli eval --domain reasoning_gym --config $CFG --harness docs/results/reasoning_gym_135m/answer_prefill.py \
  --k 4 --out "$OUT/answer_prefill" --json | tail -1 > "$OUT/answer_prefill.json"
python3 -m whale.cli eval --domain reasoning_gym --config $CFG --set domain.splits.test=48 --harness h0 \
  --k 2 --out "$OUT/h0" --json | tail -1 > "$OUT/h0.json"
