#!/usr/bin/env bash
# Fixed-harness evaluations on the offline default: `whale eval --json` on all three domains,
# and search QA with and without retrieval on 64 test questions (strict EM, re-graded with the
# bounded subspan grader from the saved traces).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/eval_offline}
mkdir -p "$OUT"
for d in math chess searchqa; do
  whale eval --domain $d --harness h0 --split test --k 4 --limit 16 --json --out "$OUT/$d-h0" | tail -1 > "$OUT/$d-h0.json"
done
# math and chess: h0 against h0 with the mutations that constrain or tool the answer
whale eval --domain chess --harness examples/harnesses/chess_constrained_choice.py --split test --k 4 --limit 16 --json \
  --out "$OUT/chess-constrained" | tail -1 > "$OUT/chess-constrained.json"
whale eval --domain math --harness examples/harnesses/math_python_first.py --split test --k 4 --limit 16 --json \
  --out "$OUT/math-python-first" | tail -1 > "$OUT/math-python-first.json"
for h in h0 examples/harnesses/searchqa_no_search.py examples/harnesses/searchqa_question_query.py; do
  n=$(basename "$h" .py)
  whale eval --domain searchqa --harness "$h" --split test --k 2 --limit 64 --json --out "$OUT/sqa64-$n" \
    --set 'domain.options={templates: [capital, currency]}' --set domain.splits.weight=256 --set domain.splits.harness=16 --set domain.splits.val=16 \
    | tail -1 > "$OUT/sqa64-$n.json"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from whale.domains.searchqa.grading import grade_em, grade_subspan
from whale.domains.base import Problem
out = Path(sys.argv[1])
for f in sorted(out.glob("sqa64-*/traces.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    em = sum(grade_em(Problem("x", "", r["gold"]), r["answer"]) for r in rows) / len(rows)
    sub = sum(grade_subspan(Problem("x", "", r["gold"]), r["answer"]) for r in rows) / len(rows)
    print(f"{f.parent.name:40s} n_rollouts={len(rows)}  EM={em:.3f}  subspan={sub:.3f}")
PY
