"""Several runs side by side: `compare_runs(dirs)` writes compare.md, overlay plots and compare.html
(the same tables and the curves with their intervals on one self-contained page).

The paper-style table (best / final / val-selected mean@k, rollouts, wall time) with seeds
aggregated per method; paired bootstrap differences against reference methods (seeds x problems,
both paired); what each side bought per phase; the budget rollouts each method needed to reach a
reference's best; per-seed rows; per-source final accuracy.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from whale import plots
from whale.config import ConfigError
from whale.report import fmt, load_run, paired_bootstrap, phase_attribution, search_provenance, x_value
from whale.report_html import write_compare_html
from whale.store import load_summary


def _method(cfg: dict) -> str:
    """The schedule, plus the harness search's proposer when it is not the offline one and
    "+hints-off" when the domain's hints were off: runs that differ in those are other methods,
    never pooled."""
    s = cfg.get("schedule", {})
    kind = s.get("kind", "?")
    name = kind + ("+adaptive" if s.get("adaptive") else "")
    if kind != "weight_only":
        h = cfg.get("harness", {})
        name += f"+{h['proposer']}" if h.get("proposer", "mutation") != "mutation" else ""
        name += "" if h.get("domain_hints", True) else "+hints-off"
    return name


def _reference(name: str, methods: list[str]) -> str:
    """The method a `--ref` names. Run names spell the adaptive schedule `whale_adaptive`
    (scripts/compare.py), tables `whale+adaptive`; both are accepted. A name that matches no run
    is an error: a silently missing table reads as "no difference computed" when it was a typo."""
    for candidate in (name, name.replace("_adaptive", "+adaptive")):
        if candidate in methods:
            return candidate
    raise ConfigError(f"--ref {name!r} names no method of these runs (methods: {', '.join(methods)})")


def _final_test_per_problem(rows: list[dict]) -> list[float] | None:
    test = [r for r in rows if r.get("event") == "eval" and r.get("split") == "test" and r.get("per_problem")]
    return test[-1]["per_problem"] if test else None


def compare_runs(run_dirs: list[str | Path], out: str | Path = "compare", references: list[str] | None = None,
                 partial: bool = False) -> Path:
    """`references`: methods to difference every other method against (default: the first one).

    An unfinished run (killed, or still running) is left out unless `partial`: its last test
    evaluation is not its final one, and mixed into means and paired differences it would read as
    the method's result. Either way compare.md names it; with `partial` its cells say so."""
    if not run_dirs:
        raise ConfigError("compare needs at least one run directory")
    out = Path(out)
    by_method: dict[str, list[dict]] = defaultdict(list)
    unfinished = []
    for d in map(Path, run_dirs):
        rows, state, cfg = load_run(d)
        finished = state is not None and state.finished
        if not finished:
            unfinished.append(d)
            if not partial:
                continue
        s = load_summary(d)
        by_method[_method(cfg)].append({"dir": d, "rows": rows, "summary": s, "cfg": cfg,
                                        "per_problem": _final_test_per_problem(rows),
                                        "finished": finished})
    if not by_method:
        raise ConfigError(f"none of the {len(unfinished)} runs has finished ({', '.join(map(str, unfinished))}); "
                          "--partial compares them as they stand")
    out.mkdir(parents=True, exist_ok=True)
    methods = list(by_method)
    references = [_reference(r, methods) for r in references or methods[:1]]
    lines = ["# Comparison", "", "Test mean@k; mean ± sd over seeds (n = runs). Initial: the first evaluation "
             "(incoming harness, base weights). Budget rollouts = weight + harness search.", ""]
    if unfinished:
        how = ("included as they stand: their \"final\" is their latest evaluation, marked (unfinished)"
               if partial else "left out (whale compare --partial includes them)")
        lines += [f"**Unfinished runs, {how}:** " + ", ".join(f"`{d.name}`" for d in unfinished), ""]
    lines += ["| method | runs | initial | best (test-selected) | final | val-selected | budget rollouts | all rollouts "
              "| wall time s |", "|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        runs = by_method[m]
        cells = [_mean_sd([r["summary"].get(key) for r in runs]) for key in ("initial", "best", "final", "val_selected")]
        budget = _mean_sd([r["summary"]["ledger"].get("budget_rollouts") for r in runs], digits=0)
        total = _mean_sd([sum(r["summary"]["ledger"].get("rollouts", {}).values()) for r in runs], digits=0)
        secs = _mean_sd([r["summary"].get("seconds") for r in runs], digits=0)
        lines.append(f"| {m} | {len(runs)} | {' | '.join(cells)} | {budget} | {total} | {secs} |")
    lines += _per_seed_table(by_method)
    for ref in references:
        lines += _difference_table(by_method, ref)
    lines += _phase_sums_table(by_method)
    if "weight_only" in by_method:
        lines += _reach_table(by_method, "weight_only")
    # per-source breakdown of the final test evaluation
    lines += ["", "Per data source (final test evaluation, mean over runs):", ""]
    sources = sorted({s for m in methods for r in by_method[m] for s in _last_sources(r["rows"])})
    if sources:
        lines += ["| method | " + " | ".join(sources) + " |", "|---|" + "---|" * len(sources)]
        for m in methods:
            vals = []
            for src in sources:
                xs = [_last_sources(r["rows"]).get(src) for r in by_method[m]]
                vals.append(_mean_sd(xs))
            lines.append(f"| {m} | " + " | ".join(vals) + " |")
    figs = {f"compare_{axis}": plots.compare_figure(by_method, axis) for axis in ("rollouts", "tokens")}
    lines += ["", "![test mean@k vs rollouts](compare_rollouts.png)", "", "![test mean@k vs tokens](compare_tokens.png)", ""]
    (out / "compare.md").write_text("\n".join(lines))
    try:
        for stem, fig in figs.items():
            plots.save_png(fig, out / f"{stem}.png")
        write_compare_html(out, lines, figs, [str(r["dir"]) for runs in by_method.values() for r in runs])
    finally:
        for fig in figs.values():
            plots.close(fig)
    return out / "compare.md"


def _difference_table(by_method: dict[str, list[dict]], ref: str) -> list[str]:
    ref_by_seed = {r["cfg"].get("seed"): r["per_problem"] for r in by_method[ref] if r["per_problem"]}
    if len(by_method) < 2 or not ref_by_seed:
        return []
    lines = ["", f"Final test mean@k difference against **{ref}**, paired bootstrap over seeds and problems "
             "(same seed = same splits; 95%):", "", "| method | seeds | difference | 95% CI |", "|---|---|---|---|"]
    for m in by_method:
        if m == ref:
            continue
        mine = {r["cfg"].get("seed"): r["per_problem"] for r in by_method[m] if r["per_problem"]}
        common = sorted(set(mine) & set(ref_by_seed))
        if common:
            d, lo, hi = paired_bootstrap([mine[s] for s in common], [ref_by_seed[s] for s in common])
            lines.append(f"| {m} | {len(common)} | {d:+.3f} | [{lo:+.3f}, {hi:+.3f}] |")
    return lines


def _phase_sums_table(by_method: dict[str, list[dict]], split: str = "val") -> list[str]:
    """What each side bought, summed over a run's phases (phase attribution on `split`), mean over seeds."""
    def sums(rows):
        weight, harness, mixed = 0.0, [], 0.0
        for p in phase_attribution(rows, split):
            kinds = {label[0] for label in p["phases"].split("+")}
            if kinds == {"W"}:
                weight += p["gain"]
            elif kinds == {"H"}:
                harness.append(p["gain"])
            else:
                mixed += p["gain"]
        return {"W": weight, "H": sum(harness), "H1": harness[0] if harness else None,
                "Hlater": sum(harness[1:]) if len(harness) > 1 else None, "mixed": mixed}

    table = {m: [sums(r["rows"]) for r in runs] for m, runs in by_method.items()}
    if not any(phase_attribution(r["rows"], split) for runs in by_method.values() for r in runs):
        return []
    lines = ["", f"What each side bought ({split} mean@k gains attributed to phases, summed per run; mean ± sd over "
             "seeds). H1 = the first harness phase (after the first weight phase, or under the base weights for "
             "harness-only), later H = every harness phase after more weight updates:", "",
             "| method | weight phases | harness phases | H1 | later H | mixed intervals |", "|---|---|---|---|---|---|"]
    for m, rows in table.items():
        lines.append(f"| {m} | " + " | ".join(_mean_sd([r[k] for r in rows]) for k in ("W", "H", "H1", "Hlater", "mixed"))
                     + " |")
    return lines


def _reach_table(by_method: dict[str, list[dict]], ref: str, split: str = "val") -> list[str]:
    """Budget rollouts each method needed to first reach `ref`'s best `split` mean@k (same seed)."""
    def curve(rows):
        return [(x_value(r, "rollouts"), r["mean_at_k"]) for r in rows if r.get("event") == "eval" and r.get("split") == split]

    target = {r["cfg"].get("seed"): max((y for _, y in curve(r["rows"])), default=None) for r in by_method[ref]}
    lines = ["", f"Budget rollouts to first reach **{ref}**'s best {split} mean@k of the same seed (its own curve: "
             f"evaluations at phase ends and every eval.every_steps):", "",
             "| method | reached (seeds) | budget rollouts (mean ± sd over the seeds that reached it) |", "|---|---|---|"]
    for m, runs in by_method.items():
        hits = []
        for r in runs:
            goal = target.get(r["cfg"].get("seed"))
            if goal is not None and goal > 0:
                xs = [x for x, y in curve(r["rows"]) if y >= goal - 1e-9]
                hits.append(xs[0] if xs else None)
        reached = [h for h in hits if h is not None]
        lines.append(f"| {m} | {len(reached)}/{len(hits)} | {_mean_sd(reached, digits=0)} |")
    nothing = sorted(str(seed) for seed, goal in target.items() if goal is not None and goal <= 0)
    if nothing:  # a best of 0 is reached by every run at its start: not a target
        lines += ["", f"Left out: seed {', '.join(nothing)}, where {ref}'s best {split} mean@k is 0 "
                      f"(it never scored on {split})."]
    return lines


def _per_seed_table(by_method: dict[str, list[dict]]) -> list[str]:
    """Each run on its own: test mean@k at the start and the end, and the (harness, weights) it ended with."""
    seeds = sorted({r["cfg"].get("seed") for runs in by_method.values() for r in runs}, key=str)
    lines = ["", "Per seed: test mean@k initial → final (final harness, weights):", "",
             "| method | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for m, runs in by_method.items():
        cells = []
        for seed in seeds:
            mine = [r for r in runs if r["cfg"].get("seed") == seed]
            cells.append("; ".join(f"{fmt(r['summary'].get('initial'))} → {fmt(r['summary'].get('final'))} "
                                   f"({r['summary'].get('harness_id') or '?'}, {r['summary'].get('weights_version') or '?'})"
                                   + ("" if r["finished"] else " (unfinished)") for r in mine) or "-")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    provenance = [(m, r, search_provenance(r["cfg"], r["rows"])) for m, runs in by_method.items() for r in runs]
    provenance = [(m, r, p) for m, r, p in provenance if p]
    if provenance:
        lines += ["", "Harness search, run by run (\"hint: \" marks a domain's own hints):", "",
                  "| method | seed | proposer | domain hints | accepted mechanisms |", "|---|---|---|---|---|"]
        for m, r, p in provenance:
            lines.append(f"| {m} | {r['cfg'].get('seed')} | {p['proposer']} | {p['hints']} | "
                         f"{'; '.join(p['accepted']) or 'none'} |")
    return lines


def _last_sources(rows: list[dict]) -> dict[str, float]:
    test = [r for r in rows if r.get("event") == "eval" and r.get("split") == "test"]
    return {k: v["mean_at_k"] for k, v in (test[-1].get("per_source") or {}).items()} if test else {}


def _mean_sd(values: list[Any], digits: int = 3) -> str:
    """Mean ± sd of the runs that have a value; "(n of N runs)" when some have none (e.g. a run whose
    val-best checkpoint has no test evaluation), so a mean over fewer runs is not read as all of them."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    text = f"{m:.{digits}f}"
    if len(xs) > 1:
        sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
        text += f" ± {sd:.{digits}f}"
    return text if len(xs) == len(values) else f"{text} ({len(xs)} of {len(values)} runs)"
