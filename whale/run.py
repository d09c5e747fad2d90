"""One experiment: the alternation of weight and harness phases, with evaluation and resume.

The schedule (schedule.py) decides which phase comes next; this file runs the phases with the
same runner, engine and archive for every condition (WHALE, weight-only, harness-only,
prompt-only, stagewise), and keeps the run directory consistent after every unit of work:

  unit                          | done when                  | after a kill
  ------------------------------|----------------------------|--------------------------------
  weight step `w<step>`         | adapter + state saved      | rows on disk: retrain only; else redo
  harness iteration             | search state saved         | evaluated candidates are reused
  evaluation `eval-<tag>-<split>`| metrics row + state saved  | redone
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from rich.console import Console

from whale.config import Config, ConfigError
from whale.domains import load_domain
from whale.engine import make_engine
from whale.evaluate import eval_seed, evaluate
from whale.executor import make_executor
from whale.harness.runner import derive_seed
from whale.schedule import Progress, Schedule
from whale.store import RunDir, fingerprint_model, fingerprint_problems

console = Console(stderr=True)


def run_experiment(cfg: Config | None, out: str | Path | None = None, resume: str | Path | None = None) -> Path:
    if resume is not None:
        run, saved_cfg, state = RunDir.open(resume)
        if cfg is not None:
            run.check_config(cfg)
        cfg = saved_cfg
        if state.get("phase") == "done":
            console.print(f"{run.path} is already finished")
            return run.path
    else:
        assert cfg is not None
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


class Experiment:
    def __init__(self, cfg: Config, run: RunDir, state: dict[str, Any]):
        from whale.search.archive import Archive

        self.cfg = cfg
        self.run_dir = run
        self.state = state
        self.domain = load_domain(cfg)
        self.splits = self.domain.load_splits()
        prints = fingerprint_problems(self.splits)
        if state.get("data_fingerprints") and state["data_fingerprints"] != prints:
            raise ConfigError("the data splits differ from those the run started with (data files or "
                              "loaders changed); start a new run")
        self.state.setdefault("data_fingerprints", prints)
        self.engine = make_engine(cfg)
        if "model_fingerprint" not in state:
            from whale.engine.default_model import resolve_model_path

            local = cfg.model.backend in ("hf", "vllm")
            state["model_fingerprint"] = fingerprint_model(resolve_model_path(cfg.model.name)) if local else {}
        self.runner = make_executor(cfg, self.engine, self.domain)
        self.unit = "start"
        self.runner.journal = lambda t: self.run_dir.journal(self.unit, t)
        self.archive = Archive(run.path)
        if "h0" not in self.archive.ids():
            self.archive.add_candidate(self.domain.base_harness(), parent=None, proposer="base",
                                       hypothesis="the domain's base harness h0", mechanism="base")
            if cfg.harness.initial:
                src_path = Path(cfg.harness.initial)
                if not src_path.is_file():
                    raise ConfigError(f"harness.initial: no such file {src_path}")
                from whale.search.validate import static_check

                problem = static_check(src_path.read_text(), cfg)
                if problem:
                    raise ConfigError(f"harness.initial {src_path}: {problem}")
                hid = self.archive.add_candidate(src_path.read_text(), parent="h0", proposer="user",
                                                 hypothesis=f"the user's starting harness {src_path.name}",
                                                 mechanism="user")
                self.archive.update_meta(hid, status="valid")
                state["harness_id"] = hid
        from whale.weights.patience import WeightPatience
        from whale.weights.rsft import ProblemStream

        self.stream = ProblemStream(self.splits["weight"], cfg.weight.problems_per_step, seed=cfg.seed)
        if state.get("stream"):
            self.stream.load_state_dict(state["stream"])
        p = cfg.schedule.weight_patience
        self.patience = WeightPatience(p.window, p.burn_in, p.patience)
        if state.get("patience"):
            self.patience.load_state_dict(state["patience"])
        h = cfg.harness
        iteration_cost = h.candidates_per_iteration * len(self.splits["harness"]) * h.samples_per_example
        step_cost = cfg.weight.problems_per_step * cfg.weight.samples_per_problem
        self.schedule = Schedule(cfg, self.stream.steps_per_epoch, iteration_cost, step_cost)
        self.progress = Progress(**state.get("progress", {}))
        self.trainer = None
        state.setdefault("phase", self.schedule.first_phase())
        state.setdefault("cycle", 0)
        state.setdefault("harness_id", "h0")
        state.setdefault("weights_version", "base")
        state.setdefault("evals_done", [])
        state.setdefault("weights_on_disk", [])
        if state["weights_version"] != "base":
            self._restore_weights(state["weights_version"])

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self.runner.close()
        self.engine.close()

    def save(self) -> None:
        self.progress.budget_rollouts = self.run_dir.ledger.budget_rollouts
        self.state["progress"] = self.progress.__dict__
        self.state["stream"] = self.stream.state_dict()
        self.state["patience"] = self.patience.state_dict()
        self.run_dir.save_state(self.state)

    def log(self, event: str, **row: Any) -> None:
        self.run_dir.log({"unit": self.unit, "event": event, "phase": self.state["phase"],
                          "cycle": self.state["cycle"], "step": self.progress.weight_steps,
                          "harness": self.state["harness_id"], "weights_version": self.state["weights_version"],
                          **row})

    def ledger_add(self, purpose: str, trajectories: list) -> None:
        self.run_dir.ledger.add_trajectories(purpose, trajectories)

    def harness_source(self, cid: str) -> str:
        return self.archive.source(cid)

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        st = self.state
        console.print(f"[bold]{self.cfg.name}[/]: schedule {self.schedule.kind}"
                      f"{' (adaptive)' if self.cfg.schedule.adaptive else ''}, domain {self.domain.name}, "
                      f"run dir {self.run_dir.path}")
        self.save()
        self.maybe_evaluate("initial")
        while st["phase"] != "done":
            if st["phase"] == "weight":
                self.weight_phase()
            elif st["phase"] == "harness":
                self.harness_phase()
            else:
                raise ValueError(f"corrupt state.json: unknown phase {st['phase']!r}")
        self.maybe_evaluate("final")
        self.unit = "end"
        self.log("run_end", seconds=round(self.run_dir.elapsed(), 1))
        self.save()

    # ------------------------------------------------------------------ evaluation
    def maybe_evaluate(self, tag: str) -> None:
        pair = [self.state["harness_id"], self.state["weights_version"]]
        if tag == "final" and self.state.get("last_eval_pair") == pair:
            return  # the last evaluation already measured this (harness, weights) pair
        for split in self.cfg.eval.splits:
            unit = f"eval-{tag}-{split}"
            if unit in self.state["evals_done"]:
                continue
            self.unit = unit
            problems = self.splits[split][: self.cfg.eval.limit or None]
            hid, version = self.state["harness_id"], self.state["weights_version"]
            result, trajs = evaluate(self.runner, self.harness_source(hid), problems, self.cfg.eval.k, split=split,
                                     harness_id=hid, seed=eval_seed(self.cfg.seed, split),
                                     progress=f"eval {split} ({hid}, {version})",
                                     traces_path=self.run_dir.path / "evals" / f"{unit}.jsonl")
            self.ledger_add("eval", trajs)
            self.log("eval", split=split, tag=tag, **{k: v for k, v in result.to_json().items()
                                                     if k not in ("split", "harness_id", "weights_version")} | {"per_problem": result.per_problem})
            console.print(f"  {unit}: mean@{result.k} {result.mean_at_k:.3f} "
                          f"[{result.ci95[0]:.3f}, {result.ci95[1]:.3f}] pass@{result.k} {result.pass_at_k:.3f}")
            if split == "val":
                best = self.state.get("val_best")
                if best is None or result.mean_at_k > best["mean_at_k"]:
                    self.state["val_best"] = {"mean_at_k": result.mean_at_k, "unit": unit, "tag": tag,
                                              "harness_id": hid, "weights_version": version}
            self.state["evals_done"].append(unit)
            self.state["last_eval_pair"] = pair
            self.prune_weights()
            self.save()

    # ------------------------------------------------------------------ weight phase
    def _ensure_trainer(self):
        if self.trainer is None:
            from whale.weights.from_disk import training_model
            from whale.weights.trainer import Trainer

            sync = self.engine.weight_sync
            if sync == "in_place":  # hf: train the served model object itself, no copy
                model, tokenizer = self.engine.model, self.engine.tokenizer
            elif sync == "from_disk":  # vLLM: train an hf copy; RSFT saves adapters, the server loads them
                model, tokenizer = training_model(self.cfg)
            else:
                raise ConfigError(f"model.backend {self.cfg.model.backend!r} serves inference only; "
                                  "weight phases need backend hf or vllm")
            self.trainer = Trainer(model, tokenizer, self.cfg.weight, seed=self.cfg.seed,
                                   temperature=max(self.cfg.sampling.temperature, 1e-3))
            if sync == "in_place":
                self.trainer.attach(self.engine)
        return self.trainer

    def _restore_weights(self, version: str) -> None:
        path = self.run_dir.path / "weights" / version
        if not path.exists():
            raise ConfigError(f"state.json names weights {version} but {path} is missing")
        trainer = self._ensure_trainer()
        trainer.load(path)
        in_place = self.engine.weight_sync == "in_place"
        self.engine.load_weights(None if in_place else str(path), version)

    def weight_phase(self) -> None:
        from whale.weights.rsft import RSFT

        st = self.state
        trainer = self._ensure_trainer()
        hid = st["harness_id"]
        rsft = RSFT(self.runner, trainer, self.engine, self.cfg.weight, self.stream, self.harness_source(hid), hid,
                    self.run_dir.path / "rows", weights_dir=self.run_dir.path / "weights",
                    on_rollouts=self._on_weight_rollouts)
        if self.progress.phase_steps == 0:
            self.patience = type(self.patience)(self.patience.window, self.patience.burn_in, self.patience.patience)
            console.print(f"[cyan]weight phase[/] (cycle {st['cycle']}, harness {hid})")
        while True:
            step = self.progress.weight_steps
            self.unit = f"w{step}"
            self._stream_before = self.stream.state_dict()
            result = rsft.step(step, seed=derive_seed(self.cfg.seed, "weight", step))
            if result.resumed:
                console.print(f"  step {step}: resumed from saved rows (rollouts not redone)")
            self.progress.weight_steps += 1
            self.progress.phase_steps += 1
            self.patience.update(result.accept_rate)
            self.progress.patience_stop = self.patience.should_stop()
            if result.weights_version:
                st["weights_version"] = result.weights_version
                self._save_weights(result.weights_version)
            self.log("weight_step", **result.to_json())
            console.print(f"  step {step}: accept {result.accept_rate:.3f} ({result.accepted}/{result.rollouts}), "
                          f"rows {result.rows}, loss {result.loss if result.loss is None else round(result.loss, 4)}, "
                          f"gen {result.gen_seconds:.0f}s train {result.train_seconds:.0f}s  ({result.reason})")
            self.save()
            every = self.cfg.eval.every_steps
            phase_over = self.schedule.weight_phase_over(self.progress)
            if every and self.progress.weight_steps % every == 0 and not phase_over:
                self.maybe_evaluate(f"w{self.progress.weight_steps}")
            if phase_over:
                nxt = self.schedule.after_weight_phase(self.progress)
                if nxt == "weight_more":
                    continue
                if st["weights_version"] != "base" and st["weights_version"] not in st.setdefault("phase_end_weights", []):
                    st["phase_end_weights"].append(st["weights_version"])  # kept for `whale matrix`
                if self.cfg.eval.at_phase_ends:
                    self.maybe_evaluate(f"w{self.progress.weight_steps}")
                st["phase"] = nxt
                self.progress.phase_steps = 0
                self.save()
                return

    def _on_weight_rollouts(self, meta: dict[str, Any]) -> None:
        """Rows are on disk: count the rollouts now, with the stream state from before the step,
        so a kill during training resumes into the same step without counting them twice."""
        led = self.run_dir.ledger
        led.rollouts["weight"] += int(meta["rollouts"])
        led.llm_calls += int(meta.get("llm_calls", 0))
        led.prompt_tokens += int(meta.get("prompt_tokens", 0))
        led.completion_tokens += int(meta.get("completion_tokens", 0))
        stream_after = self.stream.state_dict()
        self.stream.load_state_dict(self._stream_before)
        self.save()
        self.stream.load_state_dict(stream_after)

    def _save_weights(self, version: str) -> None:
        path = self.run_dir.path / "weights" / version
        if not path.exists():
            self.trainer.save(path, version)
        if version not in self.state["weights_on_disk"]:
            self.state["weights_on_disk"].append(version)
        self.prune_weights()

    def prune_weights(self) -> None:
        """Keep only the versions the run still needs: current, best on val, each weight phase's
        end (the columns of `whale matrix`), the last few."""
        keep = {self.state["weights_version"], *self.state.get("phase_end_weights", [])}
        if self.state.get("val_best"):
            keep.add(self.state["val_best"]["weights_version"])
        on_disk = self.state["weights_on_disk"]
        keep.update(on_disk[-self.cfg.weight.keep_versions:])
        for v in list(on_disk):
            if v not in keep:
                shutil.rmtree(self.run_dir.path / "weights" / v, ignore_errors=True)
                on_disk.remove(v)

    # ------------------------------------------------------------------ harness phase
    def harness_phase(self) -> None:
        from whale.search.loop import HarnessSearch
        from whale.search.proposers import make_proposer

        st = self.state
        cfg = self.cfg
        if self.schedule.prompt_only and not cfg.harness.prompt_only:
            cfg = cfg.model_copy(deep=True)
            cfg.harness.prompt_only = True
        search = HarnessSearch(cfg, self.domain, self.runner, self.archive, make_proposer(cfg),
                               ledger_callback=self._search_ledger, splits=self.splits)
        if st.get("search"):
            search.load_state_dict(st["search"])
        else:
            console.print(f"[magenta]harness phase[/] (cycle {st['cycle']}, incoming {st['harness_id']}, "
                          f"weights {st['weights_version']})")
        iterations = None if cfg.schedule.adaptive else self.schedule.harness_iterations_planned()

        def on_iteration(row: dict[str, Any]) -> None:
            self.unit = f"c{st['cycle']}-h{row.get('iteration', '?')}"
            self.progress.harness_iterations += 1 if row.get("event") == "iteration_end" else 0
            if row.get("event") == "proposer_usage":
                usage = row.get("usage") or {}
                self.run_dir.ledger.proposer_seconds += float(usage.get("seconds", 0.0))
                self.run_dir.ledger.proposer_tokens += int(usage.get("tokens", 0))
            self.log(row.get("event", "harness"), **{k: v for k, v in row.items() if k != "event"})
            st["search"] = search.state_dict()
            self.save()

        def should_stop() -> bool:
            self.progress.budget_rollouts = self.run_dir.ledger.budget_rollouts
            return self.schedule.harness_phase_over(self.progress, 0)

        self.unit = f"c{st['cycle']}-h"
        result = search.run_phase(st["harness_id"], st["weights_version"], iterations,
                                  adaptive=cfg.schedule.adaptive, on_iteration=on_iteration, should_stop=should_stop)
        st["harness_id"] = result.accepted_id
        st["search"] = None
        self.progress.harness_phases += 1
        self.unit = f"c{st['cycle']}-accept"
        self.log("harness_accepted", accepted=result.accepted_id, iterations=result.iterations)
        console.print(f"  accepted harness {result.accepted_id} after {result.iterations} iterations")
        if self.cfg.eval.at_phase_ends:
            self.maybe_evaluate(f"c{st['cycle']}-h")
        st["phase"] = self.schedule.after_harness_phase(self.progress)
        st["cycle"] += 1
        self.save()

    def _search_ledger(self, purpose: str, trajectories: list) -> None:
        self.ledger_add(purpose, trajectories)


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """Final / best / val-selected test mean@k of a run, from its metrics (used by report and compare)."""
    from whale.store import read_metrics

    rows = read_metrics(run_dir)
    evals = [r for r in rows if r.get("event") == "eval"]
    test = [r for r in evals if r.get("split") == "test"]
    val = [r for r in evals if r.get("split") == "val"]
    out: dict[str, Any] = {"initial": None, "final": None, "best": None, "val_selected": None}
    if test:
        out["initial"] = test[0]["mean_at_k"]
        out["final"] = test[-1]["mean_at_k"]
        out["best"] = max(r["mean_at_k"] for r in test)
    if val and test:
        best_val = max(val, key=lambda r: r["mean_at_k"])
        same = [r for r in test if r.get("tag") == best_val.get("tag")]
        out["val_selected"] = same[-1]["mean_at_k"] if same else None
        out["val_selected_tag"] = best_val.get("tag")
    state_path = Path(run_dir) / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    out["ledger"] = state.get("ledger", {})
    out["seconds"] = state.get("elapsed_s")
    out["harness_id"], out["weights_version"] = state.get("harness_id"), state.get("weights_version")
    return out
