"""Paired differences of each harness against h0, from `whale eval --out DIR/<harness>` summaries.

    python docs/results/headroom_after_weights/analyse.py DIR     (default: harnesses/ beside this file)
"""
import json
import sys
from pathlib import Path

from whale.report import paired_bootstrap


def summaries(folder: Path) -> dict[str, dict]:
    found = {d.name: d / "summary.json" for d in folder.iterdir() if (d / "summary.json").exists()}
    found.update({f.name.removesuffix(".summary.json"): f for f in folder.glob("*.summary.json")})
    return {name: json.loads(path.read_text()) for name, path in sorted(found.items())}


if __name__ == "__main__":
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "harnesses"
    per = summaries(folder)
    base = per["h0"]["per_problem"]
    print("| harness | test mean@k | vs h0, paired 95% |\n|---|---|---|")
    for name, s in per.items():
        if name == "h0":
            print(f"| h0 | {s['mean_at_k']:.3f} | - |")
            continue
        d, lo, hi = paired_bootstrap([s["per_problem"]], [base])
        print(f"| {name} | {s['mean_at_k']:.3f} | {d:+.3f} [{lo:+.3f}, {hi:+.3f}] |")
