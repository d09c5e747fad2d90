"""Reports: where each rollout went and what it bought.

`write_report(run_dir)` turns one run's metrics.jsonl and archive into report/report.md with PNG
plots (whale/plots.py) and report/report.html, the same sections on one self-contained page with
the harness lineage, diffs and traces to open (whale/report_html.py). Several runs side by side:
whale/compare.py.

The three test numbers are reported together on purpose: "best" is the paper's (the maximum of
the test curve, i.e. selected on test), "val-selected" is the honest one.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import yaml
from matplotlib.figure import Figure

from whale import plots
from whale.config import ConfigError
from whale.plots import x_value  # noqa: F401  (compare.py reads it from here)
from whale.report_html import event_note, fmt_p, write_html  # noqa: F401  (fmt_p: read from here too)
from whale.run_state import RunState
from whale.store import BUDGET_PURPOSES, load_summary, read_jsonl_rows, read_metrics, read_state

def load_run(run_dir: Path) -> tuple[list[dict], RunState | None, dict]:
    """The run's metrics rows, its state (None before its first save) and its config as a dict."""
    if not (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir} has no metrics.jsonl (not a run directory, or the run has not started)")
    rows = read_metrics(run_dir)
    state = read_state(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    return rows, state, cfg


def lineage(run_dir: Path) -> list[dict]:
    """harnesses/summary.jsonl: one row per evaluated (candidate, weights version)."""
    return read_jsonl_rows(run_dir / "harnesses" / "summary.jsonl")


def run_figures(run_dir: Path, rows: list[dict], name: str) -> dict[str, Figure]:
    """The run's figures by file stem (report.md's PNGs, report.html's inline SVGs)."""
    ledger = read_jsonl_rows(run_dir / "ledger.jsonl")
    accepted = [r["accepted"] for r in rows if r.get("event") == "harness_accepted"]
    figs = {f"accuracy_vs_{axis}": plots.curve_figure(rows, plots.phase_spans(ledger, rows, axis), axis,
                                                       f"{name}: accuracy vs {axis}")
            for axis in ("rollouts", "tokens")}
    for stem, fig in (("accept_rate", plots.weight_steps_figure(rows)),
                      ("lineage", plots.lineage_figure(lineage(run_dir), accepted))):
        if fig is not None:
            figs[stem] = fig
    parts, totals = attribution(rows, ["test", "val"])
    fig = plots.attribution_figure(parts, totals, f"{name}: gain by phase")
    if fig is not None:
        figs["phase_gains"] = fig
    return figs


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


def attribution(rows: list[dict], splits: list[str]) -> tuple[dict[str, list[dict]], dict[str, tuple]]:
    """Phase attribution per split (those with two evaluations or more) and each split's start -> end gain."""
    parts = {split: phase_attribution(rows, split) for split in splits}
    parts = {k: v for k, v in parts.items() if v}
    totals: dict[str, tuple] = {}
    for split in parts:
        evals = [r for r in rows if r.get("event") == "eval" and r.get("split") == split and r.get("per_problem")]
        if len(evals) >= 2:
            totals[split] = paired_bootstrap([evals[-1]["per_problem"]], [evals[0]["per_problem"]])
    return parts, totals


def _attribution_lines(rows: list[dict], parts: dict[str, list[dict]], totals: dict[str, tuple]) -> list[str]:
    if not parts:
        return []
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
    for split, (point, lo, hi) in totals.items():
        evals = [r for r in rows if r.get("event") == "eval" and r.get("split") == split and r.get("per_problem")]
        lines += ["", f"**{split}, start → end: {evals[0]['mean_at_k']:.3f} → {evals[-1]['mean_at_k']:.3f}, "
                  f"gain {point:+.3f}, paired 95% CI [{lo:+.3f}, {hi:+.3f}]** "
                  f"({evals[-1].get('n')} problems × k={evals[-1].get('k')})."]
    return lines + ["", "![gain by phase](phase_gains.png)", ""]


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


def report_sections(run_dir: Path, rows: list[dict], state: RunState | None, cfg: dict) -> dict[str, list[str]]:
    """report.md, section by section (markdown lines); report.html renders the same sections."""
    name = cfg.get("name", run_dir.name)
    s = load_summary(run_dir)
    led = state.ledger if state else {}
    sched = cfg.get("schedule", {})
    dom = cfg.get("domain", {})
    prov = provenance_line(search_provenance(cfg, rows))
    sections: dict[str, list[str]] = {}
    sections["summary"] = [
        f"# WHALE run report: {name}", "",
        f"- domain: **{dom.get('module') or dom.get('name')}**, model: `{cfg.get('model', {}).get('name')}`, "
        f"schedule: **{sched.get('kind')}**{' (adaptive)' if sched.get('adaptive') else ''}, seed {cfg.get('seed')}, "
        f"grader: **{dom.get('grader')}**",
        *([f"- harness search: {prov}"] if prov else []),
        f"- status: {state.phase if state else None}, wall time {state.elapsed_s if state else 0:.0f} s" + (
            "" if state and state.finished else f" (**unfinished**: 'final' below is its latest evaluation; "
            f"`whale run --resume {run_dir}` continues it)"),
        *[f"- engine server recovered in {r['unit']}: {r['reason']}{'' if r.get('ok') else ' (failed)'}"
          for r in rows if r.get("event") == "engine_recovered"], "",
        "## Test mean@k", "", "| initial | final | best (paper's, selected on test) | val-selected (honest) |",
        "|---|---|---|---|", f"| {fmt(s['initial'])} | {fmt(s['final'])} | {fmt(s['best'])} | {fmt(s['val_selected'])} |", ""]
    lines = ["## Where the rollouts went", "", "| purpose | rollouts | counts toward budget |", "|---|---|---|"]
    for purpose, n in sorted(led.get("rollouts", {}).items()):
        lines.append(f"| {purpose} | {n} | {'yes' if purpose in BUDGET_PURPOSES else 'recorded only'} |")
    sections["ledger"] = lines + [
        "", f"LLM calls {led.get('llm_calls', 0)}, tokens {led.get('tokens', 0)} "
        f"(prompt {led.get('prompt_tokens', 0)}, generated {led.get('completion_tokens', 0)}), "
        f"proposer time {led.get('proposer_seconds', 0)} s.", "", *_proposer_lines(rows, led)]
    sections["curves"] = ["![accuracy vs rollouts](accuracy_vs_rollouts.png)", "",
                          "![accuracy vs tokens](accuracy_vs_tokens.png)", ""]
    sections["phases"] = _attribution_lines(rows, *attribution(rows, ["test", "val"]))
    sections["evaluations"] = _evaluation_lines(rows)
    sections["weights"] = _weight_lines(rows)
    sections["harness"] = _harness_lines(rows)
    sections["matrix"] = _matrix_section(run_dir)
    return sections


def _evaluation_lines(rows: list[dict]) -> list[str]:
    evals = [r for r in rows if r.get("event") == "eval"]
    if not evals:
        return []
    lines = ["## Evaluations", "", "| unit | split | harness | weights | mean@k | 95% CI | pass@k | budget rollouts |",
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
    return lines + [""]


def _weight_lines(rows: list[dict]) -> list[str]:
    steps = [r for r in rows if r.get("event") == "weight_step"]
    if not steps:
        return []
    lines = ["## Weight phase", "", "| step | harness | accept rate | rows | trained tokens | loss | gen s | train s | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in steps:
        loss = "-" if r.get("loss") is None else f"{r['loss']:.4f}"
        lines.append(f"| {r['step']} | {r.get('harness')} | {r['accept_rate']:.3f} | {r['rows']} | {r['trained_tokens']} | "
                     f"{loss} | {r['gen_seconds']:.0f} | {r['train_seconds']:.0f} | {r['reason']} |")
    return lines + ["", "![accept rate](accept_rate.png)", ""]


def _harness_lines(rows: list[dict]) -> list[str]:
    accepted = [r["accepted"] for r in rows if r.get("event") == "harness_accepted"]
    harness_rows = [r for r in rows if r.get("event") in ("candidate", "rescore", "invalid", "duplicate", "proposer_error",
                                                          "confirm", "confirm_stopped", "null_probe")]
    if not harness_rows and not accepted:
        return []
    lines = ["## Harness phase", "", f"Accepted harnesses, phase by phase: {' -> '.join(['h0'] + accepted)}", "",
             "| unit | event | candidate | weights | success | note |", "|---|---|---|---|---|---|"]
    for r in harness_rows:
        sr = r.get("success_rate")
        note = event_note(r)
        if r["event"] == "confirm":
            sr = r.get("mean_a")
        elif r["event"] == "null_probe":
            sr = r.get("real")
        lines.append(f"| {r['unit']} | {r['event']} | {r.get('id', '')} | {r.get('weights_version')} | "
                     f"{'' if sr is None else f'{sr:.3f}'} | {note[:120]} |")
    return lines + ["", "![lineage](lineage.png)", ""]


def _proposer_lines(rows: list[dict], led: dict) -> list[str]:
    """What proposing cost, per harness phase (cycle) and for the run: rounds, failed rounds,
    tokens, USD (as the agent reports it; Codex reports no USD) and seconds. Not in the
    rollout counts above: the proposer's compute is spending of its own."""
    rounds = [r for r in rows if r.get("event") in ("proposer_usage", "proposer_failure")]
    if not rounds:
        return []
    lines = ["## What proposing cost", "", "| harness phase (cycle) | rounds | failed | tokens | USD | seconds |",
             "|---|---|---|---|---|---|"]
    for cycle in dict.fromkeys(r.get("cycle") for r in rounds):
        mine = [r for r in rounds if r.get("cycle") == cycle]
        usage = [r.get("usage") or {} for r in mine]
        lines.append(f"| {cycle} | {len(mine)} | {sum(r['event'] == 'proposer_failure' for r in mine)} | "
                     f"{sum(int(u.get('tokens', 0)) for u in usage)} | {sum(u.get('cost_usd', 0.0) for u in usage):.4f} | "
                     f"{sum(u.get('seconds', 0.0) for u in usage):.1f} |")
    lines += [f"| run | {len(rounds)} | {sum(r['event'] == 'proposer_failure' for r in rounds)} | "
              f"{led.get('proposer_tokens', 0)} | {led.get('proposer_cost_usd', 0.0):.4f} | "
              f"{led.get('proposer_seconds', 0)} |", ""]
    lines += [f"- {r['reason']}" for r in rows if r.get("event") in ("proposer_budget", "proposer_exhausted", "proposer_stopped")]
    return lines + ([""] if lines[-1] else [])


def write_report(run_dir: str | Path) -> Path:
    """report/report.md with its PNG plots, and report/report.html (one self-contained page)."""
    run_dir = Path(run_dir)
    rows, state, cfg = load_run(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    figs = run_figures(run_dir, rows, cfg.get("name", run_dir.name))
    sections = report_sections(run_dir, rows, state, cfg)
    lines = []
    for section in sections.values():  # a figure that was not drawn has no image line
        lines += [line for line in section if not line.startswith("![") or line.split("](")[1][:-5] in figs
                  or "matrix.png" in line]
    for stem, fig in figs.items():
        plots.save_png(fig, out / f"{stem}.png")
    (out / "report.md").write_text("\n".join(lines))
    try:
        write_html(run_dir, rows, state, cfg, sections, figs)
    finally:
        for fig in figs.values():
            plots.close(fig)
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
