"""The harness x weights transfer matrix: is a co-adapted pair worth more than swapping a side?

WHALE's premise is that weight updates change which harness works and harness updates change
which abilities of the model show. A run already holds what is needed to test it: every accepted
harness (h0 and each harness phase's winner) and every weights version it kept (base and each
weight phase's end). `whale matrix RUN_DIR` scores every harness under every weights version on
one split, with the run's own config, seeds and sampling, so each cell is what the run itself
would have measured for that pair:

- cells the run already evaluated (same harness, weights, split, k and problems) are reused from
  its metrics; the others are evaluated and counted in the run's ledger as `eval` rollouts;
- cells are appended to `RUN_DIR/matrix/cells.jsonl` as they finish, so a killed matrix resumes
  with the cells it has (a cell is the unit of work; one in flight is redone);
- `--with OTHER_RUN` adds another run's harnesses and weights (same base model required), so a
  harness found under one method's weights can be scored under another's;
- `matrix.md` and `matrix.png` give mean@k with 95% intervals, and split the gain of the final
  pair (hF, wF) over (h0, base) into harness alone M(hF, base) - M(h0, base), weights alone
  M(h0, wF) - M(h0, base) and their interaction, the difference of differences
  M(hF, wF) - M(hF, base) - M(h0, wF) + M(h0, base), each with a paired bootstrap interval over
  problems (all four cells share problems and sampling seeds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from whale.config import Config, ConfigError, config_from_dict  # noqa: E402
from whale.domains import SPLITS, load_domain  # noqa: E402
from whale.engine.default_model import resolve_model_path  # noqa: E402
from whale.evaluate import Evaluator, bootstrap_ci  # noqa: E402
from whale.harness.archive import Archive  # noqa: E402
from whale.run_state import RunState  # noqa: E402
from whale.store import (Ledger, append_line, fingerprint_problems, read_metrics, read_state,  # noqa: E402
                         version_step, write_state)

BASE = "base"


@dataclass(frozen=True)
class HarnessRef:
    label: str  # "h3" in the main run, "<run name>:h3" in a --with run
    run_dir: Path
    harness_id: str


@dataclass(frozen=True)
class WeightsRef:
    label: str  # "base", "w7", or "<run name>:w7"
    run_dir: Path | None
    version: str

    @property
    def path(self) -> Path | None:
        return None if self.version == BASE else self.run_dir / "weights" / self.version


@dataclass
class RunInfo:
    """What the matrix needs to know about one run directory."""

    path: Path
    cfg: Config
    state: RunState
    rows: list[dict[str, Any]]
    harnesses: list[str]  # accepted harness ids in order, h0 first
    weights: list[str]  # weights versions kept on disk, in training order (base not included)
    trained: list[str]  # every weights version the run ever pushed


def read_run(path: str | Path) -> RunInfo:
    path = Path(path)
    for name in ("config.yaml", "state.json", "metrics.jsonl"):
        if not (path / name).is_file():
            raise ConfigError(f"{path} is not a run directory (no {name})")
    cfg = config_from_dict(yaml.safe_load((path / "config.yaml").read_text()) or {})
    state = read_state(path)
    assert state is not None  # state.json exists, checked above
    rows = read_metrics(path)
    accepted = [r["accepted"] for r in rows if r.get("event") == "harness_accepted"]
    harnesses = []
    for hid in ["h0", *accepted, state.harness_id]:
        if hid not in harnesses:
            harnesses.append(hid)
    trained = sorted({r["weights_version"] for r in rows if r.get("event") == "weight_step"
                      and version_step(r.get("weights_version") or "") is not None}, key=version_step)
    on_disk = [d.name for d in (path / "weights").iterdir()
               if d.is_dir() and version_step(d.name) is not None] if (path / "weights").is_dir() else []
    return RunInfo(path, cfg, state, rows, harnesses, sorted(on_disk, key=version_step), trained)


def _same_base_model(a: RunInfo, b: RunInfo) -> bool:
    fa, fb = a.state.model_fingerprint, b.state.model_fingerprint
    if fa and fb:
        return fa == fb
    return a.cfg.model.name == b.cfg.model.name


def matrix_axes(main: RunInfo, others: list[RunInfo]) -> tuple[list[HarnessRef], list[WeightsRef]]:
    """Rows and columns: the main run's harnesses and weights first, then each --with run's."""
    for o in others:
        if not _same_base_model(main, o):
            raise ConfigError(f"{o.path} was trained from another base model ({o.cfg.model.name}) than "
                              f"{main.path} ({main.cfg.model.name}); their harnesses and weights do not transfer")
    harnesses = [HarnessRef(h, main.path, h) for h in main.harnesses]
    weights = [WeightsRef(BASE, None, BASE)] + [WeightsRef(v, main.path, v) for v in main.weights]
    seen = {Archive(main.path).meta(h)["code_hash"] for h in main.harnesses}
    for o in others:
        tag, archive = o.path.name, Archive(o.path)
        for h in o.harnesses:  # the same code under another run's name would only repeat a row
            if archive.meta(h)["code_hash"] not in seen:
                seen.add(archive.meta(h)["code_hash"])
                harnesses.append(HarnessRef(f"{tag}:{h}", o.path, h))
        weights += [WeightsRef(f"{tag}:{v}", o.path, v) for v in o.weights]
    if len(weights) < 2:
        missing = ", ".join(main.trained) or "none"
        raise ConfigError(f"no weights kept: {main.path}/weights holds no trained version (trained: {missing}); "
                          "the matrix needs at least one besides base (add a run with --with)")
    return harnesses, weights


class Matrix:
    """Evaluate, reuse and store the cells of one run's matrix; see the module docstring."""

    def __init__(self, run_dir: str | Path, split: str = "test", k: int | None = None,
                 others: list[str | Path] = ()):
        self.main = read_run(run_dir)
        if self.main.state.phase != "done":
            raise ConfigError(f"{self.main.path} has not finished (phase {self.main.state.phase!r}); "
                              "finish it with `whale run --resume` before building its matrix")
        self.others = [read_run(o) for o in others]
        self.cfg = self.main.cfg
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
        self.split = split
        self.k = k or self.cfg.eval.k
        if self.k < 1:
            raise ConfigError("--k must be at least 1")
        self.harnesses, self.weights = matrix_axes(self.main, self.others)
        self.out = self.main.path / "matrix"
        self.cells_path = self.out / "cells.jsonl"
        self.domain = load_domain(self.cfg)
        self.splits = splits = self.domain.load_splits()
        saved = self.main.state.data_fingerprints.get(split)
        if saved and fingerprint_problems({split: splits[split]})[split] != saved:
            raise ConfigError(f"the {split} split differs from the one {self.main.path} was run on "
                              "(data files or loaders changed)")
        self.problems = splits[split][: self.cfg.eval.limit or None]
        self.cells: dict[tuple[str, str], dict[str, Any]] = {}
        if self.cells_path.exists():
            for line in self.cells_path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line after a kill
                if (row.get("split"), row.get("k"), row.get("n")) == (split, self.k, len(self.problems)):
                    self.cells[(row["harness"], row["weights"])] = row

    # ------------------------------------------------------------------ cells
    def _reusable(self, h: HarnessRef, w: WeightsRef) -> dict[str, Any] | None:
        """The main run's own evaluation of this pair, if it measured exactly this cell."""
        if h.run_dir != self.main.path or w.run_dir not in (None, self.main.path):
            return None
        for r in reversed(self.main.rows):
            if (r.get("event") == "eval" and r.get("split") == self.split and r.get("harness") == h.harness_id
                    and r.get("weights_version") == w.version and r.get("k") == self.k
                    and r.get("n") == len(self.problems) and r.get("per_problem")):
                return r
        return None

    def _store(self, h: HarnessRef, w: WeightsRef, result: dict[str, Any], reused: bool) -> None:
        row = {"harness": h.label, "weights": w.label, "split": self.split, "k": self.k, "n": len(self.problems),
               "mean_at_k": result["mean_at_k"], "ci95": list(result["ci95"]),
               "per_problem": list(result["per_problem"]), "rollouts": 0 if reused else result["rollouts"],
               "reused": reused, **{x: 0 if reused else int(result.get(x, 0))
                                    for x in ("prompt_tokens", "completion_tokens")},
               "llm_calls": 0 if reused else int(round(result.get("mean_llm_calls", 0) * result["rollouts"]))}
        if not reused:
            self._count(row)  # before the cell is stored: a kill in between recomputes it, counted once
        self.out.mkdir(parents=True, exist_ok=True)
        append_line(self.cells_path, row)
        self.cells[(h.label, w.label)] = row

    def _count(self, row: dict[str, Any]) -> None:
        """Add a computed cell's rollouts to the run's ledger (as `eval`), keyed by the cell, so a
        cell is counted once however often the matrix is rerun (ledger.jsonl is the record)."""
        state = read_state(self.main.path)
        assert state is not None  # a finished run's
        ledger = Ledger.load(self.main.path / "ledger.jsonl", state.ledger)
        key = f"matrix:{self.split}/{self.k}/{row['harness']}/{row['weights']}"
        if key in ledger.keys:
            return
        ledger.count(key, "eval", row["rollouts"], llm_calls=row["llm_calls"], prompt_tokens=row["prompt_tokens"],
                     completion_tokens=row["completion_tokens"])
        state.ledger = ledger.snapshot()
        write_state(self.main.path, state)
        append_line(self.main.path / "metrics.jsonl",
                    {"unit": key, "event": "matrix_eval", "split": self.split, "harness": row["harness"],
                     "weights_version": row["weights"], "mean_at_k": row["mean_at_k"], "rollouts": row["rollouts"],
                     "ledger": state.ledger})

    def _harness_source(self, h: HarnessRef) -> str:
        return Archive(h.run_dir).source(h.harness_id)

    def compute(self, progress: bool = True) -> None:
        """Fill every missing cell: reuse the run's evaluations, evaluate the rest (weights by weights)."""
        todo: dict[WeightsRef, list[HarnessRef]] = {}
        for w in self.weights:
            for h in self.harnesses:
                if (h.label, w.label) in self.cells:
                    continue
                reused = self._reusable(h, w)
                if reused is not None:
                    self._store(h, w, reused, reused=True)
                else:
                    todo.setdefault(w, []).append(h)
        if not todo:
            return
        for w in todo:
            if w.path is not None and not w.path.is_dir():
                raise ConfigError(f"weights {w.label} are missing ({w.path})")
        base_path = str(resolve_model_path(self.cfg.model.name))
        with Evaluator(self.cfg, self.domain, self.splits) as evaluator:
            engine = evaluator.engine
            first = True
            for w, hs in todo.items():  # base (if needed) first: a fresh engine serves the base model
                if w.path is not None:
                    engine.load_weights(str(w.path), w.label)
                elif not first:  # back to the base model after an adapter was loaded
                    engine.load_weights(None if engine.weight_sync == "from_disk" else base_path, BASE)
                first = False
                for h in hs:
                    result, _ = evaluator.measure(self._harness_source(h), self.split, harness_id=h.harness_id,
                                                  k=self.k, progress=f"matrix {h.label} x {w.label}" if progress else None)
                    self._store(h, w, result.to_json(with_per_problem=True), reused=False)

    # ------------------------------------------------------------------ reading
    def cell(self, h: str, w: str) -> dict[str, Any]:
        return self.cells[(h, w)]

    def decomposition(self) -> dict[str, Any]:
        """Harness alone, weights alone and their interaction for the final pair, with paired CIs."""
        h0, hf = "h0", self.main.state.harness_id
        wf = self.main.state.weights_version
        if wf != BASE and wf not in self.main.weights:
            wf = self.main.weights[-1] if self.main.weights else BASE
        parts = decompose(self.cell(h0, BASE)["per_problem"], self.cell(hf, BASE)["per_problem"],
                          self.cell(h0, wf)["per_problem"], self.cell(hf, wf)["per_problem"])
        return {"final_harness": hf, "final_weights": wf, **parts}

    def write(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        hl, wl = [h.label for h in self.harnesses], [w.label for w in self.weights]
        lines = [f"# Harness x weights matrix: {self.main.path.name}", "",
                 f"Split **{self.split}**, {len(self.problems)} problems x k={self.k}, mean@k [95% CI]; "
                 "rows: harnesses (h0, then each harness phase's winner), columns: weights versions kept "
                 "(base, then each weight phase's end). Every cell uses the run's seeds and sampling.", "",
                 "| harness \\ weights | " + " | ".join(wl) + " |", "|---|" + "---|" * len(wl)]
        for h in hl:
            cells = []
            for w in wl:
                c = self.cells[(h, w)]
                cells.append(f"{c['mean_at_k']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"
                             + (" *" if c["reused"] else ""))
            lines.append(f"| {h} | " + " | ".join(cells) + " |")
        lines += ["", "\\* measured by the run itself (reused); the other cells were evaluated by `whale matrix` "
                  "and counted in the run's ledger as eval rollouts.", ""]
        dec = self.decomposition()
        lines += [f"## Where the gain of the final pair ({dec['final_harness']}, {dec['final_weights']}) over "
                  "(h0, base) comes from", "", "| part | mean@k difference | 95% CI (paired bootstrap over problems) | reading |",
                  "|---|---|---|---|"]
        for name in ("harness alone", "weights alone", "interaction", "total"):
            v = dec[name]
            lo, hi = v["ci95"]
            reading = "no effect shown" if lo <= 0 <= hi else ("gain" if lo > 0 else "loss")
            lines.append(f"| {name} | {v['value']:+.3f} | [{lo:+.3f}, {hi:+.3f}] | {reading} |")
        inter = dec["interaction"]
        lines += ["", "Interaction = M(hF, wF) - M(hF, base) - M(h0, wF) + M(h0, base): above zero, the pair is "
                  "worth more than its parts (co-adaptation); below zero, the two sides buy the same gain twice.",
                  "", _reading(inter), "", "![matrix](matrix.png)", ""]
        (self.out / "matrix.md").write_text("\n".join(lines))
        self._heatmap(hl, wl)
        (self.out / "matrix.json").write_text(json.dumps({"split": self.split, "k": self.k, "n": len(self.problems),
                                                          "harnesses": hl, "weights": wl, "decomposition": dec,
                                                          "cells": list(self.cells.values())}, indent=1))
        return self.out / "matrix.md"

    def _heatmap(self, hl: list[str], wl: list[str]) -> None:
        values = [[self.cells[(h, w)]["mean_at_k"] for w in wl] for h in hl]
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(wl), 1.2 + 0.6 * len(hl)))
        im = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=max(0.05, max(max(r) for r in values)), aspect="auto")
        ax.set_xticks(range(len(wl)), wl, rotation=30, ha="right", fontsize=8)
        ax.set_yticks(range(len(hl)), hl, fontsize=8)
        ax.set_xlabel("weights")
        ax.set_ylabel("harness")
        for i, h in enumerate(hl):
            for j, w in enumerate(wl):
                c = self.cells[(h, w)]
                ax.text(j, i, f"{c['mean_at_k']:.2f}\n[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]", ha="center",
                        va="center", fontsize=7, color="white" if c["mean_at_k"] < 0.6 * im.norm.vmax else "black")
        fig.colorbar(im, ax=ax, label=f"{self.split} mean@{self.k}")
        ax.set_title(f"{self.main.path.name}: harness x weights", fontsize=9)
        fig.tight_layout()
        fig.savefig(self.out / "matrix.png", dpi=120)
        plt.close(fig)


