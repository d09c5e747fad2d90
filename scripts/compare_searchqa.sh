#!/usr/bin/env bash
# A small method comparison (docs/results/cmp; the powered one is scripts/compare.py): WHALE,
# weight-only, harness-only and prompt-only on configs/searchqa_cpu.yaml, same rollout budget,
# seeds given as arguments (default 0 1 2).
# Runs one after another (2 cores); a killed run continues with the same command (--resume).
# KINDS="whale weight_only" limits the methods (e.g. to run two queues side by side).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/cmp}
seeds=("$@")
[ ${#seeds[@]} -eq 0 ] && seeds=(0 1 2)
KINDS=${KINDS:-whale weight_only harness_only prompt_only}
for seed in "${seeds[@]}"; do
  for kind in $KINDS; do
    dir=$OUT/$kind-s$seed
    if [ -f "$dir/state.json" ]; then
      whale run --resume "$dir" || echo "FAILED $dir"
    else
      whale run configs/searchqa_cpu.yaml --set schedule.kind=$kind --set seed=$seed --set name=$kind-s$seed \
        --out "$dir" || echo "FAILED $dir"
    fi
  done
done
