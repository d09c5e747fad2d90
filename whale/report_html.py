"""report/report.html: one self-contained page per run, to read what each phase changed.

The page holds report.md's sections (rendered from the same markdown) and what a page can show
better: the figures as inline SVG, the harness lineage as a tree (each candidate's mechanism or
hypothesis, its scores under each weights version, why it was accepted or not, its diff against
its parent) and traces to open: for every candidate and evaluation, a sample of failed and solved
episodes with every model call, tool call, the submission and the grade, read from the same files
the proposer reads (harnesses/<id>/traces.jsonl) and from evals/<unit>.jsonl.

No server and no network: no scripts, no external links; it opens from disk and from a CI artifact.
It stays small by sampling episodes (`EPISODES_PER_GROUP` failed and as many solved per candidate
and weights version, and per evaluation) and clipping long texts (`CLIP_CHARS`).
"""

from __future__ import annotations

import base64
import difflib
import json
import os
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from markdown_it import MarkdownIt
from markupsafe import Markup

from whale import plots
from whale.harness.archive import Archive, ArchiveIntegrityError, id_number
from whale.run_state import RunState
from whale.store import read_jsonl_rows

EPISODES_PER_GROUP = 2
CLIP_CHARS = 3000
SECTION_TITLES = {"summary": "Summary", "curves": "Accuracy against rollouts and tokens",
                  "phases": "Which phase bought how much", "lineage": "Harness lineage",
                  "evaluations": "Evaluations and their traces", "weights": "Weight steps",
                  "ledger": "Ledger and proposer cost", "matrix": "Harness × weights matrix"}

_MD = MarkdownIt("commonmark", {"html": False}).enable("table")


