"""The harness archive: every candidate's code, scores and raw traces, as plain files to grep.

Meta-Harness's ablation found raw trace access to be what makes a proposer good (scores only:
34.6 median; code + raw traces: 50.0), so the archive is laid out for a coding agent with `ls`,
`cat` and `grep`, not for a database:

    harnesses/
      summary.jsonl            one row per evaluated (candidate, weights version)
      frontier.json            {weights_version: [Pareto points]}
      <id>/harness.py          the candidate
      <id>/meta.json           id, parent, proposer, hypothesis, mechanism, created, code_hash,
                               source_sha256, status (pending|valid|invalid|duplicate), reason, ...
      <id>/scores.json         {weights_version: {success_rate, mean_llm_calls, mean_tokens, n,
                               rollouts, errors}}
      <id>/traces.jsonl        every harness-split episode (no token ids), tagged "scored_under"
      _proposals/<tag>/        round.json (proposer, error, usage, candidate ids) and the
                               proposer's transcript (not shown to later proposers)

Only harness-split traces ever go here; weight-phase rollouts and val/test evaluations live
elsewhere in the run directory. Scores are keyed by the weights version they were measured under,
and the archive outlives a harness phase on purpose (the released WHALE code starts each phase
empty). Every write is atomic (tmp file + os.replace) and everything is reloaded from disk, so a
killed run resumes with the archive exactly as the last completed write left it.

Every source is pinned: `add_candidate` records the sha256 of the file's bytes as written (and
makes it read-only), and `source()` refuses a file whose bytes no longer match, so code that was
validated and scored is the code that runs later — whatever a proposer or a stray editor wrote
into harnesses/ since. (`code_hash` is a different thing: a hash of the normalized AST, used to
spot duplicates.) The pin lives in meta.json and in memory; whoever can rewrite both the file and
meta.json between two loads defeats it, which is why proposers never see the real archive at all
(docs/sandbox.md, "Proposer sandbox").
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

from whale.rollout.trajectory import Trajectory
from whale.store import atomic_write, file_sha256

STATUSES = ("pending", "valid", "invalid", "duplicate")


class ArchiveIntegrityError(RuntimeError):
    """An archived file no longer holds the bytes that were pinned when it was added."""


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def code_hash(source: str) -> str:
    """sha256 of the normalized source: the AST without comments, layout or docstrings.

    Two files that differ only in how they explain themselves run the same code, so they are the
    same candidate; unparsable sources fall back to their text with line endings normalized.
    """
    try:
        norm = ast.dump(_strip_docstrings(ast.parse(source)))
    except SyntaxError:
        norm = "\n".join(line.rstrip() for line in source.replace("\r\n", "\n").split("\n")).strip()
    return hashlib.sha256(norm.encode()).hexdigest()


def id_number(cid: str) -> int:
    try:
        return int(cid.lstrip("h"))
    except ValueError:
        return 10**9


def score_trajectories(trajectories: list[Trajectory]) -> dict[str, Any]:
    """success_rate, mean LLM calls (requests, not samples), mean tokens, n, rollouts, errors."""
    rollouts = len(trajectories)
    if rollouts == 0:
        return {"success_rate": 0.0, "mean_llm_calls": 0.0, "mean_tokens": 0.0, "n": 0, "rollouts": 0, "errors": 0}
    calls = [sum(1 for c in t.calls if c.sample_index == 0) for t in trajectories]
    tokens = [t.prompt_tokens + t.completion_tokens for t in trajectories]
    return {
        "success_rate": sum(float(t.reward) for t in trajectories) / rollouts,
        "mean_llm_calls": sum(calls) / rollouts,
        "mean_tokens": sum(tokens) / rollouts,
        "n": len({t.problem_id for t in trajectories}),
        "rollouts": rollouts,
        "errors": sum(1 for t in trajectories if t.error),
    }


def pareto_frontier(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points not dominated on (success_rate: higher, mean_llm_calls: lower), best first."""
    def dominates(a, b):
        return (a["success_rate"] >= b["success_rate"] and a["mean_llm_calls"] <= b["mean_llm_calls"]
                and (a["success_rate"] > b["success_rate"] or a["mean_llm_calls"] < b["mean_llm_calls"]))

    front = [p for p in points if not any(dominates(q, p) for q in points)]
    return sorted(front, key=rank_key)


