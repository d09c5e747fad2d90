"""The harness phase: Meta-Harness search under the current weights.

One phase = iteration 1 re-scores the incoming harness under the new weights (the paper counts it
as the first harness iteration), then each further iteration asks the proposer for M candidates,
validates them, evaluates the valid ones on D_harness (1 rollout per problem by default) and
archives code, scores and traces (k = harness.samples_per_example samples per problem, the same
seeds for every candidate under one weights version). Acceptance (acceptance.py): the top
candidates that beat the incoming harness on those traces are re-run with the incoming one on
fresh seeds, and one replaces it only by a paired test on the fresh samples; it must also pass
the null-engine probe on those samples (guard.py). The incoming harness stays otherwise.

Everything that happens is a history row handed to `on_iteration(row)` (the caller writes them to
metrics.jsonl): rescore, candidate (evaluated), invalid, duplicate, proposer_failure, null_probe,
iteration_end, confirm, accept, proposer_budget, proposer_exhausted, proposer_stopped. After every row `state_dict()` is consistent; the caller saves it then.
Resume (`load_state_dict`, then `run_phase` with the same incoming id and weights version):
proposals are archived (status "pending") before any is validated, so a killed phase re-proposes
only if it died while the proposer ran, and redoes at most the one pending candidate that was
being evaluated.

A proposer round that fails is an empty iteration with its reason on record (the run goes on);
the same failure FAILURE_REPEATS rounds in a row raises ProposerStopped instead of repeating it.
A round that comes back empty because the proposer has nothing left to write (`Proposer.exhausted`:
the offline library's every edit is in the archive) is not a failure: the phase ends there and goes
on to acceptance, like a spent proposer budget (prompt-only on chess, which has two prompt
mechanisms, gets there within one phase).
Every round's usage (seconds, tokens, USD where the agent reports it) is in its round.json; once
their sum reaches harness.proposer_budget_usd / _tokens, phases stop proposing and keep their
incoming harness.

Adaptive mode (patience on the search signal, as in the paper's adaptive schedule): at least
1 + harness.min_iterations and at most 1 + harness.max_iterations iterations; stop once
harness.patience iterations in a row set no new best success rate.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from whale.config import Config
from whale.engine.null import NullEngine
from whale.rollout.runner import RolloutRunner, derive_seed
from whale.harness.acceptance import choose, confirm_sequentially, per_problem
from whale.harness.archive import Archive, atomic_write
from whale.harness.brief import make_brief
from whale.harness.diagnose import diagnose_harness
from whale.harness.guard import null_probe
from whale.harness.proposal import ProposalContext, ProposerStopped
from whale.harness.validate import validate_candidate
from whale.harness.workspace import proposer_workspace_root

FAILURE_REPEATS = 3  # proposer rounds failing alike in a row that stop the search (ProposerStopped)


@dataclass
class PhaseResult:
    accepted_id: str
    iterations: int
    history: list[dict[str, Any]] = field(default_factory=list)
    gain: float = 0.0  # paired gain of the accepted harness over the incoming one, on fresh samples


class HarnessSearch:
    def __init__(self, cfg: Config, domain, runner, archive: Archive, proposer, ledger_callback=None, *,
                 splits: dict[str, list] | None = None, null_runner=None, workspace_root: str | Path | None = None,
                 progress: bool = True):
        """`ledger_callback(purpose, trajectories)` is called after every batch of rollouts
        (purposes: rescore (iteration 1), harness, smoke, null_probe) so the caller's ledger
        counts them all."""
        self.cfg = cfg
        self.domain = domain
        self.runner = runner
        self.archive = archive
        self.proposer = proposer
        self.ledger_callback = ledger_callback
        self.null_runner = null_runner
        self._own_null_runner = False
        self.workspace_root = Path(workspace_root) if workspace_root else \
            proposer_workspace_root(cfg.harness.workspace_root, archive.run_dir)
        self.progress = progress
        self._problems: list | None = list(splits["harness"]) if splits is not None else None
        self._state: dict[str, Any] = {}
        self._resumed = False
        self._history: list[dict[str, Any]] = []
        self._on_iteration: Callable[[dict], None] | None = None
        self._can_spend: Callable[[int], bool] | None = None  # the budget's say on further confirmation rounds
        # the candidate whose rollouts the next ledger_callback counts, so the caller can key each
        # batch by the work that ran it (a batch run again after a kill is then recognised as redone)
        self.subject: str | None = None

    # ----- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next run_phase with the same incoming id and weights version continues this state;
        without a load, every run_phase call is a new phase (even with an unchanged version)."""
        self._state = copy.deepcopy(state)
        self._resumed = True

    def harness_problems(self) -> list:
        if self._problems is None:
            self._problems = list(self.domain.load_splits()["harness"])
            if not self._problems:
                raise ValueError(f"domain {self.domain.name!r} has an empty harness split")
        return self._problems

    # ----- phase ---------------------------------------------------------------------------------
    def run_phase(self, incoming_id: str, weights_version: str, iterations: int | None = None, *,
                  adaptive: bool = False, on_iteration: Callable[[dict], None] | None = None,
                  should_stop: Callable[[], bool] | None = None,
                  can_spend: Callable[[int], bool] | None = None) -> PhaseResult:
        """Run (or resume) one harness phase. `should_stop()` is asked before every proposer
        iteration (a unit boundary), so a rollout budget can end the phase early; `can_spend(n)`
        before every confirmation round after the first (n rollouts), so it cannot overrun it."""
        status = self.archive.meta(incoming_id)["status"]  # a clear KeyError for an unknown id
        if status in ("invalid", "duplicate"):
            raise ValueError(f"incoming harness {incoming_id} is {status} ({self.archive.meta(incoming_id)['reason']}); "
                             "a phase must start from a valid harness")
        self._history, self._on_iteration, self._can_spend = [], on_iteration, can_spend
        self._exhausted = False  # set by a proposer round that had nothing left to write (Proposer.exhausted)
        st = self._state
        resume = self._resumed and st.get("incoming_id") == incoming_id and st.get("weights_version") == weights_version
        self._resumed = False
        if resume and st.get("accepted"):
            return PhaseResult(st["accepted"], st["done"], [], st.get("gain", 0.0))  # killed after the phase, before the caller moved on
        if not resume:
            self._state = st = {"phase": max(st.get("phase", 0), self._last_phase_on_disk()) + 1,
                                "incoming_id": incoming_id,
                                "weights_version": weights_version, "done": 0, "best_rate": None, "stale": 0,
                                "pending": None, "accepted": None}
        if adaptive:
            first_stop, last = 1 + self.cfg.harness.min_iterations, 1 + self.cfg.harness.max_iterations
        else:
            last = iterations if iterations is not None else self.cfg.schedule.harness_iterations
            if last < 1:
                raise ValueError(f"a harness phase needs at least 1 iteration, got {last}")
            first_stop = last
        while st["done"] < last:
            it = st["done"] + 1
            if it > 1 and should_stop is not None and should_stop():
                self._emit({"event": "phase_stopped", "iteration": st["done"], "reason": "should_stop (budget)"})
                break
            spent = self._budget_spent() if it > 1 else None
            if spent:
                self._emit({"event": "proposer_budget", "iteration": st["done"],
                            "reason": f"{spent}; keeping the incoming harness {incoming_id}"})
                break
            if it == 1:
                st["best_rate"], st["stale"] = self._rescore(incoming_id, weights_version), 0
            else:
                best = max(self._iteration(it), default=None)
                if best is not None and best > st["best_rate"] + 1e-12:
                    st["best_rate"], st["stale"] = best, 0
                else:
                    st["stale"] += 1
            st["done"], st["pending"] = it, None
            self._emit({"event": "iteration_end", "iteration": it, "best_rate": st["best_rate"], "stale": st["stale"]})
            if self._exhausted:
                break
            if adaptive and st["done"] >= first_stop and st["stale"] >= self.cfg.harness.patience:
                break
        accepted = self._accept(incoming_id, weights_version)
        st["accepted"] = accepted
        self._emit({"event": "accept", "iteration": st["done"], "id": accepted, "gain": st["gain"],
                    **(self.archive.scores(accepted, weights_version) or {})})
        return PhaseResult(accepted, st["done"], list(self._history), st["gain"])

    def _last_phase_on_disk(self) -> int:
        """Highest phase number among proposal folders, so a fresh HarnessSearch never reuses a tag."""
        found = [int(m.group(1)) for d in (self.archive.root / "_proposals").glob("p*")
                 if (m := re.match(r"p(\d+)-", d.name))]
        return max(found, default=0)

    def close(self) -> None:
        if self.null_runner is not None and self._own_null_runner:
            self.null_runner.close()
            self.null_runner = None

    # ----- steps ---------------------------------------------------------------------------------
    def _emit(self, row: dict[str, Any]) -> None:
        row = {"phase_incoming": self._state.get("incoming_id"), "weights_version": self._state.get("weights_version"),
               **row}
        self._history.append(row)
        if self._on_iteration is not None:
            self._on_iteration(row)

    def _seed(self, version: str) -> int:
        """One seed per (run, weights version): every candidate of a phase sees the same sampling
        seeds per problem, so their scores are paired comparisons (common random numbers)."""
        return int(hashlib.sha256(f"{self.cfg.seed}/{version}/harness".encode()).hexdigest()[:8], 16)

    def _count(self, purpose: str, trajectories) -> None:
        if self.ledger_callback is not None:
            self.ledger_callback(purpose, trajectories)

    def _evaluate(self, cid: str, version: str, purpose: str = "harness") -> dict[str, Any]:
        """Evaluate on D_harness; `purpose` tells the ledger a search rollout from a re-score."""
        problems = self.harness_problems()
        trajs = self.runner.run(self.archive.source(cid), problems, self.cfg.harness.samples_per_example,
                                harness_id=cid, seed=self._seed(version), purpose="harness",
                                progress=f"harness {cid}" if self.progress else None)
        self._count(purpose, trajs)
        gold = {p.id: p.answer for p in problems} if self.cfg.domain.show_gold_in_traces else None
        return self.archive.record_scores(cid, version, trajs, gold=gold)

    def _rescore(self, cid: str, version: str) -> float:
        self.subject = cid
        scores = self.archive.scores(cid, version)
        reused = scores is not None
        if not reused:
            scores = self._evaluate(cid, version, purpose="rescore")
        self._emit({"event": "rescore", "iteration": 1, "id": cid, "reused": reused, **scores})
        return scores["success_rate"]

    def _iteration(self, it: int) -> list[float]:
        """Propose (unless a resumed iteration already did), handle every pending candidate, and
        return the success rates of this iteration's evaluated candidates."""
        st = self._state
        version, incoming = st["weights_version"], st["incoming_id"]
        if st["pending"] is None or st["pending"]["iteration"] != it:
            ids = self._archived_round(it, incoming, version)
            if ids is None:
                ids = self._propose(it, incoming, version)
            st["pending"] = {"iteration": it, "ids": ids}
            self._emit({"event": "proposals", "iteration": it, "ids": ids})
        rates = []
        for cid in st["pending"]["ids"]:
            self._handle(cid, it, version)
            scores = self.archive.scores(cid, version)
            if scores is not None and self.archive.meta(cid)["status"] == "valid":
                rates.append(scores["success_rate"])
        return rates

    def _tag(self, it: int, incoming: str, version: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"p{self._state['phase']:02d}-{version}-{incoming}-it{it:02d}")

    def _archived_round(self, it: int, incoming: str, version: str) -> list[str] | None:
        """The candidate ids of iteration `it` when its proposals were archived before a kill cut
        the state save that would have marked them pending (so the proposer is not asked twice)."""
        path = self.archive.root / "_proposals" / self._tag(it, incoming, version) / "round.json"
        if not path.exists():
            return None
        ids = json.loads(path.read_text()).get("ids", [])
        return ids if all(cid in self.archive.ids() for cid in ids) else None

    def _propose(self, it: int, incoming: str, version: str) -> list[str]:
        m = self.cfg.harness.candidates_per_iteration
        prompt_only = self.cfg.harness.prompt_only
        base = self.archive.source(incoming)
        tag = self._tag(it, incoming, version)
        leaders = list(dict.fromkeys([incoming] + self.archive.ranking(version)[:1]))
        diagnoses = {cid: diagnose_harness(self.archive, cid, version, self.domain,
                                            self.cfg.harness.domain_hints).text() for cid in leaders}
        brief = make_brief(self.domain, self.cfg, m, weights_version=version, incoming_id=incoming,
                           frontier=self.archive.frontier(version), prompt_only=prompt_only, base_source=base,
                           diagnoses=diagnoses)
        ctx = ProposalContext(iteration=it, weights_version=version, incoming_id=incoming, brief=brief,
                              prompt_only=prompt_only, base_source=base if prompt_only else None, tag=tag,
                              seed=self.cfg.seed)
        name = self.proposer.name
        exhausted = False
        try:
            proposals = self.proposer.propose(self.archive, self.domain, m, self.workspace_root / tag, ctx)
            error, usage = self.proposer.last_error, dict(self.proposer.last_usage)
            exhausted = not proposals and self.proposer.exhausted
        except Exception as e:  # noqa: BLE001 - a proposer bug must not end the run
            proposals, error, usage = [], f"proposer raised {type(e).__name__}: {e}", {}
        round_info = {"tag": tag, "phase": self._state["phase"], "iteration": it, "weights_version": version,
                      "incoming_id": incoming, "proposer": name, "error": error, "usage": usage, "ids": [],
                      "exhausted": exhausted}
        if not proposals:
            atomic_write(self.archive.proposals_dir(tag) / "round.json", json.dumps(round_info, indent=1) + "\n")
            reason = error or "proposer returned no candidates"
            if exhausted:  # nothing left to write under these weights: the phase ends, the run goes on
                self._exhausted = True
                self._emit({"event": "proposer_exhausted", "iteration": it, "proposer": name,
                            "reason": f"{reason}; keeping the best harness so far"})
                return []
            self._emit({"event": "proposer_failure", "iteration": it, "proposer": name, "reason": reason, "usage": usage})
            self._same_failure(reason)
            return []
        if error:
            self._emit({"event": "proposer_warning", "iteration": it, "proposer": name, "reason": error})
        self._emit({"event": "proposer_usage", "iteration": it, "proposer": name, "n": len(proposals), "usage": usage})
        ids = []
        for p in proposals[:m]:
            parent = p.parent if p.parent in self.archive.ids() else incoming
            ids.append(self.archive.add_candidate(p.source, parent, name, p.hypothesis, p.mechanism, p.notes))
        round_info["ids"] = ids
        atomic_write(self.archive.proposals_dir(tag) / "round.json", json.dumps(round_info, indent=1) + "\n")
        return ids

    def _rounds(self) -> list[dict]:
        """Every proposer round of the run so far (round.json files), oldest first."""
        rounds = [json.loads(p.read_text()) for p in (self.archive.root / "_proposals").glob("*/round.json")]
        return sorted(rounds, key=lambda r: (r.get("phase", 0), r.get("iteration", 0)))

    def _same_failure(self, reason: str) -> None:
        """Raise ProposerStopped once the run's last FAILURE_REPEATS proposer rounds all failed for
        the same reason (numbers aside: ports, seconds): a missing package or a refused key fails
        every round alike, and repeating it spends the budget on nothing. Counted over the rounds
        on disk, so short harness phases and resumes do not reset it. The state is saved, so
        `whale run --resume` continues the phase once it is fixed."""
        last = [r for r in self._rounds() if not r.get("exhausted")][-FAILURE_REPEATS:]
        keys = {re.sub(r"\d+(\.\d+)?", "N", r.get("error") or "proposer returned no candidates")
                for r in last if not r.get("ids")}
        if len(last) == FAILURE_REPEATS and all(not r.get("ids") for r in last) and len(keys) == 1:
            self._emit({"event": "proposer_stopped", "iteration": self._state["done"] + 1, "reason": reason})
            raise ProposerStopped(f"the proposer failed {FAILURE_REPEATS} rounds in a row with: {reason}; fix it and "
                                  f"continue with `whale run --resume {self.archive.run_dir}`")

    def proposer_spent(self) -> dict[str, float]:
        """What the run's proposer rounds cost so far (tokens, cost_usd, seconds), summed over
        their round.json files: every round, failed or not, resumed runs included."""
        total = {"tokens": 0, "cost_usd": 0.0, "seconds": 0.0}
        for round_info in self._rounds():
            usage = round_info.get("usage") or {}
            for k in total:
                total[k] += usage.get(k) or 0
        return total

    def _budget_spent(self) -> str | None:
        """Why no more proposals may be asked for (harness.proposer_budget_*), or None."""
        h = self.cfg.harness
        if h.proposer_budget_usd is None and h.proposer_budget_tokens is None:
            return None
        spent = self.proposer_spent()
        if h.proposer_budget_usd is not None and spent["cost_usd"] >= h.proposer_budget_usd:
            return f"proposer budget spent: ${spent['cost_usd']:.2f} of harness.proposer_budget_usd ${h.proposer_budget_usd:g}"
        if h.proposer_budget_tokens is not None and spent["tokens"] >= h.proposer_budget_tokens:
            return (f"proposer budget spent: {int(spent['tokens'])} tokens of harness.proposer_budget_tokens "
                    f"{h.proposer_budget_tokens}")
        return None

    def _handle(self, cid: str, it: int, version: str) -> None:
        """Validate and evaluate one pending candidate (already handled ones are left alone)."""
        self.subject = cid
        meta = self.archive.meta(cid)
        row = {"iteration": it, "id": cid, "parent": meta["parent"], "mechanism": meta["mechanism"]}
        if meta["status"] != "pending":  # handled before a kill: report it again, in case its row was lost
            scored = meta.get("duplicate_of", cid)
            self._emit({"event": {"valid": "candidate"}.get(meta["status"], meta["status"]), **row,
                        "status": meta["status"], "reason": meta.get("reason") or meta.get("validation", ""),
                        "resumed": True, **(self.archive.scores(scored, version) or {})})
            return
        dup = self.archive.evaluated(meta["code_hash"], version)
        if dup is not None:
            reason = f"same code as {dup}, already evaluated under weights {version}"
            self.archive.update_meta(cid, status="duplicate", reason=reason, duplicate_of=dup)
            self._emit({"event": "duplicate", **row, "status": "duplicate", "reason": reason,
                        **(self.archive.scores(dup, version) or {})})
            return
        source = self.archive.source(cid)
        parent = meta["parent"] if meta["parent"] in self.archive.ids() else self._state["incoming_id"]
        prompt_only = self.cfg.harness.prompt_only
        base = self.archive.source(self._state["incoming_id"] if prompt_only else parent)
        ok, reason = validate_candidate(source, self.domain, self.cfg, self.runner, base_source=base,
                                        prompt_only=prompt_only, harness_problems=self.harness_problems(),
                                        on_rollouts=self._count)
        if not ok:
            self.archive.record_invalid(cid, reason)
            self._emit({"event": "invalid", **row, "status": "invalid", "reason": reason})
            return
        self.archive.update_meta(cid, validation=reason)
        scores = self._evaluate(cid, version)
        self._emit({"event": "candidate", **row, "status": "valid", "reason": reason, **scores})

    def _accept(self, incoming: str, version: str) -> str:
        """The incoming harness, unless a candidate beats it by the paired rule of acceptance.py
        (confirmed on fresh seeds) and passes the null probe. Sets state["gain"]: the accepted
        harness's paired gain over the incoming one on the fresh samples (0 when it is kept)."""
        h, st = self.cfg.harness, self._state
        st["gain"] = 0.0
        incoming_rate = (self.archive.scores(incoming, version) or {}).get("success_rate", 0.0)
        challengers = [cid for cid in self.archive.ranking(version)
                       if cid != incoming and self.archive.scores(cid, version)["success_rate"] > incoming_rate + 1e-12]
        if not challengers:
            return incoming
        if h.confirm_top > 0:
            rates, tests = self._confirm(incoming, challengers[: h.confirm_top], version)
        else:  # decide on the selection traces; alpha is split over every candidate selected among
            base = per_problem(self.archive.traces(incoming, version))
            rates = {cid: per_problem(self.archive.traces(cid, version)) for cid in challengers}
            _, tests = choose(base, rates, alpha=h.accept_alpha, margin=h.accept_margin)
            for cid, test in tests.items():
                self._emit({"event": "confirm", "iteration": st["done"], "id": cid, "incoming": incoming,
                            "fresh": False, **test})
        passing = sorted((cid for cid in tests if tests[cid]["passes"]), key=lambda c: -tests[c]["mean_a"])
        for cid in passing:
            probe = self._probe(cid, version, rates[cid] if h.confirm_top > 0 else None)
            if not probe["flagged"] or not h.reject_flagged:
                st["gain"] = tests[cid]["gain"]
                return cid
        return incoming

    def _confirm(self, incoming: str, chosen: list[str], version: str) -> tuple[dict, dict]:
        """Sequential confirmation (acceptance.py, rules 2-4) on fresh rollouts; every round's tests
        emitted. Returns the pooled rates and the tests of the last round."""
        h = self.cfg.harness
        stopped: list[str] = []  # why a round was refused, emitted after the rounds' tests

        def more(alive: list[str], round_index: int) -> bool:
            key = self._fresh_key(version, round_index)  # rounds already run (a resumed phase) cost nothing
            todo = [cid for cid in [incoming, *alive] if key not in (self.archive.meta(cid).get("confirm") or {})]
            cost = len(todo) * len(self.harness_problems()) * h.confirm_samples
            if not todo or self._can_spend is None or self._can_spend(cost):
                return True
            stopped.append(f"budget: no room for round {round_index + 1} ({cost} rollouts)")
            return False

        rates, history = confirm_sequentially(lambda cid, r: self._fresh(cid, version, r), incoming, chosen,
                                              alpha=h.accept_alpha, margin=h.accept_margin, rounds=h.confirm_rounds,
                                              more=more)
        for r, tests in enumerate(history):
            extra = {"round": r + 1, "rounds": h.confirm_rounds} if h.confirm_rounds > 1 else {}
            for cid, test in tests.items():
                self._emit({"event": "confirm", "iteration": self._state["done"], "id": cid, "incoming": incoming,
                            "fresh": True, **test, **extra})
        for reason in stopped:
            self._emit({"event": "confirm_stopped", "iteration": self._state["done"], "incoming": incoming, "reason": reason})
        return rates, history[-1]

    def _decision_key(self, version: str) -> str:
        """Fresh samples belong to one decision: this phase under these weights."""
        return f"{version}/p{self._state['phase']}"

    def _fresh_key(self, version: str, round_index: int) -> str:
        return self._decision_key(version) + (f"/r{round_index + 1}" if round_index else "")

    def _fresh(self, cid: str, version: str, round_index: int = 0) -> dict[str, float]:
        """Per-problem success on new seeds (ledger purpose `confirm`), cached in meta.json; each
        round of a sequential confirmation has its own seeds and cache key."""
        self.subject = cid
        key = self._fresh_key(version, round_index)
        cached = (self.archive.meta(cid).get("confirm") or {}).get(key)
        if cached is not None:
            return cached["per_problem"]
        k = self.cfg.harness.confirm_samples
        trajs = self.runner.run(self.archive.source(cid), self.harness_problems(), k, harness_id=cid,
                                seed=derive_seed(self.cfg.seed, "confirm", key), purpose="confirm",
                                progress=f"confirm {cid}" if self.progress else None)
        self._count("confirm", trajs)
        rates = per_problem(trajs)
        confirm = dict(self.archive.meta(cid).get("confirm") or {})
        confirm[key] = {"k": k, "mean": round(sum(rates.values()) / max(1, len(rates)), 4), "per_problem": rates}
        self.archive.update_meta(cid, confirm=confirm)
        return rates

    def _probe(self, cid: str, version: str, fresh: dict[str, float] | None) -> dict[str, Any]:
        """The null probe against fresh real samples (cached per decision in meta.json)."""
        self.subject = cid
        key = self._decision_key(version)
        probes = dict(self.archive.meta(cid).get("null_probe") or {})
        if key in probes:
            return probes[key]
        if self.null_runner is None:
            self.null_runner = RolloutRunner(NullEngine(seed=self.cfg.seed), self.domain, self.cfg)
            self._own_null_runner = True
        h = self.cfg.harness
        seed = derive_seed(self.cfg.seed, "confirm" if fresh is not None else "probe", key)
        probe = null_probe(self.runner, self.archive.source(cid), self.harness_problems(), self.cfg,
                           null_runner=self.null_runner, real_rewards=fresh, harness_id=cid, seed=seed,
                           samples=h.confirm_samples if fresh is not None else h.samples_per_example,
                           ledger_callback=self._count)
        probes[key] = probe
        self.archive.update_meta(cid, null_probe=probes, flagged=probe["flagged"])
        self._emit({"event": "null_probe", "iteration": self._state["done"], "id": cid, **probe})
        return probe