def environment() -> Environment:
    env = Environment(loader=PackageLoader("whale", "templates"), autoescape=select_autoescape(["html", "j2"]),
                      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.do"])
    env.filters["clip"] = clip
    env.filters["text"] = as_text
    return env


def clip(value: Any, limit: int = CLIP_CHARS) -> str:
    text = as_text(value)
    cut = len(text) - limit
    return text if cut <= 0 else text[:limit] + f"\n… ({cut} more characters in the run directory)"


def as_text(value: Any) -> str:
    """Message content, tool arguments and results as text (content may be a list of parts)."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, indent=1, default=str)


def markdown(lines: list[str]) -> Markup:
    """report.md's lines as HTML, without its image lines (the page inlines the figures instead)."""
    return Markup(_MD.render("\n".join(line for line in lines if not line.startswith("!["))))


def _without_title(key: str, lines: list[str]) -> list[str]:
    """A section's markdown without its title: the page gives each section its own heading."""
    title = next((i for i, line in enumerate(lines) if line.startswith("# " if key == "summary" else "## ")), None)
    return lines if title is None else lines[:title] + lines[title + 1:]


# ---------------------------------------------------------------------------------- text (report.md too)
def fmt_p(p: Any) -> str:
    """A p-value as text. Older records rounded p to 4 decimals, so a 0 there means below 0.00005;
    a sign-flip p-value is never exactly 0."""
    if not isinstance(p, (int, float)):
        return "p = ?"
    return "p < 0.0001" if p < 1e-4 else f"p = {p:.3g}"


def event_note(r: dict) -> str:
    """One line on a harness-phase row: a confirmation's paired test, a null probe's, or its reason."""
    if r["event"] == "confirm":
        rounds = f" (round {r['round']}/{r['rounds']}, pooled)" if r.get("rounds") else ""
        return (f"fresh seeds{rounds}: {r.get('mean_a', 0):.3f} vs incoming {r.get('mean_b', 0):.3f}, paired gain "
                f"{r.get('gain', 0):+.3f}, {fmt_p(r.get('p'))} ({'passes' if r.get('passes') else 'not shown'} at "
                f"{r.get('level')})")
    if r["event"] == "null_probe":
        return f"null engine {r.get('null', 0):.3f}, {fmt_p(r.get('p'))}{', FLAGGED' if r.get('flagged') else ''}"
    return str(r.get("reason", r.get("mechanism", "")))


# ---------------------------------------------------------------------------------- traces
def episode_view(row: dict[str, Any]) -> dict[str, Any]:
    """An episode as the page shows it: model calls and tool calls in the order they happened."""
    steps: list[dict[str, Any]] = []
    tools = list(row.get("tool_calls") or [])
    for i, call in enumerate(row.get("calls") or []):
        steps += [{"kind": "tool", **t} for t in tools if t.get("after_calls") == i]
        steps.append({"kind": "model", "index": i, **call})
    done = {id(t) for t in tools if t.get("after_calls") is not None and t["after_calls"] < len(row.get("calls") or [])}
    steps += [{"kind": "tool", **t} for t in tools if id(t) not in done]
    return {**row, "steps": steps, "solved": float(row.get("reward") or 0.0) >= 1.0}


def sample_episodes(rows: list[dict[str, Any]], n: int = EPISODES_PER_GROUP) -> list[dict[str, Any]]:
    """Up to `n` failed and `n` solved episodes, each from a different problem where possible."""
    out = []
    for solved in (False, True):
        group = [r for r in rows if (float(r.get("reward") or 0.0) >= 1.0) == solved]
        first_of_problem = list({r.get("problem_id"): i for i, r in reversed(list(enumerate(group)))}.values())
        picked = sorted(first_of_problem)[:n]
        picked += [i for i in range(len(group)) if i not in picked][: n - len(picked)]
        out += [episode_view(group[i]) for i in picked]
    return out


def eval_traces(run_dir: Path, rows: list[dict]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r.get("event") != "eval":
            continue
        episodes = read_jsonl_rows(run_dir / "evals" / f"{r['unit']}.jsonl")
        out.append({"unit": r["unit"], "split": r.get("split"), "harness": r.get("harness"),
                    "weights": r.get("weights_version"), "mean_at_k": r.get("mean_at_k"), "ci95": r.get("ci95"),
                    "total": len(episodes), "failed": sum(1 for e in episodes if float(e.get("reward") or 0) < 1),
                    "episodes": sample_episodes(episodes)})
    return out


# ---------------------------------------------------------------------------------- lineage
def lineage_tree(run_dir: Path, rows: list[dict]) -> list[dict[str, Any]]:
    """Every archived candidate as a node (children nested), with its scores per weights version,
    its verdict and why, its diff against its parent and sampled traces per weights version."""
    if not (run_dir / "harnesses").is_dir():
        return []
    archive = Archive(run_dir)
    accepted_in: dict[str, str] = {}  # id -> "accepted in H2" / "kept in H1" (the phase's incoming harness)
    incoming = "h0"
    for i, r in enumerate(r for r in rows if r.get("event") == "harness_accepted"):
        cid = r.get("accepted")
        accepted_in.setdefault(cid, f"{'kept' if cid == incoming else 'accepted'} in H{i + 1}")
        incoming = cid
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("event") in ("candidate", "rescore", "invalid", "duplicate", "confirm", "null_probe") and r.get("id"):
            by_id.setdefault(r["id"], []).append(r)
    nodes: dict[str, dict[str, Any]] = {}
    for meta in archive.all_meta():
        cid = meta["id"]
        try:
            source, source_error = archive.source(cid), None
        except ArchiveIntegrityError as e:
            source, source_error = None, str(e)
        events = by_id.get(cid, [])
        nodes[cid] = {"id": cid, "meta": meta, "scores": archive.all_scores(cid), "source": source,
                      "source_error": source_error, "events": [{**e, "note": event_note(e)} for e in events],
                      "verdict": verdict(meta, events, accepted_in),
                      "traces": {v: sample_episodes(archive.traces(cid, v)) for v in archive.all_scores(cid)},
                      "children": []}
    roots = []
    for cid in sorted(nodes, key=id_number):
        node = nodes[cid]
        parent = nodes.get(node["meta"].get("parent") or "")
        node["diff"] = diff(parent, node) if parent else ""
        (parent["children"] if parent else roots).append(node)
    return roots


def verdict(meta: dict, events: list[dict], accepted_in: dict[str, str]) -> dict[str, str]:
    """Accepted or not, and why: the confirmation's paired test, the null probe, validation."""
    cid = meta["id"]
    confirms = [e for e in events if e["event"] == "confirm"]
    probes = [e for e in events if e["event"] == "null_probe"]
    why = []
    if confirms:
        c = confirms[-1]
        why.append(f"confirmation: gain {c.get('gain', 0):+.3f}, {fmt_p(c.get('p'))}, "
                   f"{'passes' if c.get('passes') else 'not shown'} at {c.get('level')}")
    if probes:
        p = probes[-1]
        why.append(f"null probe: real {p.get('real', 0):.3f} vs null {p.get('null', 0):.3f}, {fmt_p(p.get('p'))}"
                   f"{', FLAGGED' if p.get('flagged') else ''}")
    if cid in accepted_in:
        return {"kind": "accepted", "text": accepted_in[cid], "why": "; ".join(why)}
    if meta.get("status") in ("invalid", "duplicate"):
        return {"kind": meta["status"], "text": meta["status"], "why": str(meta.get("reason", ""))}
    if not meta.get("parent"):
        return {"kind": "start", "text": "incoming harness", "why": "; ".join(why)}
    return {"kind": "rejected", "text": "not accepted",
            "why": "; ".join(why) or "not the best on the harness split under its weights"}


def diff(parent: dict[str, Any], node: dict[str, Any]) -> str:
    if parent["source"] is None or node["source"] is None:
        return ""
    return "".join(difflib.unified_diff(parent["source"].splitlines(keepends=True),
                                        node["source"].splitlines(keepends=True),
                                        fromfile=f"{parent['id']}/harness.py", tofile=f"{node['id']}/harness.py"))


# ---------------------------------------------------------------------------------- cost, matrix
def proposer_rounds(rows: list[dict]) -> tuple[list[dict[str, Any]], list[str], dict[str, float]]:
    """Each proposer call's usage (seconds, tokens, cost_usd, ... as the proposer reported them), the
    keys seen and their totals."""
    calls = [r for r in rows if r.get("event") in ("proposer_usage", "proposer_failure")]
    keys = sorted({k for r in calls for k, v in (r.get("usage") or {}).items() if isinstance(v, (int, float))})
    totals = {k: round(sum(float((r.get("usage") or {}).get(k) or 0) for r in calls), 4) for k in keys}
    return calls, keys, totals


def matrix_image(run_dir: Path) -> str | None:
    png = run_dir / "matrix" / "matrix.png"
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode() if png.is_file() else None


# ---------------------------------------------------------------------------------- page
def write_html(run_dir: Path, rows: list[dict], state: RunState | None, cfg: dict, sections: dict[str, list[str]],
               figs: dict[str, Any]) -> Path:
    svgs = {stem: Markup(plots.to_svg(fig)) for stem, fig in figs.items()}
    ledger = read_jsonl_rows(run_dir / "ledger.jsonl")
    spans = {axis: plots.phase_spans(ledger, rows, axis) for axis in ("rollouts", "tokens")}
    calls, usage_keys, usage_totals = proposer_rounds(rows)
    env_path = run_dir / "environment.json"
    page = environment().get_template("report.html.j2").render(
        name=cfg.get("name", run_dir.name), run_dir=str(run_dir), cfg=cfg, finished=bool(state and state.finished),
        ledger=state.ledger if state else {},
        environment=json.loads(env_path.read_text()) if env_path.is_file() else {},
        md={k: markdown(_without_title(k, v)) for k, v in sections.items()}, svgs=svgs, spans=spans,
        titles=SECTION_TITLES,
        tree=lineage_tree(run_dir, rows), evals=eval_traces(run_dir, rows),
        proposer_calls=calls, usage_keys=usage_keys, usage_totals=usage_totals,
        matrix_png=matrix_image(run_dir), clip_chars=CLIP_CHARS)
    path = run_dir / "report" / "report.html"
    path.write_text(page)
    return path


def write_compare_html(out: Path, lines: list[str], figs: dict[str, Any], run_dirs: list[str]) -> Path:
    """compare.html: compare.md's tables and the overlay curves (with each run's 95% CI) as inline SVG."""
    page = environment().get_template("compare.html.j2").render(
        title=next((line[2:] for line in lines if line.startswith("# ")), "Comparison"),
        body=markdown([line for line in lines if not line.startswith("# ")]),
        svgs={stem: Markup(plots.to_svg(fig)) for stem, fig in figs.items()}, run_dirs=run_dirs,
        reports=[os.path.relpath(page, out) if page.is_file() else None
                 for page in (Path(d) / "report" / "report.html" for d in run_dirs)])
    path = out / "compare.html"
    path.write_text(page)
    return path
