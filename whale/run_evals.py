"""A run's evaluations: the pending evaluation that closes a unit of work, the pairs it skips, the
val-best it tracks, and the test measurement of that val-best at the end.

An evaluation unit `eval-<tag>-<split>` writes its metrics row, then the state that lists it in
`evals_done`; `pending_eval` stays set until every split is done, so a kill inside an evaluation
redoes only the split it cut (run.py's table of units).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console

from whale.config import Config
from whale.evaluate import Evaluator
from whale.harness.archive import Archive
from whale.run_record import RunRecord
from whale.run_state import PendingEval, ValBest
from whale.store import read_metrics
from whale.weights.versions import WeightVersions

console = Console(stderr=True)


@dataclass
class RunEvals:
    cfg: Config
    evaluator: Evaluator  # measures a harness under the weights the engine serves
    archive: Archive  # the harnesses' sources
    weights: WeightVersions  # restores the val-best weights; prunes after a new val-best
    record: RunRecord  # the state, the unit, metrics rows, saves

    def marker(self, tag: str, last: bool = False) -> PendingEval:
        """A pending evaluation; it keeps the phase and cycle it closes for its metrics rows.
        `last`: it closes the run, so it measures every split (`eval.intermediate_splits` spares
        only the evaluations in between)."""
        st = self.record.state
        return PendingEval(tag=tag, phase=st.phase, cycle=st.cycle, last=last)

    def finish_pending(self) -> None:
        """Run the pending evaluation (the initial one, one closing a unit, or one a kill cut short)."""
        pending = self.record.state.pending_eval
        if pending is None:
            return
        self.evaluate_pair(pending)
        self.record.state.pending_eval = None
        self.record.save()

    def evaluate_pair(self, pending: PendingEval) -> None:
        """Evaluate the current (harness, weights) on every eval split; one unit per split."""
        st, tag = self.record.state, pending.tag
        hid, version = st.harness_id, st.weights_version
        splits = self.cfg.eval.splits
        if tag not in ("initial", "final") and not pending.last and self.cfg.eval.intermediate_splits is not None:
            splits = self.cfg.eval.intermediate_splits
        for split in splits:
            unit = f"eval-{tag}-{split}"
            if unit in st.evals_done or (tag != "initial" and st.last_eval_pairs.get(split) == (hid, version)):
                continue  # done, or the split's last evaluation measured this very (harness, weights) pair
                # with the same seeds (a phase that changed nothing): it would only repeat that result
            result = self._evaluate_split(unit, split, hid, version)
            self.record.log("eval", split=split, tag=tag, phase=pending.phase, cycle=pending.cycle,
                            **self._eval_row(result))
            if split == "val" and (st.val_best is None or result.mean_at_k > st.val_best.mean_at_k):
                st.val_best = ValBest(mean_at_k=result.mean_at_k, unit=unit, tag=tag, harness_id=hid,
                                      weights_version=version)
            st.evals_done.append(unit)
            st.last_eval_pairs[split] = st.last_eval_pair = (hid, version)
            self.record.save()
            self.weights.prune(st)  # a new val-best may free the old one

    def _evaluate_split(self, unit: str, split: str, hid: str, version: str):
        """One evaluation unit: harness `hid` under the weights the engine serves (`version`)."""
        self.record.unit = unit
        run_dir = self.record.run_dir
        result, trajs = self.evaluator.measure(self.archive.source(hid), split, harness_id=hid,
                                               progress=f"eval {split} ({hid}, {version})",
                                               traces_path=run_dir.path / "evals" / f"{unit}.jsonl")
        run_dir.count_trajectories(unit, "eval", trajs)
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
        The val-best weights are on disk (`WeightVersions.needed` keeps them); base weights are not,
        so a val-best at base under trained weights is measured only if a base evaluation measured it."""
        st = self.record.state
        best = st.val_best
        if not self.cfg.eval.test_at_val_best or best is None:
            return
        hid, version = best.harness_id, best.weights_version
        measured = {(r.get("split"), r.get("harness"), r.get("weights_version"))
                    for r in read_metrics(self.record.run_dir.path) if r.get("event") in ("eval", "eval_selected")}
        todo = [s for s in self.cfg.eval.splits if s != "val" and (s, hid, version) not in measured
                and f"eval-val_best-{s}" not in st.evals_done]
        if not todo:
            return
        if version != self.weights.engine.weights_version:
            if version == "base":
                console.print(f"[yellow]val-best[/] ({hid}, base) not measured on {todo}: base weights are not kept")
                return
            self.weights.restore(version)
        for split in todo:
            unit = f"eval-val_best-{split}"
            result = self._evaluate_split(unit, split, hid, version)
            self.record.log("eval_selected", split=split, tag="val_best", harness=hid, weights_version=version,
                            selected_by=best.unit, **self._eval_row(result))
            st.evals_done.append(unit)
            self.record.save()