def rank_key(point: dict[str, Any]) -> tuple:
    """Acceptance order: highest success rate, then fewer mean LLM calls, then the older id."""
    return (-round(point["success_rate"], 9), round(point["mean_llm_calls"], 9), id_number(point["id"]))


class Archive:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "harnesses"
        self.root.mkdir(parents=True, exist_ok=True)
        self._meta: dict[str, dict[str, Any]] = {}
        self._scores: dict[str, dict[str, dict[str, Any]]] = {}
        for meta_path in sorted(self.root.glob("h*/meta.json")):
            meta = json.loads(meta_path.read_text())
            self._meta[meta["id"]] = meta
            scores_path = meta_path.parent / "scores.json"
            self._scores[meta["id"]] = json.loads(scores_path.read_text()) if scores_path.exists() else {}
            code = meta_path.parent / "harness.py"
            if "source_sha256" not in meta and code.is_file():  # written before pinning: pin what is there
                meta["source_sha256"] = file_sha256(code)

    # ----- candidates -------------------------------------------------------------------------
    def ids(self) -> list[str]:
        return sorted(self._meta, key=id_number)

    def meta(self, cid: str) -> dict[str, Any]:
        if cid not in self._meta:
            raise KeyError(f"no harness {cid!r} in the archive {self.root}")
        return dict(self._meta[cid])

    def all_meta(self) -> list[dict[str, Any]]:
        return [dict(self._meta[cid]) for cid in self.ids()]

    def all_scores(self, cid: str) -> dict[str, dict[str, Any]]:
        """{weights_version: scores} of one candidate."""
        self.meta(cid)
        return {v: dict(s) for v, s in self._scores[cid].items()}

    def source(self, cid: str) -> str:
        """The candidate's code, after checking its bytes against the sha256 pinned at add time."""
        pinned = self.meta(cid).get("source_sha256", "")
        path = self.root / cid / "harness.py"
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ArchiveIntegrityError(f"harness {cid}: cannot read {path}: {e}") from None
        found = hashlib.sha256(data).hexdigest()
        if found != pinned:
            raise ArchiveIntegrityError(
                f"harness {cid}: {path} changed on disk after it was archived (sha256 {found[:12]}, "
                f"pinned {pinned[:12]}); refusing to run code that differs from what was validated")
        return io.TextIOWrapper(io.BytesIO(data)).read()  # decoded exactly as Path.read_text would

    def add_candidate(self, source: str, parent: str | None, proposer: str, hypothesis: str = "",
                      mechanism: str = "", notes: str = "") -> str:
        cid = f"h{max((id_number(i) for i in self._meta), default=-1) + 1}"
        path = self.root / cid / "harness.py"
        atomic_write(path, source)
        os.chmod(path, 0o444)  # a guard against accidents; the pin below is the guarantee
        meta = {"id": cid, "parent": parent, "proposer": proposer, "hypothesis": hypothesis,
                "mechanism": mechanism, "notes": notes, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "code_hash": code_hash(source), "source_sha256": file_sha256(path),
                "status": "pending", "reason": ""}
        self._meta[cid] = meta
        self._scores[cid] = {}
        self._write_meta(cid)
        return cid

    def update_meta(self, cid: str, **fields: Any) -> None:
        self.meta(cid)
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {fields['status']!r}")
        self._meta[cid].update(fields)
        self._write_meta(cid)

    def record_invalid(self, cid: str, reason: str) -> None:
        self.update_meta(cid, status="invalid", reason=reason)

    def _write_meta(self, cid: str) -> None:
        atomic_write(self.root / cid / "meta.json", json.dumps(self._meta[cid], indent=1, sort_keys=True) + "\n")

    # ----- scores and traces --------------------------------------------------------------------
    def record_scores(self, cid: str, weights_version: str, trajectories: list[Trajectory],
                      gold: dict[str, Any] | None = None) -> dict[str, Any]:
        """Score `trajectories`, write scores.json, traces.jsonl and summary.jsonl, refresh the frontier.

        Re-recording the same (candidate, version) replaces the earlier traces of that version, so a
        redone evaluation after a resume never leaves duplicate episodes behind.
        `gold` (problem id -> answer) is written into the traces only when the config shows gold.
        """
        meta = self.meta(cid)
        scores = score_trajectories(trajectories)
        folder = self.root / cid
        traces_path = folder / "traces.jsonl"
        kept = []
        if traces_path.exists():
            kept = [line for line in traces_path.read_text().splitlines()
                    if line and json.loads(line).get("scored_under") != weights_version]
        new = []
        for t in trajectories:
            row = t.to_json(gold=None if gold is None else gold.get(t.problem_id), include_ids=False)
            row["scored_under"] = weights_version
            new.append(json.dumps(row, default=str))
        atomic_write(traces_path, "".join(line + "\n" for line in kept + new))
        self._scores[cid][weights_version] = scores
        atomic_write(folder / "scores.json", json.dumps(self._scores[cid], indent=1, sort_keys=True) + "\n")
        if meta["status"] == "pending":
            self.update_meta(cid, status="valid")
        self._write_summary()
        self._write_frontier()
        return dict(scores)

    def scores(self, cid: str, weights_version: str) -> dict[str, Any] | None:
        self.meta(cid)
        s = self._scores[cid].get(weights_version)
        return dict(s) if s is not None else None

    def traces(self, cid: str, weights_version: str | None = None) -> list[dict[str, Any]]:
        path = self.root / cid / "traces.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        return [r for r in rows if weights_version is None or r.get("scored_under") == weights_version]

    def evaluated(self, code_hash_: str, weights_version: str) -> str | None:
        """The id already evaluated with this code under this weights version, if any."""
        for cid in self.ids():
            m = self._meta[cid]
            if m["code_hash"] == code_hash_ and m["status"] == "valid" and weights_version in self._scores[cid]:
                return cid
        return None

    # ----- acceptance -------------------------------------------------------------------------
    def points(self, weights_version: str, ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
        chosen = self.ids() if ids is None else list(ids)
        return [{"id": cid, **self._scores[cid][weights_version]} for cid in chosen
                if self._meta[cid]["status"] == "valid" and weights_version in self._scores[cid]]

    def frontier(self, weights_version: str) -> list[dict[str, Any]]:
        return pareto_frontier(self.points(weights_version))

    def best(self, weights_version: str, exclude: Iterable[str] = ()) -> str | None:
        """Top Pareto point: highest success rate, ties to fewer mean LLM calls, then the older id."""
        skip = set(exclude)
        ranked = sorted((p for p in self.points(weights_version) if p["id"] not in skip), key=rank_key)
        return ranked[0]["id"] if ranked else None

    def ranking(self, weights_version: str) -> list[str]:
        return [p["id"] for p in sorted(self.points(weights_version), key=rank_key)]

    def _write_summary(self) -> None:
        rows = []
        for cid in self.ids():
            m = self._meta[cid]
            for version, s in self._scores[cid].items():
                rows.append({"id": cid, "weights_version": version, "parent": m["parent"], "proposer": m["proposer"],
                             "mechanism": m["mechanism"], "hypothesis": m["hypothesis"], "status": m["status"], **s})
        atomic_write(self.root / "summary.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))

    def _write_frontier(self) -> None:
        versions = sorted({v for s in self._scores.values() for v in s})
        front = {v: self.frontier(v) for v in versions}
        atomic_write(self.root / "frontier.json", json.dumps(front, indent=1, sort_keys=True) + "\n")

    def proposals_dir(self, tag: str) -> Path:
        path = self.root / "_proposals" / tag
        path.mkdir(parents=True, exist_ok=True)
        return path
