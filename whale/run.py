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
  evaluation `eval-<tag>-<split>`| metrics row + state saved          | redone (pending marker kept)   | run.py
  ledger batch                   | fsynced line in ledger.jsonl,      | a batch run again is `redone`  | store.py
                                 | before the batch's results         |                                |

A phase boundary is one unit: the state that ends a weight step or a harness phase already names
the next phase and, as `pending_eval`, the evaluation that closes it; that evaluation runs after
the save, and a resumed run finishes it before anything else. So a kill during a closing
evaluation never re-enters the phase it closed (docs/design.md, section 9).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from whale.config import Config, ConfigError
from whale.domains import load_domain
from whale.engine.default_model import resolve_model_path
from whale.evaluate import Evaluator
from whale.rollout.runner import derive_seed
from whale.schedule import Progress, Schedule
from whale.harness.archive import Archive
from whale.harness.loop import HarnessSearch
from whale.harness.proposers import make_proposer
from whale.harness.validate import static_check
from whale.engine.hf import HFEngine
from whale.store import RunDir, append_line, fingerprint_model, fingerprint_problems, load_summary, read_metrics
from whale.weights.patience import WeightPatience
from whale.weights.distributed import TrainGroup
from whale.weights.rsft import RSFT, ProblemStream
from whale.weights.from_disk import training_model
from whale.weights.trainer import Trainer
from whale.sysmem import descendants, heap_stats, peak_rss_kb, process_memory

MEMORY_LOG = os.environ.get("WHALE_MEMORY_LOG") == "1"  # memory.jsonl: see Experiment._log_memory

__all__ = ["Experiment", "load_summary", "run_experiment"]  # load_summary moved to store.py; kept here for callers

console = Console(stderr=True)


