"""A run's figures, drawn once and written twice: PNG next to report.md, inline SVG in report.html.

Every curve carries the interval its rows hold (an evaluation's bootstrap 95% CI, a weight step's
Wilson interval on its accept rate, a phase's paired bootstrap CI). Phases are shaded from the
rollout ledger (ledger.jsonl), batch by batch: a harness phase spans its re-scoring, candidates,
confirmation re-runs and null probes, not only the rows its iterations logged.
"""

from __future__ import annotations

import io
import re
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from whale.store import BUDGET_PURPOSES  # noqa: E402

PHASE_COLORS = {"weight": "#dbe9f6", "harness": "#f6e3db"}
PHASE_COLORS_STRONG = {"W": "#4c8ed1", "H": "#d8774f"}
# Ledger purposes spent inside a harness phase (smoke: candidate validation; null_probe: the
# reward-hacking probe); both recorded only, so they move the token axis, not the budget one.
HARNESS_PURPOSES = ("harness", "rescore", "confirm", "null_probe", "smoke")
MIN_LABEL_GAP = 0.025  # of the x extent between two labelled weights versions (closer ones: line only)


def x_value(row: dict, axis: str) -> float:
    led = row.get("ledger", {})
    return led.get("budget_rollouts", 0) if axis == "rollouts" else led.get("tokens", 0)


def phase_spans(ledger: list[dict[str, Any]], rows: list[dict], axis: str) -> list[tuple[str, str, float, float]]:
    """(phase, label, start, end) of each phase on `axis` (budget rollouts or tokens), W1, H1, W2, ...

    Read from the ledger's batches in the order they were counted: a weight step's batch belongs
    to the weight phase, a search batch (keyed `c<cycle>:...`) to the harness phase of its cycle,
    so two harness phases in a row stay apart. Runs from before ledger.jsonl fall back on the
    `phase` their metrics rows were logged in."""
    if not ledger:
        return _spans_from_rows(rows, axis)
    spans: list[list[Any]] = []
    x = 0.0
    for e in ledger:
        if "purpose" not in e:
            continue  # proposer time and tokens: not rollouts
        before = x
        x += (e["rollouts"] if e["purpose"] in BUDGET_PURPOSES else 0) if axis == "rollouts" else \
            e.get("prompt_tokens", 0) + e.get("completion_tokens", 0)
        purpose = e.get("of", e["purpose"])  # a batch redone after a kill still belongs to its phase
        phase = "weight" if purpose == "weight" else "harness" if purpose in HARNESS_PURPOSES else None
        if phase is None:
            continue
        ident = (phase, e["key"].split(":")[0] if phase == "harness" else "")
        if spans and spans[-1][0] == ident:
            spans[-1][2] = x
        else:
            spans.append([ident, before, x])
    return _labelled([(ident[0], a, b) for ident, a, b in spans])


def _spans_from_rows(rows: list[dict], axis: str) -> list[tuple[str, str, float, float]]:
    spans: list[list[Any]] = []
    prev = 0.0
    for r in rows:
        x = x_value(r, axis)
        phase = r.get("phase") if r.get("event") not in ("eval", "eval_selected", "run_end") else None
        if phase in PHASE_COLORS:
            if spans and spans[-1][0] == phase:
                spans[-1][2] = x
            else:
                spans.append([phase, prev, x])
        prev = x
    return _labelled([tuple(s) for s in spans])


def _labelled(spans: list[tuple[str, float, float]]) -> list[tuple[str, str, float, float]]:
    counts = {"weight": 0, "harness": 0}
    out = []
    for phase, a, b in spans:
        counts[phase] += 1
        out.append((phase, f"{phase[0].upper()}{counts[phase]}", a, b))
    return out


