"""Paired test mean@4 difference of two evaluations of the same test split and seeds.

    python analyse.py BASE_TRACES.jsonl NEW_TRACES.jsonl   # e.g. RUN/evals/eval-w48-test.jsonl OUT/traces.jsonl
"""
import collections
import json
import sys

from whale.report import paired_bootstrap


def per_problem(path):
    rewards = collections.defaultdict(list)
    for line in open(path):
        row = json.loads(line)
        rewards[row["problem_id"]].append(row["reward"])
    return {pid: sum(v) / len(v) for pid, v in rewards.items()}


base, new = per_problem(sys.argv[1]), per_problem(sys.argv[2])
ids = sorted(set(base) & set(new))
point, lo, hi = paired_bootstrap([[new[i] for i in ids]], [[base[i] for i in ids]])
print(f"{sum(base[i] for i in ids) / len(ids):.3f} -> {sum(new[i] for i in ids) / len(ids):.3f}: "
      f"{point:+.3f} [{lo:+.3f}, {hi:+.3f}] over {len(ids)} problems")