def run_experiment(cfg: Config | None, out: str | Path | None = None, resume: str | Path | None = None) -> Path:
    if resume is not None:
        run, saved_cfg, state = RunDir.open(resume)
        if cfg is not None:
            run.check_config(cfg)
        cfg = saved_cfg
        if state.get("finished"):
            console.print(f"{run.path} is already finished")
            return run.path
        check_proposer(cfg)
    else:
        assert cfg is not None
        check_proposer(cfg)  # before the run directory exists: a fixed config can start it afresh
        run = RunDir.create(out or Path("runs") / cfg.name, cfg)
        state = {}
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
    if it changed since the run started), the engine (and the model's fingerprint), the runner,
    the archive (h0 and a user's initial harness), the weight-phase state (problem stream,
    patience), the schedule, the state's defaults, and the weights state.json names."""

    def __init__(self, cfg: Config, run: RunDir, state: dict[str, Any]):
        self.cfg = cfg
        self.run_dir = run
        self.state = state
        self.unit = "start"
        domain, splits = self._load_data()
        self._fingerprint_model()
        self.evaluator = Evaluator(cfg, domain, splits)  # the engine and the runner every phase uses
        self.domain, self.splits = domain, splits
        self.engine, self.runner = self.evaluator.engine, self.evaluator.runner
        self.runner.journal = lambda t: self.run_dir.journal(self.unit, t)
        self.archive = self._open_archive()
        self.stream, self.patience = self._weight_phase_state()
        self.schedule = self._make_schedule()
        self.progress = Progress(**state.get("progress", {}))
        self._state_defaults()
        self.trainer: Trainer | TrainGroup | None = None
        self._batches: dict[str, int] = {}  # search ledger keys seen in this process (see _count_search)
        self._recoveries_logged = 0  # of engine.recoveries (see _log_recoveries)
        if state["weights_version"] != "base":
            self._restore_weights(state["weights_version"])

    # ------------------------------------------------------------------ construction
    def _load_data(self) -> tuple[Any, dict[str, list]]:
        domain = load_domain(self.cfg)
        splits = domain.load_splits()
        check_split_sizes(self.cfg, splits)
        prints = fingerprint_problems(splits)
        if self.state.get("data_fingerprints") and self.state["data_fingerprints"] != prints:
            raise ConfigError("the data splits differ from those the run started with (data files or "
                              "loaders changed); start a new run")
        self.state.setdefault("data_fingerprints", prints)
        return domain, splits

    def _fingerprint_model(self) -> None:
        if "model_fingerprint" not in self.state:
            local = self.cfg.model.backend in ("hf", "vllm")
            self.state["model_fingerprint"] = fingerprint_model(resolve_model_path(self.cfg.model.name)) if local else {}

    def _open_archive(self) -> Archive:
        """The archive with h0, and the user's `harness.initial` (a child of h0) as the starting
        harness. Idempotent: a kill before the first state save finds them on disk and reuses them."""
        archive = Archive(self.run_dir.path)
        if "h0" not in archive.ids():
            archive.add_candidate(self.domain.base_harness(), parent=None, proposer="base",
                                  hypothesis="the domain's base harness h0", mechanism="base")
        initial = self.cfg.harness.initial
        if initial and "harness_id" not in self.state:
            users = [m["id"] for m in archive.all_meta() if m["proposer"] == "user"]
            self.state["harness_id"] = users[0] if users else self._add_initial_harness(archive, Path(initial))
        return archive

    def _add_initial_harness(self, archive: Archive, src_path: Path) -> str:
        if not src_path.is_file():
            raise ConfigError(f"harness.initial: no such file {src_path}")
        source = src_path.read_text()
        problem = static_check(source, self.cfg)
        if problem:
            raise ConfigError(f"harness.initial {src_path}: {problem}")
        hid = archive.add_candidate(source, parent="h0", proposer="user",
                                    hypothesis=f"the user's starting harness {src_path.name}", mechanism="user")
        archive.update_meta(hid, status="valid")
        return hid

    def _weight_phase_state(self) -> tuple[ProblemStream, WeightPatience]:
        cfg = self.cfg
        stream = ProblemStream(self.splits["weight"], cfg.weight.problems_per_step, seed=cfg.seed)
        if self.state.get("stream"):
            stream.load_state_dict(self.state["stream"])
        p = cfg.schedule.weight_patience
        patience = WeightPatience(p.window, p.burn_in, p.patience)
        if self.state.get("patience"):
            patience.load_state_dict(self.state["patience"])
        return stream, patience

    def _make_schedule(self) -> Schedule:
        return Schedule.for_config(self.cfg, self.stream.steps_per_epoch, len(self.splits["harness"]))

    def _state_defaults(self) -> None:
        st = self.state
        st.setdefault("phase", self.schedule.first_phase())
        st.setdefault("cycle", 0)
        st.setdefault("harness_id", "h0")
        st.setdefault("weights_version", "base")
        st.setdefault("evals_done", [])
        st.setdefault("pending_eval", self._eval_marker("initial"))

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        try:
            if self.trainer is not None:
                self.trainer.close()
        finally:
            self.evaluator.close()

    def save(self) -> None:
        self._log_recoveries()
        self._sync_progress()
        self.state["progress"] = dict(self.progress.__dict__)
        self.state["stream"] = self.stream.state_dict()
        self.state["patience"] = self.patience.state_dict()
        self.run_dir.save_state(self.state)

    def _log_recoveries(self) -> None:
        """An `engine_recovered` row per server recovery since the last unit (Engine.recoveries):
        which unit it hit and why, so an incident is in metrics.jsonl, not only on stderr."""
        recoveries = self.engine.recoveries
        for n in range(self._recoveries_logged, len(recoveries)):
            self.log("engine_recovered", id=f"recovery-{n}", reason=recoveries[n].reason, ok=recoveries[n].ok)
        self._recoveries_logged = len(recoveries)

    def _sync_progress(self) -> None:
        """The schedule decides on the ledger as it is now (ledger.jsonl is ahead of state.json)."""
        self.progress.budget_rollouts = self.run_dir.ledger.budget_rollouts

    def log(self, event: str, **row: Any) -> None:
        self.run_dir.log({"unit": self.unit, "event": event, "phase": self.state["phase"],
                          "cycle": self.state["cycle"], "step": self.progress.weight_steps,
                          "harness": self.state["harness_id"], "weights_version": self.state["weights_version"],
                          **row})
        if MEMORY_LOG:
            self._log_memory(event)

    def _log_memory(self, event: str) -> None:
        """A row of where resident memory is, in memory.jsonl (WHALE_MEMORY_LOG=1; docs/performance.md):
        this process (PSS, anonymous, peak RSS since the last row, glibc's heap, threads), what the
        hf engine holds, the trainer's optimizer state, and the child processes' PSS by name."""
        mib = 1 << 20
        row: dict[str, Any] = {"event": event, "unit": self.unit, "t": round(self.run_dir.elapsed(), 1),
                               **{k: v // 1024 for k, v in process_memory().items()},
                               "peak_rss": peak_rss_kb(reset=True) // 1024, **heap_stats(),
                               "threads": len(os.listdir("/proc/self/task"))}
        if isinstance(self.engine, HFEngine):
            row.update({k: v // mib for k, v in self.engine.memory_bytes().items()})
        if isinstance(self.trainer, Trainer):
            row["optimizer"] = sum(t.nbytes for st in self.trainer.optimizer.state.values()
                                   for t in st.values() if isinstance(t, torch.Tensor)) // mib
        children: dict[str, int] = {}
        for pid in descendants():
            try:
                name = open(f"/proc/{pid}/comm").read().strip()
            except OSError:
                continue
            children[name] = children.get(name, 0) + process_memory(pid).get("pss", 0) // 1024
        row["children_pss"] = children
        append_line(self.run_dir.path / "memory.jsonl", row)

    def harness_source(self, cid: str) -> str:
        return self.archive.source(cid)

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        st = self.state
        console.print(f"[bold]{self.cfg.name}[/]: schedule {self.schedule.kind}"
                      f"{' (adaptive)' if self.cfg.schedule.adaptive else ''}, domain {self.domain.name}, "
                      f"run dir {self.run_dir.path}")
        self.save()
        self.finish_pending_eval()  # the initial evaluation, or the one a kill cut short
        while st["phase"] != "done":
            if st["phase"] == "weight":
                self.weight_phase()
            elif st["phase"] == "harness":
                self.harness_phase()
            else:
                raise ValueError(f"corrupt state.json: unknown phase {st['phase']!r}")
        self.evaluate_val_best()
        self.unit = "end"
        self.log("run_end", seconds=round(self.run_dir.elapsed(), 1))
        st["finished"] = True
        self.save()

    def _end_phase(self, tag: str, next_phase: str) -> None:
        """Mark a phase boundary in the state (the caller saves it as one unit with the phase's last
        work): the next phase, and the evaluation that closes this one as `pending_eval`."""
        st = self.state
        if self.cfg.eval.at_phase_ends:
            st["pending_eval"] = self._eval_marker(tag, last=next_phase == "done")
        elif next_phase == "done":
            st["pending_eval"] = self._eval_marker("final")
        st["phase"] = next_phase

    # ------------------------------------------------------------------ evaluation
    def _eval_marker(self, tag: str, last: bool = False) -> dict[str, Any]:
        """A pending evaluation; it keeps the phase and cycle it closes for its metrics rows.
        `last`: it closes the run, so it measures every split (`eval.intermediate_splits` spares
        only the evaluations in between)."""
        return {"tag": tag, "phase": self.state["phase"], "cycle": self.state["cycle"], "last": last}

    def finish_pending_eval(self) -> None:
        pending = self.state.get("pending_eval")
        if not pending:
            return
        self.evaluate_pair(pending)
        self.state["pending_eval"] = None
        self.save()

    def evaluate_pair(self, pending: dict[str, Any]) -> None:
        """Evaluate the current (harness, weights) on every eval split; one unit per split."""
        st, tag = self.state, pending["tag"]
        hid, version = st["harness_id"], st["weights_version"]
        splits = self.cfg.eval.splits
        if tag not in ("initial", "final") and not pending.get("last") and self.cfg.eval.intermediate_splits is not None:
            splits = self.cfg.eval.intermediate_splits
        last = st.setdefault("last_eval_pairs", {})
        for split in splits:
            unit = f"eval-{tag}-{split}"
            if unit in st["evals_done"] or (tag != "initial" and last.get(split) == [hid, version]):
                continue  # done, or the split's last evaluation measured this very (harness, weights) pair
                # with the same seeds (a phase that changed nothing): it would only repeat that result
            result = self._evaluate_split(unit, split, hid, version)
            self.log("eval", split=split, tag=tag, phase=pending["phase"], cycle=pending["cycle"],
                     **self._eval_row(result))
            if split == "val":
                best = st.get("val_best")
                if best is None or result.mean_at_k > best["mean_at_k"]:
                    st["val_best"] = {"mean_at_k": result.mean_at_k, "unit": unit, "tag": tag,
                                      "harness_id": hid, "weights_version": version}
            st["evals_done"].append(unit)
            st["last_eval_pair"] = last[split] = [hid, version]
            self.save()
            self.prune_weights()  # a new val-best may free the old one

    def _evaluate_split(self, unit: str, split: str, hid: str, version: str):
        """One evaluation unit: harness `hid` under the weights the engine serves (`version`)."""
        self.unit = unit
        result, trajs = self.evaluator.measure(self.harness_source(hid), split, harness_id=hid,
                                               progress=f"eval {split} ({hid}, {version})",
                                               traces_path=self.run_dir.path / "evals" / f"{unit}.jsonl")
        self.run_dir.count_trajectories(unit, "eval", trajs)
        console.print(f"  {unit}: mean@{result.k} {result.mean_at_k:.3f} "
                      f"[{result.ci95[0]:.3f}, {result.ci95[1]:.3f}] pass@{result.k} {result.pass_at_k:.3f}")
        return result

    @staticmethod
    def _eval_row(result) -> dict[str, Any]:
        summary = {k: v for k, v in result.to_json().items() if k not in ("split", "harness_id", "weights_version")}
        return {**summary, "per_problem": result.per_problem}

    def evaluate_val_best(self) -> None:
        """Model selection by validation, measured: the val-best (harness, weights) of the run on the
        eval splits other than val, when no evaluation of the run measured that pair there (the
        final one measures the pair the run ends on; intermediate ones may skip test). Logged as
        event `eval_selected`, which curves, attributions and the final-vs-final differences do not
        read, so they stay as they were; `load_summary` reads it for the val-selected column. Why:
        without it a run whose val peaked between phase ends has no val-selected test number.
        The val-best weights are on disk (`weights_needed` keeps them); base weights are not, so a
        val-best at base under trained weights is measured only if a base evaluation measured it."""
        st, best = self.state, self.state.get("val_best")
        if not self.cfg.eval.test_at_val_best or not best:
            return
        hid, version = best["harness_id"], best["weights_version"]
        measured = {(r.get("split"), r.get("harness"), r.get("weights_version"))
                    for r in read_metrics(self.run_dir.path) if r.get("event") in ("eval", "eval_selected")}
        todo = [s for s in self.cfg.eval.splits if s != "val" and (s, hid, version) not in measured
                and f"eval-val_best-{s}" not in st["evals_done"]]
        if not todo:
            return
        if version != self.engine.weights_version:
            if version == "base":
                console.print(f"[yellow]val-best[/] ({hid}, base) not measured on {todo}: base weights are not kept")
                return
            self._restore_weights(version)
        for split in todo:
            unit = f"eval-val_best-{split}"
            result = self._evaluate_split(unit, split, hid, version)
            self.log("eval_selected", split=split, tag="val_best", harness=hid, weights_version=version,
                     selected_by=best["unit"], **self._eval_row(result))
            st["evals_done"].append(unit)
            self.save()

    # ------------------------------------------------------------------ weights on disk
    def _ensure_trainer(self) -> Trainer | TrainGroup:
        if self.trainer is None:
            sync = self.engine.weight_sync
            if sync not in ("in_place", "from_disk"):
                raise ConfigError(f"model.backend {self.cfg.model.backend!r} serves inference only; "
                                  "weight phases need backend hf or vllm")
            if self.cfg.compute.train_ranks > 1:  # ranks in their own processes; the engine loads rank 0's saves
                self.trainer = TrainGroup(self.cfg)
                return self.trainer
            if sync == "in_place":  # hf: train the served model object itself, no copy
                model, tokenizer = self.engine.model, self.engine.tokenizer
            else:  # vLLM: train an hf copy; RSFT saves adapters, the server loads them
                model, tokenizer = training_model(self.cfg)
            self.trainer = Trainer(model, tokenizer, self.cfg.weight, seed=self.cfg.seed,
                                   temperature=max(self.cfg.sampling.temperature, 1e-3))
            if sync == "in_place":
                self.trainer.attach(self.engine)
        return self.trainer

    def _restore_weights(self, version: str) -> None:
        path = self.run_dir.weights_path(version)
        if not path.exists():
            raise ConfigError(f"state.json names weights {version} but {path} is missing")
        trainer = self._ensure_trainer()
        trainer.load(path)
        in_place = self.engine.weight_sync == "in_place" and trainer.in_process
        self.engine.load_weights(None if in_place else str(path), version)

    def weights_needed(self) -> set[str]:
        """Versions kept on disk: the current one (resume loads it), the val-best (selection), each
        weight phase's end (the columns of `whale matrix`);
        with LoRA also the last `weight.keep_versions` adapters (small). Full fine-tuning keeps no
        others: each of its checkpoints holds the whole model and the optimizer state."""
        keep = {self.state["weights_version"], *self.state.get("phase_end_weights", [])}
        if self.state.get("val_best"):
            keep.add(self.state["val_best"]["weights_version"])
        n = self.cfg.weight.keep_versions
        if self.cfg.weight.finetune == "lora" and n > 0:
            keep.update(self.run_dir.weights_on_disk()[-n:])
        return keep

    def prune_weights(self) -> None:
        """Called only after a save, so state.json already names every version still needed."""
        self.run_dir.prune_weights(self.weights_needed())

    # ------------------------------------------------------------------ weight phase
    def weight_phase(self) -> None:
        st = self.state
        hid = st["harness_id"]
        rsft = RSFT(self.runner, self._ensure_trainer(), self.engine, self.cfg.weight, self.stream,
                    self.harness_source(hid), hid, self.run_dir.path / "rows",
                    weights_dir=self.run_dir.path / "weights", on_rollouts=self._count_weight_rollouts,
                    colocated=self.cfg.model.colocate)
        while st["phase"] == "weight":
            if self.progress.phase_steps == 0:  # a new weight phase, also right after another one (kind gain)
                self.patience.reset()
                self.progress.phase_accept_rates = []
                self.progress.phase_start_rollouts = self.run_dir.ledger.budget_rollouts
                console.print(f"[cyan]weight phase[/] (cycle {st['cycle']}, harness {hid})")
            self._weight_step(rsft)
            self.save()  # the step, its checkpoint's name, the next phase and a pending evaluation: one unit
            self.prune_weights()
            self.finish_pending_eval()

    def _weight_step(self, rsft: RSFT) -> None:
        st, p = self.state, self.progress
        step = p.weight_steps
        self.unit = f"w{step}"
        result = rsft.step(step, seed=derive_seed(self.cfg.seed, "weight", step))
        if result.resumed:
            console.print(f"  step {step}: resumed from saved rows (rollouts not redone)")
        p.weight_steps += 1
        p.phase_steps += 1
        self.patience.update(result.accept_rate)
        p.phase_accept_rates.append(result.accept_rate)
        p.patience_stop = self.patience.should_stop()
        if result.weights_version:
            st["weights_version"] = result.weights_version
        self.log("weight_step", **result.to_json())
        console.print(f"  step {step}: accept {result.accept_rate:.3f} ({result.accepted}/{result.rollouts}), "
                      f"rows {result.rows}, loss {result.loss if result.loss is None else round(result.loss, 4)}, "
                      f"gen {result.gen_seconds:.0f}s train {result.train_seconds:.0f}s  ({result.reason})")
        self._sync_progress()
        if self.schedule.weight_phase_over(p):
            self.log("phase_gain", **self.schedule.record_weight_phase(p))
            nxt = self.schedule.after_weight_phase(p)
            if nxt != "weight_more":
                if st["weights_version"] != "base" and st["weights_version"] not in st.setdefault("phase_end_weights", []):
                    st["phase_end_weights"].append(st["weights_version"])  # kept for `whale matrix`
                self._end_phase(f"w{p.weight_steps}", nxt)
                p.phase_steps = 0
                return
        # every N steps, also in a phase extended step by step (`weight_more`), which used to skip them
        if self.cfg.eval.every_steps and p.weight_steps % self.cfg.eval.every_steps == 0:
            st["pending_eval"] = self._eval_marker(f"w{p.weight_steps}")

    def _count_weight_rollouts(self, meta: dict[str, Any]) -> None:
        self.run_dir.count(f"w{meta['step']}", "weight", meta["rollouts"], llm_calls=meta["llm_calls"],
                           prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"])

    # ------------------------------------------------------------------ harness phase
    def harness_phase(self) -> None:
        st = self.state
        cfg = self.cfg
        if self.schedule.prompt_only and not cfg.harness.prompt_only:
            cfg = cfg.model_copy(deep=True)
            cfg.harness.prompt_only = True
        search = HarnessSearch(cfg, self.domain, self.runner, self.archive, make_proposer(cfg),
                               ledger_callback=lambda purpose, trajs: self._count_search(search, purpose, trajs),
                               splits=self.splits)
        if st.get("search"):
            search.load_state_dict(st["search"])
        else:
            self.progress.phase_start_rollouts = self.run_dir.ledger.budget_rollouts
            console.print(f"[magenta]harness phase[/] (cycle {st['cycle']}, incoming {st['harness_id']}, "
                          f"weights {st['weights_version']})")
        iterations = None if cfg.schedule.adaptive else self.schedule.harness_iterations_planned()

        def on_iteration(row: dict[str, Any]) -> None:
            self.unit = f"c{st['cycle']}-h{row.get('iteration', '?')}"
            self.progress.harness_iterations += 1 if row.get("event") == "iteration_end" else 0
            if row.get("event") in ("proposer_usage", "proposer_failure"):  # a failed round spends too
                usage = row.get("usage") or {}
                self.run_dir.ledger.add_proposer(f"{self.unit}:proposer", float(usage.get("seconds", 0.0)),
                                                 int(usage.get("tokens", 0)), float(usage.get("cost_usd", 0.0)))
            if row.get("event") == "proposer_budget":
                console.print(f"  {row['reason']}")
            self.log(row.get("event", "harness"), **{k: v for k, v in row.items() if k != "event"})
            st["search"] = search.state_dict()
            self.save()

        def should_stop() -> bool:
            self._sync_progress()
            return self.schedule.harness_phase_over(self.progress, 0)

        def can_spend(rollouts: int) -> bool:
            self._sync_progress()
            return self.schedule.can_spend(self.progress, rollouts)

        self.unit = f"c{st['cycle']}-h"
        result = search.run_phase(st["harness_id"], st["weights_version"], iterations,
                                  adaptive=cfg.schedule.adaptive, on_iteration=on_iteration, should_stop=should_stop,
                                  can_spend=can_spend)
        st["harness_id"] = result.accepted_id
        st["search"] = None
        self.progress.harness_phases += 1
        self.unit = f"c{st['cycle']}-accept"
        self.log("harness_accepted", accepted=result.accepted_id, iterations=result.iterations, gain=result.gain)
        console.print(f"  accepted harness {result.accepted_id} after {result.iterations} iterations")
        self._sync_progress()
        self.log("phase_gain", **self.schedule.record_harness_phase(self.progress, result.gain))
        self._end_phase(f"c{st['cycle']}-h", self.schedule.after_harness_phase(self.progress))
        st["cycle"] += 1
        self.save()  # the accepted harness, the next phase and the pending evaluation: one unit
        self.finish_pending_eval()

    def _count_search(self, search: HarnessSearch, purpose: str, trajectories: list) -> None:
        """Key a search batch by the candidate and weights it measured, in this harness phase; the
        n-th batch of the same key (a null probe has two) gets `#n`. Work redone after a kill
        repeats its keys from #0, so the ledger records it as redone."""
        base = f"c{self.state['cycle']}:{purpose}:{search.subject}@{self.state['weights_version']}"
        n = self._batches.get(base, 0)
        self._batches[base] = n + 1
        self.run_dir.count_trajectories(f"{base}#{n}", purpose, trajectories)
