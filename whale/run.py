"""One experiment: the alternation of weight and harness phases, with evaluation and resume.

The schedule (schedule.py) decides which phase comes next; this file runs the phases with the
same runner, engine and archive for every condition (WHALE, weight-only, harness-only,
prompt-only, stagewise), and keeps the run directory consistent after every unit of work. Each
unit's resume logic lives with the module that does the work:

  unit                           | done when                          | after a kill                   | lives in
  -------------------------------|------------------------------------|--------------------------------|----------------
  weight step `w<step>`          | checkpoint + state (incl. the next | rows on disk: retrain only;    | weights/rsft.py
                                 | phase and pending evaluation)      | else redo                      |
  harness iteration `c<c>-h<i>`  | search state saved                 | evaluated candidates reused;   | harness/loop.py
                                 |                                    | archived proposals reused      |
  harness phase end `c<c>-accept`| accepted id + next phase + pending | the pending evaluation runs    | run.py
                                 | evaluation saved together          |                                |
  evaluation `eval-<tag>-<split>`| metrics row + state saved          | redone (pending marker kept)   | run_evals.py
  ledger batch                   | fsynced line in ledger.jsonl,      | a batch run again is `redone`  | store.py
                                 | before the batch's results         |                                |

A phase boundary is one unit: the state that ends a weight step or a harness phase already names
the next phase and, as `pending_eval`, the evaluation that closes it; that evaluation runs after
the save, and a resumed run finishes it before anything else. So a kill during a closing
evaluation never re-enters the phase it closed (docs/design.md, section 9).

"The state" is `RunState` (run_state.py), state.json typed; `RunRecord` (run_record.py) saves it
and names the unit in progress.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from whale.config import Config, ConfigError
from whale.domains import load_domain
from whale.engine.default_model import resolve_model_path
from whale.evaluate import Evaluator
from whale.harness.archive import Archive
from whale.harness.loop import HarnessSearch
from whale.harness.proposers import make_proposer
from whale.harness.validate import static_check
from whale.memory_probe import MemoryProbe, memory_log_on
from whale.rollout.runner import derive_seed
from whale.run_evals import RunEvals
from whale.run_record import RunRecord
from whale.run_state import PendingEval, Phase, RunState
from whale.schedule import Schedule
from whale.store import RunDir, fingerprint_model, fingerprint_problems, load_summary
from whale.weights.patience import WeightPatience
from whale.weights.rsft import RSFT, ProblemStream
from whale.weights.versions import WeightVersions

__all__ = ["Experiment", "load_summary", "run_experiment"]  # load_summary moved to store.py; kept here for callers

console = Console(stderr=True)


def run_experiment(cfg: Config | None, out: str | Path | None = None, resume: str | Path | None = None) -> Path:
    state: RunState | None = None  # a new run's state is made by Experiment
    if resume is not None:
        run, saved_cfg, state = RunDir.open(resume)
        if cfg is not None:
            run.check_config(cfg)
        cfg = saved_cfg
        if state is not None and state.finished:
            console.print(f"{run.path} is already finished")
            run.close()
            return run.path
        check_proposer(cfg)
    else:
        assert cfg is not None
        check_proposer(cfg)  # before the run directory exists: a fixed config can start it afresh
        run = RunDir.create(out or Path("runs") / cfg.name, cfg)
    try:
        exp = Experiment(cfg, run, state)
        try:
            exp.run()
        finally:
            exp.close()
    finally:
        run.close()  # the trackers
    return run.path


def check_proposer(cfg: Config) -> None:
    """Build the configured proposer once, up front: a missing agent CLI or sandbox is a config
    error at `whale run`, not a crash at the first harness phase an hour in."""
    if cfg.schedule.kind != "weight_only":
        make_proposer(cfg)


def check_split_sizes(cfg: Config, splits: dict[str, list]) -> None:
    """The splits hold what the schedule asks of them, checked before the engine starts: a weight
    step's problems, a harness phase's problems, and every split evaluated."""
    needs = [("weight", cfg.weight.problems_per_step, "weight.problems_per_step")]
    if cfg.schedule.kind != "weight_only":
        needs.append(("harness", 1, f"schedule.kind {cfg.schedule.kind} (a harness phase)"))
    needs += [(split, 1, "eval.splits") for split in cfg.eval.splits + (cfg.eval.intermediate_splits or [])]
    for split, least, asked_by in needs:
        if split not in splits:
            raise ConfigError(f"{asked_by} names split {split!r}, which the domain does not have "
                              f"(it has {', '.join(splits)})")
        if len(splits[split]) < least:
            raise ConfigError(f"the {split} split has {len(splits[split])} problems and {asked_by} needs at least "
                              f"{least}; enlarge domain.splits.{split} (or the data) or lower what needs them")



class Experiment:
    """One run. Construction takes these steps, in order, each a method below: the data (refused
    if it changed since the run started), the engine (and, for a new run, the model's
    fingerprint), the runner, the archive (h0 and a user's initial harness), the weight-phase
    state (problem stream, patience), the schedule, a new run's state, and the weights state.json
    names. Its parts: `record` (the unit in progress, metrics rows, state saves), `evals` (the
    run's evaluations, run_evals.py), `weights` (trainer, restore, pruning, weights/versions.py)."""

    def __init__(self, cfg: Config, run: RunDir, state: RunState | None):
        self.cfg = cfg
        self.run_dir = run
        domain, splits = self._load_data(state)
        model_print = self._fingerprint_model() if state is None else {}
        self.evaluator = Evaluator(cfg, domain, splits)  # the engine and the runner every phase uses
        self.domain, self.splits = domain, splits
        self.engine, self.runner = self.evaluator.engine, self.evaluator.runner
        self.runner.journal = lambda t: self.run_dir.journal(self.record.unit, t)
        self.archive = self._open_archive()
        self.stream, self.patience = self._weight_phase_state(state)
        self.schedule = self._make_schedule()
        self.state = state or self._new_state(model_print)
        self.record = RunRecord(run, self.state, self.engine, self.stream, self.patience)
        self.weights = WeightVersions(cfg, run, self.engine)
        if memory_log_on():
            self.record.probe = MemoryProbe(run.path / "memory.jsonl", self.engine, self.weights)
        self.evals = RunEvals(cfg, self.evaluator, self.archive, self.weights, self.record)
        self.search: HarnessSearch | None = None  # the harness phase in progress
        self._batches: dict[str, int] = {}  # search ledger keys seen in this process (see _count_search)
        if self.state.weights_version != "base":
            self.weights.restore(self.state.weights_version)

    # ------------------------------------------------------------------ construction
    def _load_data(self, state: RunState | None) -> tuple[Any, dict[str, list]]:
        domain = load_domain(self.cfg)
        splits = domain.load_splits()
        check_split_sizes(self.cfg, splits)
        if state is not None and state.data_fingerprints and state.data_fingerprints != fingerprint_problems(splits):
            raise ConfigError("the data splits differ from those the run started with (data files or "
                              "loaders changed); start a new run")
        return domain, splits

    def _fingerprint_model(self) -> dict[str, str]:
        local = self.cfg.model.backend in ("hf", "vllm")
        return fingerprint_model(resolve_model_path(self.cfg.model.name)) if local else {}

    def _open_archive(self) -> Archive:
        """The archive with h0. Idempotent: a kill before the first state save finds it on disk."""
        archive = Archive(self.run_dir.path)
        if "h0" not in archive.ids():
            archive.add_candidate(self.domain.base_harness(), parent=None, proposer="base",
                                  hypothesis="the domain's base harness h0", mechanism="base")
        return archive

    def _starting_harness(self) -> str:
        """A new run's harness: the user's `harness.initial` (a child of h0), else h0. Idempotent: a
        kill before the first state save finds the user's harness in the archive and reuses it."""
        initial = self.cfg.harness.initial
        if not initial:
            return "h0"
        users = [m["id"] for m in self.archive.all_meta() if m["proposer"] == "user"]
        return users[0] if users else self._add_initial_harness(Path(initial))

    def _add_initial_harness(self, src_path: Path) -> str:
        if not src_path.is_file():
            raise ConfigError(f"harness.initial: no such file {src_path}")
        source = src_path.read_text()
        problem = static_check(source, self.cfg)
        if problem:
            raise ConfigError(f"harness.initial {src_path}: {problem}")
        hid = self.archive.add_candidate(source, parent="h0", proposer="user",
                                         hypothesis=f"the user's starting harness {src_path.name}", mechanism="user")
        self.archive.update_meta(hid, status="valid")
        return hid

    def _weight_phase_state(self, state: RunState | None) -> tuple[ProblemStream, WeightPatience]:
        cfg = self.cfg
        stream = ProblemStream(self.splits["weight"], cfg.weight.problems_per_step, seed=cfg.seed)
        if state is not None and state.stream:
            stream.load_state_dict(state.stream)
        p = cfg.schedule.weight_patience
        patience = WeightPatience(p.window, p.burn_in, p.patience)
        if state is not None and state.patience:
            patience.load_state_dict(state.patience)
        return stream, patience

    def _make_schedule(self) -> Schedule:
        return Schedule.for_config(self.cfg, self.stream.steps_per_epoch, len(self.splits["harness"]))

    def _new_state(self, model_print: dict[str, str]) -> RunState:
        """A new run's state: the schedule's first phase, the starting harness, base weights, and the
        initial evaluation pending."""
        first = self.schedule.first_phase()
        return RunState(data_fingerprints=fingerprint_problems(self.splits), model_fingerprint=model_print,
                        phase=first, harness_id=self._starting_harness(),
                        pending_eval=PendingEval(tag="initial", phase=first, cycle=0))

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        try:
            self.weights.close()
        finally:
            self.evaluator.close()

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        st = self.state
        console.print(f"[bold]{self.cfg.name}[/]: schedule {self.schedule.kind}"
                      f"{' (adaptive)' if self.cfg.schedule.adaptive else ''}, domain {self.domain.name}, "
                      f"run dir {self.run_dir.path}")
        self.record.save()
        self.evals.finish_pending()  # the initial evaluation, or the one a kill cut short
        while st.phase != "done":
            if st.phase == "weight":
                self.weight_phase()
            else:
                self.harness_phase()
        self.evals.evaluate_val_best()
        self.record.unit = "end"
        self.record.log("run_end", seconds=round(self.run_dir.elapsed(), 1))
        st.finished = True
        self.record.save()

    def _end_phase(self, tag: str, next_phase: Phase) -> None:
        """Mark a phase boundary in the state (the caller saves it as one unit with the phase's last
        work): the next phase, and the evaluation that closes this one as `pending_eval`."""
        st = self.state
        if self.cfg.eval.at_phase_ends:
            st.pending_eval = self.evals.marker(tag, last=next_phase == "done")
        elif next_phase == "done":
            st.pending_eval = self.evals.marker("final")
        st.phase = next_phase

    # ------------------------------------------------------------------ weight phase
    def weight_phase(self) -> None:
        st, p = self.state, self.state.progress
        hid = st.harness_id
        rsft = RSFT(self.runner, self.weights.ensure_trainer(), self.engine, self.cfg.weight, self.stream,
                    self.archive.source(hid), hid, self.run_dir.path / "rows",
                    weights_dir=self.run_dir.path / "weights", on_rollouts=self._count_weight_rollouts,
                    colocated=self.cfg.model.colocate)
        while st.phase == "weight":
            if p.phase_steps == 0:  # a new weight phase, also right after another one (kind gain)
                self.patience.reset()
                p.phase_accept_rates = []
                p.phase_start_rollouts = self.run_dir.ledger.budget_rollouts
                console.print(f"[cyan]weight phase[/] (cycle {st.cycle}, harness {hid})")
            self._weight_step(rsft)
            self.record.save()  # the step, its checkpoint's name, the next phase and a pending evaluation: one unit
            self.weights.prune(st)
            self.evals.finish_pending()

    def _weight_step(self, rsft: RSFT) -> None:
        st, p = self.state, self.state.progress
        step = p.weight_steps
        self.record.unit = f"w{step}"
        result = rsft.step(step, seed=derive_seed(self.cfg.seed, "weight", step))
        if result.resumed:
            console.print(f"  step {step}: resumed from saved rows (rollouts not redone)")
        p.weight_steps += 1
        p.phase_steps += 1
        self.patience.update(result.accept_rate)
        p.phase_accept_rates.append(result.accept_rate)
        p.patience_stop = self.patience.should_stop()
        if result.weights_version:
            st.weights_version = result.weights_version
        self.record.log("weight_step", **result.to_json())
        console.print(f"  step {step}: accept {result.accept_rate:.3f} ({result.accepted}/{result.rollouts}), "
                      f"rows {result.rows}, loss {result.loss if result.loss is None else round(result.loss, 4)}, "
                      f"gen {result.gen_seconds:.0f}s train {result.train_seconds:.0f}s  ({result.reason})")
        self.record.sync_progress()
        if self.schedule.weight_phase_over(p):
            self.record.log("phase_gain", **self.schedule.record_weight_phase(p))
            nxt = self.schedule.after_weight_phase(p)
            if nxt != "weight_more":
                if st.weights_version != "base" and st.weights_version not in st.phase_end_weights:
                    st.phase_end_weights.append(st.weights_version)  # kept for `whale matrix`
                self._end_phase(f"w{p.weight_steps}", nxt)
                p.phase_steps = 0
                return
        # every N steps, also in a phase extended step by step (`weight_more`), which used to skip them
        if self.cfg.eval.every_steps and p.weight_steps % self.cfg.eval.every_steps == 0:
            st.pending_eval = self.evals.marker(f"w{p.weight_steps}")

    def _count_weight_rollouts(self, meta: dict[str, Any]) -> None:
        self.run_dir.count(f"w{meta['step']}", "weight", meta["rollouts"], llm_calls=meta["llm_calls"],
                           prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"])

    # ------------------------------------------------------------------ harness phase
    def harness_phase(self) -> None:
        st, p = self.state, self.state.progress
        cfg = self.cfg
        if self.schedule.prompt_only and not cfg.harness.prompt_only:
            cfg = cfg.model_copy(deep=True)
            cfg.harness.prompt_only = True
        search = self.search = HarnessSearch(cfg, self.domain, self.runner, self.archive, make_proposer(cfg),
                                             ledger_callback=self._count_search, splits=self.splits)
        if st.search:
            search.load_state_dict(st.search)
        else:
            p.phase_start_rollouts = self.run_dir.ledger.budget_rollouts
            console.print(f"[magenta]harness phase[/] (cycle {st.cycle}, incoming {st.harness_id}, "
                          f"weights {st.weights_version})")
        iterations = None if cfg.schedule.adaptive else self.schedule.harness_iterations_planned()
        self.record.unit = f"c{st.cycle}-h"
        result = search.run_phase(st.harness_id, st.weights_version, iterations, adaptive=cfg.schedule.adaptive,
                                  on_iteration=self._on_iteration, should_stop=self._harness_should_stop,
                                  can_spend=self._can_spend)
        self.search = None
        st.harness_id = result.accepted_id
        st.search = None
        p.harness_phases += 1
        self.record.unit = f"c{st.cycle}-accept"
        self.record.log("harness_accepted", accepted=result.accepted_id, iterations=result.iterations,
                        gain=result.gain)
        console.print(f"  accepted harness {result.accepted_id} after {result.iterations} iterations")
        self.record.sync_progress()
        self.record.log("phase_gain", **self.schedule.record_harness_phase(p, result.gain))
        self._end_phase(f"c{st.cycle}-h", self.schedule.after_harness_phase(p))
        st.cycle += 1
        self.record.save()  # the accepted harness, the next phase and the pending evaluation: one unit
        self.evals.finish_pending()

    def _on_iteration(self, row: dict[str, Any]) -> None:
        """A harness iteration's metrics row (and its proposer's spending): a unit, saved with the
        search's state."""
        assert self.search is not None
        st = self.state
        self.record.unit = f"c{st.cycle}-h{row.get('iteration', '?')}"
        st.progress.harness_iterations += 1 if row.get("event") == "iteration_end" else 0
        if row.get("event") in ("proposer_usage", "proposer_failure"):  # a failed round spends too
            usage = row.get("usage") or {}
            self.run_dir.ledger.add_proposer(f"{self.record.unit}:proposer", float(usage.get("seconds", 0.0)),
                                             int(usage.get("tokens", 0)), float(usage.get("cost_usd", 0.0)))
        if row.get("event") in ("proposer_budget", "proposer_exhausted"):
            console.print(f"  {row['reason']}")
        self.record.log(row.get("event", "harness"), **{k: v for k, v in row.items() if k != "event"})
        st.search = self.search.state_dict()
        self.record.save()

    def _harness_should_stop(self) -> bool:
        self.record.sync_progress()
        return self.schedule.harness_phase_over(self.state.progress, 0)

    def _can_spend(self, rollouts: int) -> bool:
        self.record.sync_progress()
        return self.schedule.can_spend(self.state.progress, rollouts)

    def _count_search(self, purpose: str, trajectories: list) -> None:
        """Key a search batch by the candidate and weights it measured, in this harness phase; the
        n-th batch of the same key (a null probe has two) gets `#n`. Work redone after a kill
        repeats its keys from #0, so the ledger records it as redone."""
        assert self.search is not None
        base = f"c{self.state.cycle}:{purpose}:{self.search.subject}@{self.state.weights_version}"
        n = self._batches.get(base, 0)
        self._batches[base] = n + 1
        self.run_dir.count_trajectories(f"{base}#{n}", purpose, trajectories)