def curve_figure(rows: list[dict], spans: list[tuple[str, str, float, float]], axis: str, title: str) -> Figure:
    """mean@k per split with its 95% CI (band and bars), phases shaded and labelled, each new weights
    version a dotted line, each accepted harness a solid one."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for phase, label, a, b in spans:
        ax.axvspan(a, b, color=PHASE_COLORS[phase], lw=0)
        ax.text((a + b) / 2, 0.99, label, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7,
                color="#555555")
    for split, style in (("test", "o-"), ("val", "s--")):
        evals = [r for r in rows if r.get("event") == "eval" and r.get("split") == split]
        if not evals:
            continue
        xs, ys = [x_value(r, axis) for r in evals], [r["mean_at_k"] for r in evals]
        (line,) = ax.plot(xs, ys, style, ms=4, label=f"{split} mean@k (95% CI)")
        cis = [r.get("ci95") for r in evals]
        if all(cis):
            ax.fill_between(xs, [c[0] for c in cis], [c[1] for c in cis], color=line.get_color(), alpha=0.07, lw=0)
            ax.errorbar(xs, ys, yerr=[[max(0.0, y - c[0]) for y, c in zip(ys, cis)],
                                      [max(0.0, c[1] - y) for y, c in zip(ys, cis)]],
                        fmt="none", ecolor=line.get_color(), capsize=2, lw=0.8)
    versions = [r for r in rows if r.get("event") == "weight_step" and r.get("weights_version")]
    extent = max((x_value(r, axis) for r in rows), default=0) or 1
    labelled_at = float("-inf")
    for r in versions:
        x = x_value(r, axis)
        ax.axvline(x, color=PHASE_COLORS_STRONG["W"], lw=0.6, ls=":")
        if x - labelled_at >= MIN_LABEL_GAP * extent:  # labels that would overlap are left out
            labelled_at = x
            ax.text(x, 0.02, r["weights_version"], rotation=90, fontsize=6, color=PHASE_COLORS_STRONG["W"],
                    transform=ax.get_xaxis_transform(), ha="right", va="bottom")
    for r in rows:
        if r.get("event") == "harness_accepted":
            x = x_value(r, axis)
            ax.axvline(x, color=PHASE_COLORS_STRONG["H"], lw=1.2)
            ax.text(x, 0.9, f" {r.get('accepted')}", transform=ax.get_xaxis_transform(), fontsize=7,
                    color=PHASE_COLORS_STRONG["H"], fontweight="bold")
    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color=c, label=f"{p} phase") for p, c in PHASE_COLORS.items()]
    handles += [Line2D([], [], color=PHASE_COLORS_STRONG["W"], lw=0.6, ls=":", label="new weights version"),
                Line2D([], [], color=PHASE_COLORS_STRONG["H"], lw=1.2, label="harness accepted")]
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_xlabel("cumulative budget rollouts (weight + harness search)" if axis == "rollouts" else "cumulative tokens")
    ax.set_ylabel("mean@k")
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion: sound at 0 and 1, where accept rates often sit."""
    if n <= 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def weight_steps_figure(rows: list[dict]) -> Figure | None:
    """Accept rate (Wilson 95% CI over the step's rollouts), training loss and rows, per weight step."""
    steps = [r for r in rows if r.get("event") == "weight_step"]
    if not steps:
        return None
    xs = [r["step"] for r in steps]
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.8))
    rates = [r["accept_rate"] for r in steps]
    cis = [wilson(r.get("accepted", round(r["accept_rate"] * r.get("rollouts", 0))), r.get("rollouts", 0))
           if r.get("rollouts") else (rate, rate) for r, rate in zip(steps, rates)]
    axes[0].errorbar(xs, rates, yerr=[[max(0.0, a - c[0]) for a, c in zip(rates, cis)],
                                      [max(0.0, c[1] - a) for a, c in zip(rates, cis)]], fmt="o-", ms=3, capsize=2)
    axes[0].set_ylabel("accept rate (95% CI)")
    loss = [(x, r["loss"]) for x, r in zip(xs, steps) if r.get("loss") is not None]
    if loss:
        axes[1].plot(*zip(*loss), "o-", ms=3, color="C1")
    axes[1].set_ylabel("training loss")
    axes[2].bar(xs, [r.get("rows", 0) for r in steps], color="C2")
    axes[2].set_ylabel("training rows")
    for ax in axes:
        ax.set_xlabel("weight step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def lineage_figure(summary: list[dict], accepted: list[str]) -> Figure | None:
    """Each evaluated candidate by id (one point per weights version it was scored under), its
    success rate on the harness split, an edge to its parent, and its mechanism in the label."""
    if not summary:
        return None

    def num(cid: str) -> int:
        return int(cid.lstrip("h")) if cid.lstrip("h").isdigit() else -1

    fig, ax = plt.subplots(figsize=(8, 4.2))
    versions = list(dict.fromkeys(r.get("weights_version") for r in summary))
    pos = {(r["id"], r.get("weights_version")): (num(r["id"]), r.get("success_rate", 0.0)) for r in summary}
    for r in summary:
        parent = r.get("parent")
        if parent and (parent, r.get("weights_version")) in pos:
            (px, py), (x, y) = pos[(parent, r.get("weights_version"))], pos[(r["id"], r.get("weights_version"))]
            ax.plot([px, x], [py, y], color="#bbbbbb", lw=0.8, zorder=1)
    for i, ver in enumerate(versions):
        pts = [r for r in summary if r.get("weights_version") == ver]
        ax.scatter([num(r["id"]) for r in pts], [r.get("success_rate", 0.0) for r in pts], s=22, color=f"C{i}",
                   label=f"weights {ver}", zorder=2)
    labelled = set()
    for r in summary:
        if r["id"] in labelled:
            continue
        labelled.add(r["id"])
        mech = (r.get("mechanism") or r.get("hypothesis") or ("start" if not r.get("parent") else "")).strip()
        mech = mech.splitlines()[0][:32] if mech else ""
        bold = r["id"] in accepted
        ax.annotate(f"{r['id']}{' ✓' if bold else ''}" + (f": {mech}" if mech else ""),
                    pos[(r["id"], r.get("weights_version"))],
                    fontsize=6.5, xytext=(3, 3), textcoords="offset points", rotation=20,
                    fontweight="bold" if bold else "normal")
    ids = sorted({num(r["id"]) for r in summary})
    if len(ids) <= 30:
        ax.set_xticks(ids, [f"h{i}" for i in ids], fontsize=7)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("candidate (✓ accepted; edges: parent → child under the same weights)")
    ax.set_ylabel("success rate on the harness split")
    ax.set_ylim(-0.05, 1.1)
    ax.margins(x=0.08)
    ax.legend(fontsize=7)
    ax.set_title("harness lineage", fontsize=10)
    fig.tight_layout()
    return fig


def attribution_figure(parts: dict[str, list[dict]], totals: dict[str, tuple], title: str) -> Figure | None:
    """Bars: the gain of each phase on the split evaluated most often, then start -> end per split."""
    if not parts:
        return None
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
    ax.set_title(title + " (paired 95% CI)", fontsize=10)
    fig.tight_layout()
    return fig


def compare_figure(by_method: dict[str, list[dict]], axis: str) -> Figure:
    """Test mean@k of every run, coloured by method, each with its evaluations' 95% CI band."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for ci, (method, runs) in enumerate(by_method.items()):
        for j, run in enumerate(runs):
            evals = [x for x in run["rows"] if x.get("event") == "eval" and x.get("split") == "test"]
            if not evals:
                continue
            xs, ys = [x_value(x, axis) for x in evals], [x["mean_at_k"] for x in evals]
            ax.plot(xs, ys, "o-", color=f"C{ci}", alpha=0.8, ms=3, label=method if j == 0 else None)
            if all(x.get("ci95") for x in evals):
                ax.fill_between(xs, [x["ci95"][0] for x in evals], [x["ci95"][1] for x in evals], color=f"C{ci}",
                                alpha=0.06, lw=0)
    ax.set_xlabel("cumulative budget rollouts" if axis == "rollouts" else "cumulative tokens")
    ax.set_ylabel("test mean@k (bands: 95% CI per run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def save_png(fig: Figure, path) -> None:
    fig.savefig(path, dpi=120)


def to_svg(fig: Figure) -> str:
    """The figure as an inline <svg> element; text stays text (smaller, selectable, found by tests)."""
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "whale"}):
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text[text.index("<svg"):], flags=re.S)


def close(fig: Figure | None) -> None:
    if fig is not None:
        plt.close(fig)
