"""Experiment trackers (TensorBoard, W&B, Trackio, MLflow) fed from the metrics rows.

metrics.jsonl stays the source of truth: `RunDir.log` writes each row there first and only then
hands it to `Trackers.log`, so a tracker can lag, fail or be switched off without losing anything.
Every row becomes scalars the same way for every tracker (`row_scalars`):

- `weight_step` rows: `weight_step/accept_rate`, `.../loss`, `.../rollouts`, ... (one point per step);
- `eval` rows: `eval/<split>/mean_at_k`, `pass_at_k`, ... and `eval/<split>/<source>/mean_at_k` for
  the per-source (per-task) breakdown (one point per evaluation);
- harness-phase rows: `candidate/success_rate`, `iteration_end/best_rate`, ... (per candidate and
  iteration);
- always `ledger/budget_rollouts`, `ledger/tokens` (the paper's x-axes) and `ledger/llm_calls`.

The x-axis: TensorBoard keeps one step per point, so every scalar is written twice, as `<tag>`
against budget rollouts and as `by_tokens/<tag>` against tokens. W&B, Trackio and MLflow get the
ledger counters as metrics of their own (W&B is told to plot against `ledger/budget_rollouts`;
pick `ledger/tokens` in its UI). The lineage table (every harness candidate: id, parent, mechanism,
status, success rate) is re-logged when a harness phase accepts and when the run closes.

A tracker that raises is switched off with one warning and the run goes on. Trackers that are not
installed are refused before the run directory exists (`check_trackers`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any, Protocol

from whale.config import Config, ConfigError, LoggingConfig, dump_config

MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
LINEAGE_EVENTS = ("rescore", "candidate", "duplicate", "invalid")
LINEAGE_COLUMNS = ("id", "parent", "mechanism", "status", "cycle", "iteration", "weights_version", "success_rate")
# bookkeeping fields of a row, not measurements
_NOT_SCALARS = {"time", "step", "cycle", "iteration", "unit", "ledger", "per_problem", "k", "n", "resumed", "reused"}


def check_trackers(cfg: LoggingConfig) -> None:
    """Refuse a tracker that is not installed, naming it and its extra (before any run state exists)."""
    for name in cfg.trackers:
        if importlib.util.find_spec(MODULES[name]) is None:
            raise ConfigError(f"logging.trackers: {name!r} is not installed; pip install 'whale-opt[{name}]' "
                              "or remove it from logging.trackers")


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics row, tagged as in the module docstring."""
    event = str(row.get("event", "row"))
    prefix = f"eval/{row.get('split', 'all')}" if event == "eval" else event
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in _NOT_SCALARS or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[f"{prefix}/{key}"] = float(value)
    for source, stats in (row.get("per_source") or {}).items():
        for key in ("mean_at_k", "pass_at_k"):
            if isinstance(stats.get(key), (int, float)):
                out[f"{prefix}/{source}/{key}"] = float(stats[key])
    ledger = row.get("ledger") or {}
    if out or event in LINEAGE_EVENTS:
        for key in ("budget_rollouts", "tokens", "llm_calls"):
            out[f"ledger/{key}"] = float(ledger.get(key, 0))
    return out


