"""The run directory (DESIGN §5): resolved config, atomic state, metrics, the rollout ledger.

Resume rests on three rules:
- a *unit* of work (one weight step, one harness iteration, one evaluation) writes its metrics rows
  first and then the state that marks it done, atomically (tmp file + os.replace);
- metrics rows carry their unit id, and readers keep the last copy of each (unit, event, metric, split)
  row, so a unit redone after a kill does not count twice;
- every finished episode of the unit in flight is journaled to `inflight.jsonl`; after a kill,
  those are the rollouts that must be redone, and the ledger records them as `redone`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from whale.config import Config, ConfigError, config_from_dict, dump_config
from whale.tracking import Trackers, check_trackers

import yaml

# Purposes that count against the paper-style rollout budget, and those only recorded.
# The re-scoring of the incoming harness is the first harness iteration (DESIGN §11), so it counts;
# it keeps its own line in the ledger so reports can show it apart.
BUDGET_PURPOSES = ("weight", "harness", "rescore")
RECORDED_PURPOSES = ("eval", "smoke", "null_probe", "redone")


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Ledger:
    """Rollouts, calls and tokens by purpose. `budget_rollouts` is what the paper's plots count."""

    rollouts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    proposer_seconds: float = 0.0
    proposer_tokens: int = 0

    @property
    def budget_rollouts(self) -> int:
        return sum(self.rollouts.get(p, 0) for p in BUDGET_PURPOSES)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add_trajectories(self, purpose: str, trajectories: list) -> None:
        self.rollouts[purpose] += len(trajectories)
        for t in trajectories:
            self.llm_calls += len(t.calls)
            self.prompt_tokens += t.prompt_tokens
            self.completion_tokens += t.completion_tokens

    def snapshot(self) -> dict[str, Any]:
        return {"budget_rollouts": self.budget_rollouts, "rollouts": dict(self.rollouts),
                "llm_calls": self.llm_calls, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "proposer_seconds": round(self.proposer_seconds, 2),
                "proposer_tokens": self.proposer_tokens}

    @classmethod
    def from_snapshot(cls, d: dict[str, Any]) -> "Ledger":
        led = cls()
        led.rollouts.update(d.get("rollouts", {}))
        for key in ("llm_calls", "prompt_tokens", "completion_tokens", "proposer_tokens"):
            setattr(led, key, int(d.get(key, 0)))
        led.proposer_seconds = float(d.get("proposer_seconds", 0.0))
        return led


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.ledger = Ledger()
        self.t0 = time.time()
        self.elapsed_before = 0.0
        self.trackers = Trackers({})  # logging.trackers, opened by create/open

    # ---------------------------------------------------------------- creation / resume
    @classmethod
    def create(cls, path: str | Path, cfg: Config) -> "RunDir":
        run = cls(path)
        if (run.path / "state.json").exists():
            raise ConfigError(f"{run.path} already holds a run; use `whale run --resume {run.path}` or another --out")
        check_trackers(cfg.logging)
        run.path.mkdir(parents=True, exist_ok=True)
        atomic_write(run.path / "config.yaml", dump_config(cfg))
        atomic_write(run.path / "environment.json", json.dumps(environment_record(cfg), indent=1))
        run.trackers = Trackers.open(cfg, run.path)
        return run

    @classmethod
    def open(cls, path: str | Path) -> tuple["RunDir", Config, dict[str, Any]]:
        run = cls(path)
        cfg_path = run.path / "config.yaml"
        if not cfg_path.exists():
            raise ConfigError(f"{run.path} is not a run directory (no config.yaml)")
        cfg = config_from_dict(yaml.safe_load(cfg_path.read_text()) or {})
        state = run.load_state()
        run.ledger = Ledger.from_snapshot(state.get("ledger", {}))
        run.elapsed_before = float(state.get("elapsed_s", 0.0))
        check_trackers(cfg.logging)
        run.trackers = Trackers.open(cfg, run.path)
        lost = run.count_inflight()
        if lost:
            run.ledger.rollouts["redone"] += lost
            run.log({"unit": "resume", "event": "resume", "redone_rollouts": lost})
        run.clear_inflight()
        return run, cfg, state

    def check_config(self, cfg: Config) -> None:
        """`--resume` refuses a changed config: a resumed run must be the run that was started."""
        saved = (self.path / "config.yaml").read_text()
        if saved != dump_config(cfg):
            raise ConfigError(f"config differs from the one {self.path} was started with; "
                              "start a new run (--out) instead of resuming")

    # ---------------------------------------------------------------- state
    def load_state(self) -> dict[str, Any]:
        p = self.path / "state.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def save_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["ledger"] = self.ledger.snapshot()
        state["elapsed_s"] = round(self.elapsed(), 2)
        state["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        atomic_write(self.path / "state.json", json.dumps(state, indent=1, default=str))
        self.clear_inflight()

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t0

    # ---------------------------------------------------------------- metrics
    def log(self, row: dict[str, Any]) -> None:
        row = {"time": round(self.elapsed(), 2), **row, "ledger": self.ledger.snapshot()}
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.trackers.log(row)  # after the row is on disk: a tracker can fail, metrics.jsonl cannot

    def close(self) -> None:
        """Flush and close the trackers (the files of the run directory need no closing)."""
        self.trackers.close()

    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    # ---------------------------------------------------------------- in-flight journal
    def journal(self, unit: str, trajectory) -> None:
        with open(self.path / "inflight.jsonl", "a") as f:
            f.write(json.dumps({"unit": unit, "problem": trajectory.problem_id, "sample": trajectory.sample}) + "\n")

    def count_inflight(self) -> int:
        p = self.path / "inflight.jsonl"
        return sum(1 for _ in open(p)) if p.exists() else 0

    def clear_inflight(self) -> None:
        p = self.path / "inflight.jsonl"
        if p.exists():
            p.unlink()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Metrics rows, keeping the last copy of each row a redone unit wrote again."""
    p = Path(path) / "metrics.jsonl"
    if not p.exists():
        return []
    rows = []
    for line in open(p):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line after a kill
    keyed: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        keyed[(r.get("unit"), r.get("event"), r.get("split"), r.get("tag"), r.get("iteration"),
               r.get("candidate", r.get("id")))] = i
    keep = set(keyed.values())
    return [r for i, r in enumerate(rows) if i in keep or r.get("unit") is None]


def _sha256(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def environment_record(cfg: Config) -> dict[str, Any]:
    """Package versions and the machine, so a result can be traced to what produced it."""
    versions = {}
    for pkg in ("whale-opt", "torch", "transformers", "peft", "bm25s", "math-verify", "chess", "vllm", "ray"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {"python": platform.python_version(), "platform": platform.platform(), "packages": versions,
            "model": cfg.model.name, "cpu_count": os.cpu_count()}


def fingerprint_model(path: str | Path) -> dict[str, str]:
    """sha256 of the weight files of a local model folder (skipped for hub ids)."""
    p = Path(path)
    if not p.is_dir():
        return {}
    return {f.name: _sha256(f) for f in sorted(p.iterdir()) if f.suffix in (".safetensors", ".bin", ".gguf")}


def fingerprint_problems(splits: dict[str, list]) -> dict[str, str]:
    out = {}
    for name, problems in splits.items():
        h = hashlib.sha256()
        for p in problems:
            h.update(json.dumps([p.id, p.question, p.answer], sort_keys=True, default=str).encode())
        out[name] = f"{len(problems)}:{h.hexdigest()[:16]}"
    return out
