"""The run directory (docs/design.md, 4.6): resolved config, atomic state, metrics, the rollout ledger.

Resume rests on four rules:
- a *unit* of work (one weight step, one harness iteration, one evaluation) writes its metrics rows
  first and then the state that marks it done, atomically (tmp file + os.replace);
- metrics rows carry their unit id, and readers keep the last copy of each (unit, event, metric, split)
  row, so a unit redone after a kill does not count twice;
- rollouts are counted in `ledger.jsonl`, one fsynced line per batch, keyed by the work that ran
  them, *before* that work's results are written. The ledger is therefore never behind what is on
  disk; a batch whose key is already there ran again because a kill lost its results, and goes to
  `redone` instead of its purpose, so budgets match those of an unkilled run;
- every finished episode of a batch not yet counted is journaled to `inflight.jsonl`; after a kill,
  those are the rollouts that must be redone, and the ledger records them as `redone`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from whale.config import Config, ConfigError, dump_config, load_config
from whale.errors import RunDirBusy, StorageError, raise_naming
from whale.run_state import RunState
from whale.tracking import Trackers, check_trackers

# Purposes that count against the paper-style rollout budget, and those only recorded.
# The re-scoring of the incoming harness is the first harness iteration (docs/design.md, section 9), so it counts;
# it keeps its own line in the ledger so reports can show it apart.
BUDGET_PURPOSES = ("weight", "harness", "rescore", "confirm")  # confirm: see whale/harness/acceptance.py
RECORDED_PURPOSES = ("eval", "smoke", "null_probe", "redone")

# Test hook: `WHALE_TEST_KILL_AT=<point>` SIGKILLs this process when it reaches the named point
# (see `kill_point`), so the resume tests can cut a run exactly inside each window that matters.
KILL_ENV = "WHALE_TEST_KILL_AT"


def kill_point(point: str) -> None:
    """SIGKILL ourselves at `point` when the test hook names it: a kill there is what resume must survive.

    Points: `<event>@<unit>` right after that metrics row is written (before the state that
    follows it is saved), `rows@w<step>` once a weight step's rows are on disk (before training),
    and `prune` right before weights versions are deleted.
    """
    if os.environ.get(KILL_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def atomic_write(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that a kill leaves either the old file or the complete new one: a
    temporary file of its own beside it (two writers never share one), fsynced, renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise_naming(e, path)


def append_line(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line and fsync: after a kill the line is either whole or a torn last line.
    A torn last line (a kill, a full disk) is ended first, so the new row starts a line of its own
    instead of being glued to the torn one (which would make readers skip both)."""
    try:
        with open(path, "ab+") as f:
            torn = False
            if f.seek(0, os.SEEK_END):
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            f.write((b"\n" if torn else b"") + (json.dumps(row, default=str) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise_naming(e, path)


def read_jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file this module appended to, skipping a line torn by a kill."""
    if not path.exists():
        return []
    rows = []
    for line in open(path):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


@dataclass
class Ledger:
    """Rollouts, calls and tokens by purpose. `budget_rollouts` is what the paper's plots count.

    With a `path`, every count is also appended to that file (`ledger.jsonl`) before it returns,
    and `Ledger.load` rebuilds the totals from it; `keys` are the batches counted so far.
    """

    rollouts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    proposer_seconds: float = 0.0
    proposer_tokens: int = 0
    proposer_cost_usd: float = 0.0
    keys: set[str] = field(default_factory=set)
    path: Path | None = None

    @property
    def budget_rollouts(self) -> int:
        return sum(self.rollouts.get(p, 0) for p in BUDGET_PURPOSES)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def count(self, key: str, purpose: str, rollouts: int, llm_calls: int = 0, prompt_tokens: int = 0,
              completion_tokens: int = 0) -> str:
        """Count one batch of rollouts, run by the unit of work `key`; returns the purpose it was
        counted under: `redone` when `key` was counted before (its results were lost to a kill)."""
        counted_as = "redone" if key in self.keys else purpose
        self._record({"key": key, "purpose": counted_as, "of": purpose, "rollouts": int(rollouts),
                      "llm_calls": int(llm_calls), "prompt_tokens": int(prompt_tokens),
                      "completion_tokens": int(completion_tokens)})
        return counted_as

    def add_proposer(self, key: str, seconds: float, tokens: int, cost_usd: float = 0.0) -> None:
        """Proposer time, tokens and USD (as the agent reports it; 0 when it does not): real
        spending, so a proposer re-run after a kill counts again."""
        self._record({"key": key, "proposer_seconds": float(seconds), "proposer_tokens": int(tokens),
                      "proposer_cost_usd": float(cost_usd)})

    def _record(self, entry: dict[str, Any]) -> None:
        if self.path is not None:
            append_line(self.path, entry)
        self._apply(entry)

    def _apply(self, e: dict[str, Any]) -> None:
        self.keys.add(e["key"])
        if "purpose" in e:
            self.rollouts[e["purpose"]] += e["rollouts"]
        self.llm_calls += e.get("llm_calls", 0)
        self.prompt_tokens += e.get("prompt_tokens", 0)
        self.completion_tokens += e.get("completion_tokens", 0)
        self.proposer_seconds += e.get("proposer_seconds", 0.0)
        self.proposer_tokens += e.get("proposer_tokens", 0)
        self.proposer_cost_usd += e.get("proposer_cost_usd", 0.0)

    @classmethod
    def load(cls, path: Path, snapshot: dict[str, Any] | None = None) -> "Ledger":
        """The ledger of `path`; a run from before ledger.jsonl existed starts from its state snapshot."""
        led = cls.from_snapshot(snapshot or {}) if not path.exists() else cls()
        for entry in read_jsonl_rows(path):
            led._apply(entry)
        led.path = path
        return led

    def snapshot(self) -> dict[str, Any]:
        return {"budget_rollouts": self.budget_rollouts, "rollouts": dict(self.rollouts),
                "llm_calls": self.llm_calls, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "proposer_seconds": round(self.proposer_seconds, 2),
                "proposer_tokens": self.proposer_tokens, "proposer_cost_usd": round(self.proposer_cost_usd, 4)}

    @classmethod
    def from_snapshot(cls, d: dict[str, Any]) -> "Ledger":
        led = cls()
        led.rollouts.update(d.get("rollouts", {}))
        for key in ("llm_calls", "prompt_tokens", "completion_tokens", "proposer_tokens"):
            setattr(led, key, int(d.get(key, 0)))
        led.proposer_seconds = float(d.get("proposer_seconds", 0.0))
        led.proposer_cost_usd = float(d.get("proposer_cost_usd", 0.0))
        return led


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.ledger = Ledger(path=self.path / "ledger.jsonl")
        self.t0 = time.time()
        self.elapsed_before = 0.0
        self.trackers = Trackers({})  # logging.trackers, opened by create/open
        self._lock_file: Any = None  # run.lock, held from create/open to close (closed with this object)

    def _lock(self) -> None:
        """One process per run directory: an exclusive lock on run.lock, held until `close` (or the
        process's end: the kernel drops it, so a killed run leaves nothing to clean up). Two
        processes writing one run directory (a resume started while the run still goes) would
        interleave their units and corrupt it; the second is refused instead, naming the first."""
        path = self.path / "run.lock"
        try:
            f = open(path, "a+")  # not inherited by the processes a run starts (PEP 446)
        except OSError:
            if not path.exists():
                raise
            f = open(path)  # a read-only run directory: lock it anyway; the run's first write says what is wrong
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read(32).strip()
            f.close()
            raise RunDirBusy(f"{self.path} is in use by another whale process" + (f" (pid {holder})" if holder else "")
                             + ": wait for it to end or stop it, then resume; two processes writing one run "
                               "directory would corrupt it") from None
        if f.writable():
            f.truncate(0)
            f.write(str(os.getpid()))
            f.flush()
        self._lock_file = f

    # ---------------------------------------------------------------- creation / resume
    @classmethod
    def create(cls, path: str | Path, cfg: Config) -> "RunDir":
        run = cls(path)
        if (run.path / "state.json").exists():
            raise ConfigError(f"{run.path} already holds a run; use `whale run --resume {run.path}` or another --out")
        check_trackers(cfg.logging)
        run.path.mkdir(parents=True, exist_ok=True)
        run._lock()
        if (run.path / "state.json").exists():  # another process started a run here since the first look
            run.close()
            raise ConfigError(f"{run.path} already holds a run; use `whale run --resume {run.path}` or another --out")
        atomic_write(run.path / "config.yaml", dump_config(cfg))
        atomic_write(run.path / "environment.json", json.dumps(environment_record(cfg), indent=1))
        run.trackers = Trackers.open(cfg, run.path)
        return run

    @classmethod
    def open(cls, path: str | Path) -> tuple["RunDir", Config, RunState | None]:
        """The run directory at `path`, its config, and its state (None if killed before its first save)."""
        run = cls(path)
        cfg_path = run.path / "config.yaml"
        if not cfg_path.exists():
            raise ConfigError(f"{run.path} is not a run directory (no config.yaml)")
        try:
            cfg = load_config(cfg_path)
        except ConfigError as e:
            raise ConfigError(f"{cfg_path} (the run's config): {e}") from None
        run._lock()
        state = run.load_state()
        run.ledger = Ledger.load(run.path / "ledger.jsonl", state.ledger if state else None)
        run.elapsed_before = state.elapsed_s if state else 0.0
        check_trackers(cfg.logging)
        run.trackers = Trackers.open(cfg, run.path)
        lost = run.count_inflight()
        if lost:
            run.ledger.count(f"lost-at-resume-{len(run.ledger.keys)}", "redone", lost)
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
    def load_state(self) -> RunState | None:
        return read_state(self.path)

    def save_state(self, state: RunState) -> None:
        """Stamp `state` with the ledger's snapshot, the elapsed time and the clock, and write it."""
        if not self.path.is_dir():  # else atomic_write would make a new run directory holding only state.json
            raise StorageError(f"the run directory {self.path} vanished while the run wrote to it: it was moved or "
                               "deleted; put it back")
        state.ledger = self.ledger.snapshot()
        state.elapsed_s = round(self.elapsed(), 2)
        state.updated = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_state(self.path, state)

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t0

    # ---------------------------------------------------------------- ledger
    def count(self, key: str, purpose: str, rollouts: int, **usage: int) -> str:
        """Count a finished batch of rollouts in the ledger (see `Ledger.count`); its episodes leave
        the in-flight journal, since the ledger now holds them."""
        counted_as = self.ledger.count(key, purpose, rollouts, **usage)
        self.clear_inflight()
        return counted_as

    def count_trajectories(self, key: str, purpose: str, trajectories: list) -> str:
        return self.count(key, purpose, len(trajectories), llm_calls=sum(len(t.calls) for t in trajectories),
                          prompt_tokens=sum(t.prompt_tokens for t in trajectories),
                          completion_tokens=sum(t.completion_tokens for t in trajectories))

    # ---------------------------------------------------------------- metrics
    def log(self, row: dict[str, Any]) -> None:
        row = {"time": round(self.elapsed(), 2), **row, "ledger": self.ledger.snapshot()}
        append_line(self.path / "metrics.jsonl", row)
        self.trackers.log(row)  # after the row is on disk: a tracker can fail, metrics.jsonl cannot
        kill_point(f"{row.get('event')}@{row.get('unit')}")

    def close(self) -> None:
        """Flush and close the trackers and let go of the run directory (the files need no closing)."""
        self.trackers.close()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock
            self._lock_file = None

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

    # ---------------------------------------------------------------- weights versions
    def weights_path(self, version: str) -> Path:
        return self.path / "weights" / version

    def weights_on_disk(self) -> list[str]:
        """Saved weights versions (`w<step>`), oldest first."""
        root = self.path / "weights"
        found = [d.name for d in root.iterdir() if d.is_dir() and version_step(d.name) is not None] \
            if root.exists() else []
        return sorted(found, key=version_step)

    def prune_weights(self, keep: set[str]) -> list[str]:
        """Delete every weights folder outside `keep` (and leftovers of an interrupted save), but
        never a version the saved state.json names (current or val-best): the caller saves the
        state naming a new version first, so a kill at any point here leaves a loadable run."""
        saved = self.load_state()
        if saved is not None:
            keep = set(keep) | {saved.weights_version} | ({saved.val_best.weights_version} if saved.val_best else set())
        root = self.path / "weights"
        doomed = [d for d in sorted(root.iterdir()) if d.is_dir() and d.name not in keep] if root.exists() else []
        if doomed:
            kill_point("prune")
        for d in doomed:
            shutil.rmtree(d, ignore_errors=True)
        return [d.name for d in doomed]


def read_state(run_dir: str | Path) -> RunState | None:
    """The run's state.json (None before the first save); a DamagedFile error if it is not the state
    WHALE writes (it replaces the file atomically, so another program or a copy broke it)."""
    p = Path(run_dir) / "state.json"
    return RunState.parse(p.read_bytes(), str(p)) if p.exists() else None


def write_state(run_dir: str | Path, state: RunState) -> None:
    atomic_write(Path(run_dir) / "state.json", state.to_json())


def version_step(version: str) -> int | None:
    """The step number of a weights version `w<step>` (ASCII digits); None for anything else
    ("base", "w3.tmp", "w²")."""
    digits = version[1:]
    return int(digits) if version.startswith("w") and digits.isascii() and digits.isdigit() else None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Metrics rows, keeping the last copy of each row a redone unit wrote again."""
    rows = read_jsonl_rows(Path(path) / "metrics.jsonl")
    keyed: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        keyed[(r.get("unit"), r.get("event"), r.get("split"), r.get("tag"), r.get("iteration"),
               r.get("candidate", r.get("id")))] = i
    keep = set(keyed.values())
    return [r for i, r in enumerate(rows) if i in keep or r.get("unit") is None]


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """Final / best / val-selected test mean@k of a run, from its metrics (used by report and compare)."""
    rows = read_metrics(run_dir)
    evals = [r for r in rows if r.get("event") == "eval"]
    test = [r for r in evals if r.get("split") == "test"]
    val = [r for r in evals if r.get("split") == "val"]
    selected = [r for r in rows if r.get("event") == "eval_selected" and r.get("split") == "test"]
    out: dict[str, Any] = {"initial": None, "final": None, "best": None, "val_selected": None}
    if test:
        out["initial"] = test[0]["mean_at_k"]
        out["final"] = test[-1]["mean_at_k"]
        out["best"] = max(r["mean_at_k"] for r in test)
    if val and test:
        best_val = max(val, key=lambda r: r["mean_at_k"])
        pair = (best_val.get("harness"), best_val.get("weights_version"))  # test may be measured at other tags
        same = [r for r in test + selected if r.get("tag") == best_val.get("tag")
                or (None not in pair and (r.get("harness"), r.get("weights_version")) == pair)]
        out["val_selected"] = same[-1]["mean_at_k"] if same else None
        out["val_selected_tag"] = best_val.get("tag")
    state = read_state(run_dir)
    out["ledger"] = state.ledger if state else {}
    out["seconds"] = state.elapsed_s if state else None
    out["harness_id"], out["weights_version"] = (state.harness_id, state.weights_version) if state else (None, None)
    return out


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (weights files are large)."""
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
            "model": cfg.model.name, "cpu_count": os.cpu_count(), "whale_commit": source_commit()}


def source_commit() -> str | None:
    """The git commit WHALE runs from ("+dirty" with uncommitted changes to tracked files), or None
    outside a git checkout: runs of one comparison made on several days say which code made them."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def fingerprint_model(path: str | Path) -> dict[str, str]:
    """sha256 of the weight files of a local model folder (skipped for hub ids)."""
    p = Path(path)
    if not p.is_dir():
        return {}
    return {f.name: file_sha256(f) for f in sorted(p.iterdir()) if f.suffix in (".safetensors", ".bin", ".gguf")}


def fingerprint_problems(splits: dict[str, list]) -> dict[str, str]:
    out = {}
    for name, problems in splits.items():
        h = hashlib.sha256()
        for p in problems:
            h.update(json.dumps([p.id, p.question, p.answer], sort_keys=True, default=str).encode())
        out[name] = f"{len(problems)}:{h.hexdigest()[:16]}"
    return out