def lineage_row(row: dict[str, Any]) -> dict[str, Any]:
    return {c: row.get(c) for c in LINEAGE_COLUMNS}


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], rollouts: int, tokens: int) -> None: ...

    def table(self, name: str, columns: tuple[str, ...], rows: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under DIR/tensorboard; scalars against rollouts and (by_tokens/...) tokens."""

    def __init__(self, folder: Path, cfg: Config):
        from torch.utils.tensorboard import SummaryWriter  # optional extra: needs the tensorboard package

        self.writer = SummaryWriter(str(folder / "tensorboard"))
        self.writer.add_text("config", "```yaml\n" + dump_config(cfg) + "\n```")

    def log(self, scalars: dict[str, float], rollouts: int, tokens: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=rollouts)
            self.writer.add_scalar(f"by_tokens/{tag}", value, global_step=tokens)
        self.writer.flush()

    def table(self, name: str, columns: tuple[str, ...], rows: list[list[Any]]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join("" if v is None else str(v) for v in r) + " |" for r in rows]
        self.writer.add_text(name, "\n".join(lines), global_step=len(rows))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbStyleRun:
    """log/table/close for libraries with W&B's run API (wandb and trackio): `self.lib` is the
    module (for its Table), `self.run` the run its `init` returned."""

    lib: Any
    run: Any

    def log(self, scalars: dict[str, float], rollouts: int, tokens: int) -> None:
        self.run.log(scalars)

    def table(self, name: str, columns: tuple[str, ...], rows: list[list[Any]]) -> None:
        self.run.log({name: self.lib.Table(columns=list(columns), data=rows)})

    def close(self) -> None:
        self.run.finish()


class WandbTracker(_WandbStyleRun):
    """A W&B run in DIR/wandb (WANDB_MODE=offline keeps it local; `wandb sync` uploads it later).
    The run id is fixed per run directory, so `whale run --resume` continues the same W&B run."""

    def __init__(self, folder: Path, cfg: Config, run_id: str):
        import wandb  # optional extra

        self.lib = wandb
        (folder / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.logging.project, name=cfg.name, id=run_id, resume="allow",
                              dir=str(folder), config=cfg.model_dump(mode="json"))
        self.run.define_metric("ledger/budget_rollouts")
        self.run.define_metric("*", step_metric="ledger/budget_rollouts")


class TrackioTracker(_WandbStyleRun):
    """A Trackio run: a local SQLite file per project under TRACKIO_DIR (Trackio's own default,
    ~/.cache/huggingface/trackio, when unset); `trackio show` opens the dashboard."""

    def __init__(self, folder: Path, cfg: Config, run_id: str):
        import trackio  # optional extra

        self.lib = trackio
        self.run = trackio.init(project=cfg.logging.project, name=f"{cfg.name}-{run_id}", resume="allow",
                                config=cfg.model_dump(mode="json"), embed=False, auto_log_cpu=False,
                                auto_log_gpu=False)


class MlflowTracker:
    """An MLflow run; the store is MLFLOW_TRACKING_URI when set, else the SQLite file DIR/mlflow.db
    (MLflow 3 refuses its old file store by default). Steps are budget rollouts; `ledger/tokens` is
    a metric of its own."""

    def __init__(self, folder: Path, cfg: Config, run_id: str):
        import mlflow  # optional extra

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # the SQLite store puts artifacts under ./mlruns of the working directory unless the
            # experiment names a location: keep them in the run directory too
            mlflow.set_tracking_uri(f"sqlite:///{(folder / 'mlflow.db').resolve()}")
            if mlflow.get_experiment_by_name(cfg.logging.project) is None:
                mlflow.create_experiment(cfg.logging.project, (folder / "mlartifacts").resolve().as_uri())
        mlflow.set_experiment(cfg.logging.project)
        found = mlflow.search_runs(filter_string=f"tags.whale_run_id = '{run_id}'", output_format="list")
        self.run = mlflow.start_run(run_id=found[0].info.run_id if found else None, run_name=cfg.name,
                                    tags={"whale_run_id": run_id})
        if not found:
            flat = _flatten(cfg.model_dump(mode="json"))
            mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def log(self, scalars: dict[str, float], rollouts: int, tokens: int) -> None:
        self.mlflow.log_metrics({_mlflow_key(k): v for k, v in scalars.items()}, step=rollouts)

    def table(self, name: str, columns: tuple[str, ...], rows: list[list[Any]]) -> None:
        # log_dict, not log_table: log_table needs pandas, which mlflow-skinny does not bring
        self.mlflow.log_dict({"columns": list(columns), "data": rows}, f"{name}.json")

    def close(self) -> None:
        self.mlflow.end_run()


class Trackers:
    """The configured trackers of one run, each switched off (with one warning) when it fails."""

    def __init__(self, trackers: dict[str, Tracker]):
        self.trackers = trackers
        self.lineage: dict[str, list[Any]] = {}
        self._lineage_logged = 0

    @classmethod
    def open(cls, cfg: Config, run_path: Path) -> "Trackers":
        if not cfg.logging.trackers:
            return cls({})
        folder = Path(cfg.logging.dir) if cfg.logging.dir else run_path / "trackers"
        folder.mkdir(parents=True, exist_ok=True)
        run_id = tracker_run_id(run_path)
        makers = {"tensorboard": lambda: TensorBoardTracker(folder, cfg),
                  "wandb": lambda: WandbTracker(folder, cfg, run_id),
                  "trackio": lambda: TrackioTracker(folder, cfg, run_id),
                  "mlflow": lambda: MlflowTracker(folder, cfg, run_id)}
        opened: dict[str, Tracker] = {}
        for name in dict.fromkeys(cfg.logging.trackers):
            try:
                opened[name] = makers[name]()
            except Exception as e:  # noqa: BLE001 - a tracker must never stop the run
                _warn(name, "could not start", e)
        return cls(opened)

    def log(self, row: dict[str, Any]) -> None:
        if not self.trackers:
            return
        scalars = row_scalars(row)
        ledger = row.get("ledger") or {}
        rollouts, tokens = int(ledger.get("budget_rollouts", 0)), int(ledger.get("tokens", 0))
        if scalars:
            self._each("log", scalars, rollouts, tokens)
        if row.get("event") in LINEAGE_EVENTS and row.get("id"):
            self.lineage[str(row["id"])] = [lineage_row(row)[c] for c in LINEAGE_COLUMNS]
        if row.get("event") in ("harness_accepted", "run_end"):
            self.log_lineage()

    def log_lineage(self) -> None:
        if self.trackers and len(self.lineage) != self._lineage_logged:
            self._lineage_logged = len(self.lineage)
            self._each("table", "lineage", LINEAGE_COLUMNS, list(self.lineage.values()))

    def close(self) -> None:
        self.log_lineage()
        self._each("close")
        self.trackers = {}

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001 - metrics.jsonl already has the row
                _warn(name, f"failed in {method}()", e)
                self.trackers.pop(name, None)


def _warn(name: str, what: str, exc: Exception) -> None:
    warnings.warn(f"tracker {name!r} {what} and is switched off for this run "
                  f"(metrics.jsonl is unaffected): {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)


def tracker_run_id(run_path: Path) -> str:
    """A stable id per run directory (W&B run id, MLflow tag): resuming continues the same run."""
    return hashlib.sha1(str(run_path.resolve()).encode()).hexdigest()[:12]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _mlflow_key(tag: str) -> str:
    """MLflow metric names allow letters, digits, _ - . space : / only."""
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in tag)
