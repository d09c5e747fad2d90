"""Reports: where each rollout went and what it bought.

`write_report(run_dir)` turns one run's metrics.jsonl and archive into report/report.md and plots
(test/val mean@k against cumulative budget rollouts and tokens with the phases shaded, the weight
phase's accept rate, the harness lineage). Several runs side
by side: whale/compare.py.

The three test numbers are reported together on purpose: "best" is the paper's (the maximum of
the test curve, i.e. selected on test), "val-selected" is the honest one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from whale.config import ConfigError  # noqa: E402
from whale.store import BUDGET_PURPOSES, read_metrics  # noqa: E402

PHASE_COLORS = {"weight": "#dbe9f6", "harness": "#f6e3db"}
PHASE_COLORS_STRONG = {"W": "#4c8ed1", "H": "#d8774f"}


def load_run(run_dir: Path) -> tuple[list[dict], dict, dict]:
    if not (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir} has no metrics.jsonl (not a run directory, or the run has not started)")
    import yaml

    rows = read_metrics(run_dir)
    state = json.loads((run_dir / "state.json").read_text()) if (run_dir / "state.json").exists() else {}
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    return rows, state, cfg


def x_value(row: dict, axis: str) -> float:
    led = row.get("ledger", {})
    return led.get("budget_rollouts", 0) if axis == "rollouts" else led.get("tokens", 0)


def _phase_spans(rows: list[dict], axis: str) -> list[tuple[str, float, float]]:
    spans: list[tuple[str, float, float]] = []
    for r in rows:
        ev = r.get("event", "")
        phase = "weight" if ev == "weight_step" else ("harness" if ev in ("iteration_end", "candidate", "rescore")
                                                      else None)
        if phase is None:
            continue
        x = x_value(r, axis)
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], x)
        else:
            start = spans[-1][2] if spans else 0.0
            spans.append((phase, start, x))
    return spans


def _curve_plot(rows: list[dict], axis: str, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for phase, a, b in _phase_spans(rows, axis):
        ax.axvspan(a, b, color=PHASE_COLORS[phase], lw=0)
    for split, style in (("test", "o-"), ("val", "s--")):
        pts = [(x_value(r, axis), r["mean_at_k"]) for r in rows if r.get("event") == "eval" and r.get("split") == split]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{split} mean@k")
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color=c, label=f"{p} phase") for p, c in PHASE_COLORS.items()]
    ax.legend(handles=handles, fontsize=8)
    ax.set_xlabel("cumulative budget rollouts (weight + harness search)" if axis == "rollouts" else "cumulative tokens")
    ax.set_ylabel("mean@k")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _accept_plot(rows: list[dict], path: Path) -> bool:
    steps = [r for r in rows if r.get("event") == "weight_step"]
    if not steps:
        return False
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([r["step"] for r in steps], [r["accept_rate"] for r in steps], "o-")
    ax.set_xlabel("weight step")
    ax.set_ylabel("training accept rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _lineage(run_dir: Path) -> list[dict]:
    p = run_dir / "harnesses" / "summary.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in open(p) if line.strip()]


def search_provenance(cfg: dict, rows: list[dict]) -> dict[str, Any]:
    """Who searched the harness and with what: the proposer, whether the domain's hints were on
    (`harness.domain_hints`; runs from before the key had them on), and, for each harness accepted
    in place of its incoming one, the mechanisms of its lineage ("hint: <name>" for a domain's
    hints), so a reader sees how much of a result is the general search and how much our
    hand-written knowledge. None for runs without a harness search."""
    if cfg.get("schedule", {}).get("kind") == "weight_only":
        return {}
    h = cfg.get("harness", {})
    made = {r["id"]: r for r in rows if r.get("event") == "candidate" and r.get("id")}

    def lineage(cid: str) -> list[str]:
        out: list[str] = []
        while cid in made and len(out) < 64:
            out.append(str(made[cid].get("mechanism") or "?"))
            cid = made[cid].get("parent") or ""
        return out[::-1]

    accepted = [(r["accepted"], r.get("phase_incoming") or r.get("harness")) for r in rows
                if r.get("event") == "harness_accepted" and r.get("accepted") in made]
    return {"proposer": h.get("proposer", "mutation"), "hints": "on" if h.get("domain_hints", True) else "off",
            "accepted": [f"{cid} = {' + '.join(lineage(cid))}" for cid, _ in dict.fromkeys(accepted)]}


def provenance_line(prov: dict[str, Any]) -> str:
    if not prov:
        return ""
    return (f"proposer **{prov['proposer']}**, domain hints **{prov['hints']}**, accepted mechanisms: "
            + ("; ".join(prov["accepted"]) or "none (the incoming harness was kept)"))


def _lineage_plot(run_dir: Path, accepted: list[str], path: Path) -> bool:
    rows = _lineage(run_dir)
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    versions = sorted({r.get("weights_version", "") for r in rows}, key=lambda v: [r.get("weights_version") for r in rows].index(v))
    pos = {}
    for i, r in enumerate(rows):
        pos[(r["id"], r.get("weights_version"))] = (i, r.get("success_rate", 0.0))
    for (cid, ver), (x, y) in pos.items():
        meta_p = run_dir / "harnesses" / cid / "meta.json"
        parent = json.loads(meta_p.read_text()).get("parent") if meta_p.exists() else None
        if parent and (parent, ver) in pos:
            px, py = pos[(parent, ver)]
            ax.plot([px, x], [py, y], color="#bbbbbb", lw=0.8, zorder=1)
    for ver_i, ver in enumerate(versions):
        pts = [(x, y, cid) for (cid, v), (x, y) in pos.items() if v == ver]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, label=f"weights {ver}", zorder=2)
        for x, y, cid in pts:
            ax.annotate(cid + (" (accepted)" if cid in accepted else ""), (x, y), fontsize=7, xytext=(2, 3),
                        textcoords="offset points", fontweight="bold" if cid in accepted else "normal")
    ax.set_xlabel("candidate evaluation (order)")
    ax.set_ylabel("success rate on D_harness")
    ax.legend(fontsize=7)
    ax.set_title("harness lineage (edges: parent -> child)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def phase_attribution(rows: list[dict], split: str) -> list[dict[str, Any]]:
    """Which phase bought how much: the change in `split` mean@k between consecutive evaluations,
    labelled by the phases run in between (W1 = first weight phase, H1 = first harness phase),
    with a paired bootstrap interval over the problems (both evaluations use the same problems).

    A phase that left the (harness, weights) pair as it was (a weight phase whose steps accepted
    nothing to train on, a harness phase that kept its incoming harness) bought nothing, and the
    run skips the evaluation after it (same pair, same seeds), so the next interval also spans
    the phase after it; such a phase is listed under `idle`, not in `phases`, so that interval is
    attributed to the phase that did change the pair instead of reading as a mixed one. Whether a
    phase changed anything is read from its rows (weight_step's new version; harness_accepted's
    id against the incoming harness); a phase whose rows do not say counts as having changed."""
    out: list[dict[str, Any]] = []
    prev, phases, counts, last_kind = None, [], {"W": 0, "H": 0}, None
    idle: set[str] = set()
    incoming: dict[str, Any] = {}
    for r in rows:
        ev = r.get("event")
        kind = "W" if ev == "weight_step" else "H" if ev in ("rescore", "iteration_end") else None
        if kind is not None:
            if kind != last_kind:
                counts[kind] += 1
                last_kind = kind
            label = f"{kind}{counts[kind]}"
            if label not in phases:
                phases.append(label)
                if kind == "W" and "weights_version" in r:
                    idle.add(label)  # until one of its steps trained
                incoming.setdefault(label, r.get("harness"))
            if kind == "W" and r.get("weights_version", "?"):
                idle.discard(label)  # a step that trained (or a row that does not say)
        if ev == "harness_accepted" and last_kind == "H":
            label = f"H{counts['H']}"
            if r.get("accepted") is not None and r.get("accepted") == incoming.get(label):
                idle.add(label)  # it kept its incoming harness
        if ev != "eval" or r.get("split") != split:
            continue
        if prev is not None and prev.get("per_problem") and r.get("per_problem"):
            point, lo, hi = paired_bootstrap([r["per_problem"]], [prev["per_problem"]])
            active = [p for p in phases if p not in idle]
            out.append({"phases": "+".join(active or phases) or "-", "idle": [p for p in phases if p in idle] if active else [],
                        "from": prev.get("tag"), "to": r.get("tag"),
                        "before": prev["mean_at_k"], "after": r["mean_at_k"], "gain": point, "ci95": [lo, hi],
                        "budget_rollouts": x_value(r, "rollouts") - x_value(prev, "rollouts")})
        prev, phases = r, []
    return out


def _attribution_plot(parts: dict[str, list[dict]], totals: dict[str, tuple], path: Path, title: str) -> bool:
    """Bars: the gain of each phase on the split evaluated most often, then start -> end per split."""
    if not parts:
        return False
    split = max(parts, key=lambda k: len(parts[k]))
    bars = [(p["phases"], p["gain"], p["ci95"], PHASE_COLORS_STRONG.get(p["phases"][0], "#999999")
             if "+" not in p["phases"] else "#bbbbbb") for p in parts[split]]
    bars += [(f"total ({k})", g, [lo, hi], "#666666") for k, (g, lo, hi) in totals.items()]
    fig, ax = plt.subplots(figsize=(1.2 * len(bars) + 2.5, 3.6))
    xs = range(len(bars))
    gains = [b[1] for b in bars]
    err = [[g - b[2][0] for g, b in zip(gains, bars)], [b[2][1] - g for g, b in zip(gains, bars)]]
    ax.bar(xs, gains, 0.6, yerr=err, capsize=3, color=[b[3] for b in bars], edgecolor="black")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel(f"gain in mean@k (phases: {split})")
    ax.set_title(title + " (paired 95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _attribution_lines(rows: list[dict], splits: list[str]) -> tuple[list[str], dict[str, list[dict]], dict[str, tuple]]:
    parts = {split: phase_attribution(rows, split) for split in splits}
    parts = {k: v for k, v in parts.items() if v}
    totals: dict[str, tuple] = {}
    if not parts:
        return [], parts, totals
    lines = ["## Which phase bought how much", "",
             "Change in mean@k between consecutive evaluations, labelled by the phases run in between "
             "(W = weight phase, H = harness phase, numbered in order); paired bootstrap 95% intervals over "
             "the same problems. An interval that includes 0 is no effect shown.", "",
             "| split | phases | evaluations | mean@k before → after | gain | 95% CI | budget rollouts |",
             "|---|---|---|---|---|---|---|"]
    for split, items in parts.items():
        for p in items:
            ran = p["phases"] + "".join(f" ({q} changed nothing)" for q in p.get("idle", []))
            lines.append(f"| {split} | {ran} | {p['from']} → {p['to']} | {p['before']:.3f} → {p['after']:.3f} | "
                         f"{p['gain']:+.3f} | [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}] | {p['budget_rollouts']} |")
    for split in parts:
        evals = [r for r in rows if r.get("event") == "eval" and r.get("split") == split and r.get("per_problem")]
        if len(evals) >= 2:
            point, lo, hi = totals[split] = paired_bootstrap([evals[-1]["per_problem"]], [evals[0]["per_problem"]])
            lines += ["", f"**{split}, start → end: {evals[0]['mean_at_k']:.3f} → {evals[-1]['mean_at_k']:.3f}, "
                      f"gain {point:+.3f}, paired 95% CI [{lo:+.3f}, {hi:+.3f}]** "
                      f"({evals[-1].get('n')} problems × k={evals[-1].get('k')})."]
    lines += ["", "![gain by phase](phase_gains.png)", ""]
    return lines, parts, totals


def write_report(run_dir: str | Path) -> Path:
    from whale.run import load_summary

    run_dir = Path(run_dir)
    rows, state, cfg = load_run(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    name = cfg.get("name", run_dir.name)
    _curve_plot(rows, "rollouts", out / "accuracy_vs_rollouts.png", f"{name}: accuracy vs rollouts")
    _curve_plot(rows, "tokens", out / "accuracy_vs_tokens.png", f"{name}: accuracy vs tokens")
    has_accept = _accept_plot(rows, out / "accept_rate.png")
    accepted = [r["accepted"] for r in rows if r.get("event") == "harness_accepted"]
    has_lineage = _lineage_plot(run_dir, accepted, out / "lineage.png")
    s = load_summary(run_dir)
    led = state.get("ledger", {})
    sched = cfg.get("schedule", {})
    dom = cfg.get("domain", {})
    prov = provenance_line(search_provenance(cfg, rows))
    lines = [f"# WHALE run report: {name}", "",
             f"- domain: **{dom.get('module') or dom.get('name')}**, model: `{cfg.get('model', {}).get('name')}`, "
             f"schedule: **{sched.get('kind')}**{' (adaptive)' if sched.get('adaptive') else ''}, seed {cfg.get('seed')}, "
             f"grader: **{cfg.get('domain', {}).get('grader')}**",
             *([f"- harness search: {prov}"] if prov else []),
             f"- status: {state.get('phase')}, wall time {state.get('elapsed_s', 0):.0f} s" + (
                 "" if state.get("finished") else f" (**unfinished**: 'final' below is its latest evaluation; "
                 f"`whale run --resume {run_dir}` continues it)"),
             *[f"- engine server recovered in {r['unit']}: {r['reason']}{'' if r.get('ok') else ' (failed)'}"
               for r in rows if r.get("event") == "engine_recovered"], "",
             "## Test mean@k", "", "| initial | final | best (paper's, selected on test) | val-selected (honest) |",
             "|---|---|---|---|", f"| {fmt(s['initial'])} | {fmt(s['final'])} | {fmt(s['best'])} | "
             f"{fmt(s['val_selected'])} |", "",
             "## Where the rollouts went", "", "| purpose | rollouts | counts toward budget |", "|---|---|---|"]
    for purpose, n in sorted(led.get("rollouts", {}).items()):
        lines.append(f"| {purpose} | {n} | {'yes' if purpose in BUDGET_PURPOSES else 'recorded only'} |")
    lines += ["", f"LLM calls {led.get('llm_calls', 0)}, tokens {led.get('tokens', 0)} "
              f"(prompt {led.get('prompt_tokens', 0)}, generated {led.get('completion_tokens', 0)}), "
              f"proposer time {led.get('proposer_seconds', 0)} s.", "",
              "![accuracy vs rollouts](accuracy_vs_rollouts.png)", "", "![accuracy vs tokens](accuracy_vs_tokens.png)", ""]
    attribution, parts, totals = _attribution_lines(rows, ["test", "val"])
    if attribution and _attribution_plot(parts, totals, out / "phase_gains.png", f"{name}: gain by phase"):
        lines += attribution
    evals = [r for r in rows if r.get("event") == "eval"]
    if evals:
        lines += ["## Evaluations", "", "| unit | split | harness | weights | mean@k | 95% CI | pass@k | budget rollouts |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in evals:
            ci = r.get("ci95", [0, 0])
            lines.append(f"| {r['unit']} | {r['split']} | {r.get('harness')} | {r.get('weights_version')} | "
                         f"{r['mean_at_k']:.3f} | [{ci[0]:.3f}, {ci[1]:.3f}] | {r['pass_at_k']:.3f} | {x_value(r, 'rollouts')} |")
        last = evals[-1]
        if last.get("per_source"):
            lines += ["", f"Per data source (last evaluation, {last['split']}):", "", "| source | n | mean@k | pass@k |",
                      "|---|---|---|---|"]
            for src, v in last["per_source"].items():
                lines.append(f"| {src} | {v['n']} | {v['mean_at_k']:.3f} | {v['pass_at_k']:.3f} |")
        lines.append("")
    steps = [r for r in rows if r.get("event") == "weight_step"]
    if steps:
        lines += ["## Weight phase", "", "| step | harness | accept rate | rows | trained tokens | loss | gen s | train s | note |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in steps:
            loss = "-" if r.get("loss") is None else f"{r['loss']:.4f}"
            lines.append(f"| {r['step']} | {r.get('harness')} | {r['accept_rate']:.3f} | {r['rows']} | {r['trained_tokens']} | "
                         f"{loss} | {r['gen_seconds']:.0f} | {r['train_seconds']:.0f} | {r['reason']} |")
        lines.append("")
        if has_accept:
            lines += ["![accept rate](accept_rate.png)", ""]
    harness_rows = [r for r in rows if r.get("event") in ("candidate", "rescore", "invalid", "duplicate", "proposer_error",
                                                          "confirm", "confirm_stopped", "null_probe")]
    if harness_rows or accepted:
        lines += ["## Harness phase", "", f"Accepted harnesses, phase by phase: {' -> '.join(['h0'] + accepted)}", "",
                  "| unit | event | candidate | weights | success | note |", "|---|---|---|---|---|---|"]
        for r in harness_rows:
            if r["event"] == "confirm":
                rounds = f" (round {r['round']}/{r['rounds']}, pooled)" if r.get("rounds") else ""
                r = {**r, "success_rate": r.get("mean_a"), "reason": f"fresh seeds{rounds}: {r.get('mean_a', 0):.3f} vs incoming "
                     f"{r.get('mean_b', 0):.3f}, paired gain {r.get('gain', 0):+.3f}, {fmt_p(r.get('p'))} "
                     f"({'passes' if r.get('passes') else 'not shown'} at {r.get('level')})"}
            elif r["event"] == "null_probe":
                r = {**r, "success_rate": r.get("real"), "reason": f"null engine {r.get('null', 0):.3f}, {fmt_p(r.get('p'))}"
                     f"{', FLAGGED' if r.get('flagged') else ''}"}
            sr = r.get("success_rate")
            lines.append(f"| {r['unit']} | {r['event']} | {r.get('id', '')} | {r.get('weights_version')} | "
                         f"{'' if sr is None else f'{sr:.3f}'} | {str(r.get('reason', r.get('mechanism', '')))[:120]} |")
        lines.append("")
        if has_lineage:
            lines += ["![lineage](lineage.png)", ""]
    lines += _matrix_section(run_dir)
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"


def _matrix_section(run_dir: Path) -> list[str]:
    """The harness x weights matrix (`whale matrix`), when it was built: its tables and heatmap."""
    md = run_dir / "matrix" / "matrix.md"
    if not md.is_file():
        return []
    body = [line.replace("](matrix.png)", "](../matrix/matrix.png)").replace("## ", "### ", 1)
            if line.startswith("## ") or "](matrix.png)" in line else line
            for line in md.read_text().splitlines()[1:]]  # its own title replaced by the section heading
    return ["## Harness x weights matrix", "", *body]


def fmt_p(p: Any) -> str:
    """A p-value as text. Records before session 17 rounded p to 4 decimals, so a 0 there means
    below 0.00005; a sign-flip p-value is never exactly 0."""
    if not isinstance(p, (int, float)):
        return "p = ?"
    return "p < 0.0001" if p < 1e-4 else f"p = {p:.3g}"


def fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}"


def paired_bootstrap(a: list[list[float]], b: list[list[float]], iters: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean difference a - b and its 95% interval, resampling seeds and problems, both paired.

    a[s][i]: per-problem mean@k of method A with seed s on problem i; b[s][i] the same for B with
    the same seed (same splits) and problem. Seeds and problems are drawn with replacement, the
    same draws for both methods, so the interval reflects only what differs between them."""
    pairs = [(x, y) for x, y in zip(a, b) if x and y]
    if not pairs:
        raise ValueError("paired bootstrap needs runs of both methods with the same seeds")
    rng = random.Random(seed)

    def diff(seeds: list[int], idx_of) -> float:
        total = 0.0
        for s in seeds:
            x, y = pairs[s]
            idx = idx_of(len(x))
            total += sum(x[i] - y[i] for i in idx) / len(idx)
        return total / len(seeds)

    point = diff(list(range(len(pairs))), lambda n: range(n))
    samples = sorted(diff([rng.randrange(len(pairs)) for _ in pairs], lambda n: [rng.randrange(n) for _ in range(n)])
                     for _ in range(iters))
    return round(point, 4), round(samples[int(0.025 * iters)], 4), round(samples[int(0.975 * iters) - 1], 4)