def decompose(h0_base: list[float], hf_base: list[float], h0_wf: list[float],
              hf_wf: list[float]) -> dict[str, dict[str, Any]]:
    """Per-problem contrasts of the four corner cells, averaged, with paired bootstrap intervals.

    All four lists are per-problem mean@k over the same problems (same order, same seeds), so each
    contrast is computed problem by problem before resampling problems."""
    if not len(h0_base) == len(hf_base) == len(h0_wf) == len(hf_wf):
        raise ValueError("the four corner cells must cover the same problems")
    parts = {
        "harness alone": [b - a for a, b in zip(h0_base, hf_base)],
        "weights alone": [c - a for a, c in zip(h0_base, h0_wf)],
        "interaction": [d - b - c + a for a, b, c, d in zip(h0_base, hf_base, h0_wf, hf_wf)],
        "total": [d - a for a, d in zip(h0_base, hf_wf)],
    }
    return {name: {"value": round(sum(v) / max(1, len(v)), 4), "ci95": list(bootstrap_ci(v, iters=2000))}
            for name, v in parts.items()}


def _reading(inter: dict[str, Any]) -> str:
    lo, hi = inter["ci95"]
    if lo > 0:
        return (f"Reading: the co-adapted pair beats swapping either side; interaction {inter['value']:+.3f} "
                f"[{lo:+.3f}, {hi:+.3f}] is above zero.")
    if hi < 0:
        return (f"Reading: a loss from combining: interaction {inter['value']:+.3f} [{lo:+.3f}, {hi:+.3f}] is below "
                "zero, so the harness and the weights overlap in what they fix.")
    return (f"Reading: no interaction shown (interaction {inter['value']:+.3f}, interval [{lo:+.3f}, {hi:+.3f}] "
            "includes zero): at this size the gains of the two sides add up, within noise.")


def build_matrix(run_dir: str | Path, split: str = "test", k: int | None = None,
                 others: list[str | Path] = (), progress: bool = True) -> Path:
    """`whale matrix`: compute the missing cells (resumable) and write matrix.md / matrix.png."""
    m = Matrix(run_dir, split=split, k=k, others=others)
    m.compute(progress=progress)
    return m.write()
