"""Each schedule's phase sequence, driven by the same state machine the run uses."""


import json
import os
from pathlib import Path

import pytest

from tests.test_run import tiny_config
from whale.config import load_config
from whale.report import write_report
from whale.run import run_experiment
from whale.schedule import Progress, Schedule
from whale.store import read_metrics


def phases(overrides, steps_per_epoch=10, iteration_cost=10, step_cost=10, max_units=200, patience_at=None):
    """Simulate the run loop: returns the sequence of phases with their lengths."""
    cfg = load_config(None, overrides)
    s = Schedule(cfg, steps_per_epoch, iteration_cost, step_cost)
    p = Progress()
    phase = s.first_phase()
    seq = []
    for _ in range(max_units):
        if phase == "done":
            break
        if phase == "weight":
            n = 0
            while True:
                p.weight_steps += 1
                p.phase_steps += 1
                p.budget_rollouts += step_cost
                n += 1
                p.patience_stop = patience_at is not None and p.phase_steps >= patience_at
                if s.weight_phase_over(p):
                    nxt = s.after_weight_phase(p)
                    if nxt == "weight_more":
                        continue
                    break
            seq.append(("W", n))
            p.phase_steps = 0
            phase = nxt
        else:
            iters = s.harness_iterations_planned()
            done = 0
            for _ in range(iters):
                if s.harness_phase_over(p, done):
                    break
                p.budget_rollouts += iteration_cost
                done += 1
            p.harness_phases += 1
            seq.append(("H", done))
            phase = s.after_harness_phase(p)
    return seq


def test_whale_fixed_alternates_and_ends_on_weight():
    seq = phases(["schedule.kind=whale", "schedule.weight_epochs=0.6", "schedule.harness_iterations=6",
                  "schedule.budget_epochs=2.4"])
    assert seq == [("W", 6), ("H", 6), ("W", 6), ("H", 6), ("W", 6), ("H", 6), ("W", 6)]


def test_weight_only_is_one_long_weight_phase():
    assert phases(["schedule.kind=weight_only", "schedule.budget_epochs=2"]) == [("W", 20)]


def test_harness_only_spends_rollout_budget_on_iterations():
    seq = phases(["schedule.kind=harness_only", "schedule.budget_rollouts=95", "schedule.budget_epochs=null"])
    assert seq == [("H", 9)]


def test_prompt_only_alternates_like_whale():
    cfg = load_config(None, ["schedule.kind=prompt_only"])
    assert Schedule(cfg, 10, 10, 10).prompt_only
    seq = phases(["schedule.kind=prompt_only", "schedule.weight_epochs=0.5", "schedule.harness_iterations=2",
                  "schedule.budget_epochs=1"])
    assert seq == [("W", 5), ("H", 2), ("W", 5)]


def test_stagewise_all_weights_then_all_harness():
    seq = phases(["schedule.kind=stagewise", "schedule.budget_epochs=1.5", "schedule.harness_iterations=7"])
    assert seq == [("W", 15), ("H", 7)]


def test_adaptive_weight_phase_ends_on_patience():
    seq = phases(["schedule.kind=whale", "schedule.adaptive=true", "schedule.min_weight_steps=2",
                  "schedule.budget_epochs=1.2"], patience_at=4)
    assert seq[0] == ("W", 4) and seq[1][0] == "H" and seq[-1][0] == "W"


def test_rollout_budget_skips_harness_phase_it_cannot_follow_with_weights():
    # 6 steps cost 60; a harness phase of 2 iterations (20) + one step (10) needs 30 more
    seq = phases(["schedule.kind=whale", "schedule.weight_epochs=0.6", "schedule.harness_iterations=2",
                  "schedule.budget_rollouts=80", "schedule.budget_epochs=null"])
    assert seq[-1][0] == "W"
    assert sum(n * 10 for k, n in seq) <= 80 + 10


def test_a_harness_phase_that_fits_only_in_part_still_runs():
    """After 6 weight steps (60 rollouts) 35 are left: a whole phase of 3 iterations (30) and a
    step (10) do not fit, the re-scoring and one proposer iteration (20) and a step do; with 25
    left not even that fits and the weights keep the budget."""
    common = ["schedule.kind=whale", "schedule.weight_epochs=0.6", "schedule.harness_iterations=3",
              "schedule.budget_epochs=null"]
    seq = phases(common + ["schedule.budget_rollouts=95"])
    assert [k for k, n in seq] == ["W", "H", "W"] and seq[1][1] >= 2, seq
    assert [k for k, n in phases(common + ["schedule.budget_rollouts=85"])] == ["W"]


def test_a_harness_phase_leaves_the_weight_step_that_follows_it():
    """25 rollouts left, iterations of 10, a confirmation of up to 10, steps of 10: another
    iteration would leave 5 after its confirmation, no weight step; so the phase stops. Kinds
    with no weight phase after the harness phase keep no reserve."""
    p = Progress(budget_rollouts=75)
    for kind, over in (("whale", True), ("gain", True), ("harness_only", False), ("stagewise", False)):
        cfg = load_config(None, [f"schedule.kind={kind}", "schedule.budget_rollouts=100", "schedule.budget_epochs=null"])
        assert Schedule(cfg, 10, 10, 10, harness_phase_extra=10).harness_phase_over(p, 1) is over, kind
    p.budget_rollouts = 65
    cfg = load_config(None, ["schedule.kind=whale", "schedule.budget_rollouts=100", "schedule.budget_epochs=null"])
    assert not Schedule(cfg, 10, 10, 10, harness_phase_extra=10).harness_phase_over(p, 1)


def test_fraction_of_an_epoch_rounds_to_at_least_one_step():
    cfg = load_config(None, ["schedule.weight_epochs=0.01"])
    assert Schedule(cfg, 10, 1, 1).phase_steps_fixed() == 1


# ----------------------------------------------------------------------------- adaptive, exercised
def adaptive_weight_phases(accept_rates, **patience):
    """Weight-phase lengths of an adaptive whale run fed these accept rates, with the run's own
    patience rule (WeightPatience reset at every phase, as run.py does)."""
    from whale.weights.patience import WeightPatience

    cfg = load_config(None, ["schedule.kind=whale", "schedule.adaptive=true", "schedule.min_weight_steps=2",
                             "schedule.budget_epochs=null", f"schedule.budget_steps={len(accept_rates)}"])
    s, p = Schedule(cfg, 100, 10, 10), Progress()
    lengths, rates = [], iter(accept_rates)
    while True:
        rule = WeightPatience(**{"window": 2, "burn_in": 2, "patience": 2, **patience})
        p.phase_steps = 0
        while True:
            rule.update(next(rates))
            p.weight_steps += 1
            p.phase_steps += 1
            p.patience_stop = rule.should_stop()
            if s.weight_phase_over(p):
                break
        lengths.append(p.phase_steps)
        if s.after_weight_phase(p) == "done":
            return lengths


def test_adaptive_weight_phases_last_while_the_accept_rate_improves():
    rising_then_flat = [0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    flat = [0.3] * 10
    assert adaptive_weight_phases(rising_then_flat)[0] == 8  # best 2-step window ends at step 6; 2 stale steps
    assert adaptive_weight_phases(flat)[:2] == [4, 4]  # burn-in 2 + patience 2: a plateau ends phases early
    assert sum(adaptive_weight_phases(flat)) == 10  # the step budget still ends the run


# ----------------------------------------------------------------------------- kind: gain
def gain_phases(weight_slope, harness_gain, budget=2000, explore=2, step_cost=32, iteration_cost=64):
    """Simulate a `gain` run: weight phases see accept rates rising by weight_slope(i) per step;
    harness phase i gains harness_gain(i) on fresh samples. Returns the phase sequence."""
    cfg = load_config(None, ["schedule.kind=gain", "schedule.weight_epochs=0.01", "schedule.harness_iterations=2",
                             "schedule.budget_epochs=null", f"schedule.budget_rollouts={budget}",
                             f"schedule.gain_explore={explore}"])
    s, p = Schedule(cfg, 100, iteration_cost, step_cost, harness_phase_extra=16), Progress()
    seq, phase, w, h = [], s.first_phase(), 0, 0
    while phase != "done" and len(seq) < 100:
        p.phase_start_rollouts = p.budget_rollouts
        if phase == "weight":
            p.phase_steps, p.phase_accept_rates = 0, []
            while True:
                p.weight_steps += 1
                p.phase_steps += 1
                p.budget_rollouts += step_cost
                p.phase_accept_rates.append(0.2 + weight_slope(w) * p.phase_steps)
                if s.weight_phase_over(p):
                    s.record_weight_phase(p)
                    phase = s.after_weight_phase(p)
                    if phase != "weight_more":
                        break
            seq.append("W")
            w += 1
        else:
            p.budget_rollouts += 2 * iteration_cost + 16
            s.record_harness_phase(p, harness_gain(h))
            phase = s.after_harness_phase(p)
            seq.append("H")
            h += 1
    return "".join(seq), p


def test_gain_tries_each_side_once_then_follows_the_higher_gain_per_rollout():
    seq, p = gain_phases(lambda i: 0.0, lambda i: 0.25 if i < 3 else 0.0)  # harness pays, weights never
    assert seq.startswith("WHW")  # each side once; weights retried once under the harness the search accepted
    # then harness again (it gained, weights did not); weights (empty twice) are retried after 2 x 4
    assert seq.startswith("WHWHHHHHHHHW")
    assert p.gains[0]["phase"] == "weight" and p.gains[1]["per_rollout"] == pytest.approx(0.25 / 144, rel=1e-3)


def test_gain_retries_a_stalled_side_and_alternates_when_nothing_pays():
    seq, _ = gain_phases(lambda i: 0.05, lambda i: 0.0)  # weights pay, harness search never finds anything
    assert seq.startswith("WHWWWWHWWWWWWWWH")  # explored after 4, then 8 weight phases: backoff
    assert seq.count("H") == 3
    seq, _ = gain_phases(lambda i: 0.0, lambda i: 0.0, budget=700)
    assert seq.startswith("WHWH")  # no side gains: WHALE's alternation
    assert seq.endswith("W")  # and the budget still ends on a weight phase


def test_gain_a_noisy_weight_phase_does_not_hand_the_budget_to_a_harness_that_never_paid():
    # weight phases alternate +0.05 / -0.01 accept-rate slopes (the noise of 4-step slopes);
    # harness search never finds anything. The old rule alternated after every negative phase
    # (WHWHWWHWWH...: 7 harness phases); the run record keeps the budget on the weights.
    seq, _ = gain_phases(lambda i: 0.05 if i % 2 == 0 else -0.01, lambda i: 0.0)
    assert seq.startswith("WHWWWWH") and seq.count("H") == 3


def test_gain_weight_phases_have_at_least_two_steps_and_the_budget_is_kept():
    cfg = load_config(None, ["schedule.kind=gain", "schedule.weight_epochs=0.01"])
    assert Schedule(cfg, 10, 10, 10).phase_steps_fixed() == 2
    seq, p = gain_phases(lambda i: 0.01, lambda i: 0.1, budget=1000)
    assert p.budget_rollouts <= 1000 + 32 and seq.endswith("W")


def test_harness_only_can_repeat_phases_for_a_curve():
    seq = phases(["schedule.kind=harness_only", "schedule.budget_rollouts=95", "schedule.budget_epochs=null",
                  "schedule.harness_iterations=4", "schedule.repeat_harness_phases=true"])
    assert seq == [("H", 4), ("H", 4), ("H", 1)]  # 9 iterations in all, as with one long phase


def test_harness_only_does_not_repeat_a_phase_that_spent_nothing():
    """Its incoming harness's scores reused and a proposer with nothing left to write
    (Proposer.exhausted): the phase changed nothing, and under frozen weights the next one would
    repeat it for ever without spending the budget that ends the run."""
    cfg = load_config(None, ["schedule.kind=harness_only", "schedule.budget_rollouts=95", "schedule.budget_epochs=null",
                             "schedule.harness_iterations=4", "schedule.repeat_harness_phases=true"])
    s = Schedule(cfg, 10, 10, 10)
    assert s.after_harness_phase(Progress(budget_rollouts=40, phase_start_rollouts=30)) == "harness"
    assert s.after_harness_phase(Progress(budget_rollouts=40, phase_start_rollouts=40)) == "done"


def test_gain_schedule_runs_end_to_end_and_reports_gains_by_phase(tiny_model_dir, tmp_path, monkeypatch):
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.syspath_prepend(tests)  # the tiny config's domain module (toy:ParityDomain)
    monkeypatch.setenv("PYTHONPATH", tests + ":" + os.environ.get("PYTHONPATH", ""))
    run_dir = run_experiment(tiny_config(tiny_model_dir, **{"schedule.kind": "gain"}), out=tmp_path / "gain")
    rows = read_metrics(run_dir)
    gains = [r for r in rows if r.get("event") == "phase_gain"]
    assert [g["phase"] for g in gains[:2]] == ["weight", "harness"]  # each side once first
    assert all(g["rollouts"] > 0 and "per_rollout" in g for g in gains)
    assert sum(r.get("event") == "weight_step" for r in rows) == 4  # the budget: 1 epoch of 4 steps
    report = write_report(run_dir).read_text()
    assert "Which phase bought how much" in report and "| val | W1 |" in report


def test_gain_weight_phases_in_a_row_are_separate_phases(tiny_model_dir, tmp_path, monkeypatch):
    """A gain run whose schedule picks weights again after a weight phase starts a new phase: its
    own start, accept rates and gains row (so streaks, retries and slopes see phases, not one
    ever-growing phase). Before the fix, the phases merged into one row."""
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.syspath_prepend(tests)
    monkeypatch.setenv("PYTHONPATH", tests + ":" + os.environ.get("PYTHONPATH", ""))
    real = Schedule.gain_next
    monkeypatch.setattr(Schedule, "gain_next", lambda self, p, last: "weight" if p.harness_phases else real(self, p, last))
    cfg = tiny_config(tiny_model_dir, **{"schedule.kind": "gain", "schedule.budget_epochs": 1.5})
    run_dir = run_experiment(cfg, out=tmp_path / "gain")
    gains = json.loads((run_dir / "state.json").read_text())["progress"]["gains"]
    step_cost = cfg.weight.problems_per_step * cfg.weight.samples_per_problem
    assert [g["phase"] for g in gains] == ["weight", "harness", "weight", "weight"]
    assert [g["rollouts"] for g in gains if g["phase"] == "weight"] == [2 * step_cost] * 3


def test_gain_a_replaced_harness_sends_the_budget_back_to_the_weights():
    """Comparison seed 0: the first harness phase replaced h0 (fresh gain +0.22) while the weight
    side's slope, measured under h0, was small; the old rule ran a second harness phase under the
    same weights (192 rollouts, nothing found) before the weights could train under the new
    harness. A replaced harness makes the weight side's estimate stale: it runs next, once it has
    paid at all or while it has not yet run under a harness the search accepted (round 3, seed 1:
    0 of 32 accepted under h0, so its gain was exactly 0 and the old guard sent a second harness
    phase, 512 rollouts, nothing found); a weight side that had that turn and still never paid is
    not forced again (harness-bound domains keep WHWHH...)."""
    seq, _ = gain_phases(lambda i: 0.01, lambda i: 0.25 if i < 3 else 0.0)
    assert seq.startswith("WHWHWHW")
    seq, _ = gain_phases(lambda i: 0.0, lambda i: 0.25 if i < 3 else 0.0)
    assert seq.startswith("WHWHH")


def test_only_the_first_confirmation_round_is_reserved_and_later_ones_ask_the_budget():
    """The reserve of a harness phase is one confirmation round whatever confirm_rounds is (a
    worst-case reserve cost harness-only seed 4 its last phase: docs/results/cmp_seq); a further
    round may spend only what is left after the weight step that must follow."""
    cfg = load_config(Path(__file__).parent.parent / "configs" / "demo.yaml")
    one = Schedule.for_config(cfg, steps_per_epoch=1, harness_problems=32)
    cfg.harness.confirm_rounds = 3
    three = Schedule.for_config(cfg, steps_per_epoch=1, harness_problems=32)
    first_round = (cfg.harness.confirm_top + 1) * 32 * cfg.harness.confirm_samples
    assert three.harness_phase_extra == one.harness_phase_extra == first_round
    assert three.weight_phase_follows()  # the demo ends with a weight phase
    step, budget = three.weight_step_cost, cfg.schedule.budget_rollouts
    assert three.can_spend(Progress(budget_rollouts=budget - step - 100), 100)
    assert not three.can_spend(Progress(budget_rollouts=budget - step - 99), 100)  # would take the weight step's
    cfg.schedule.budget_rollouts = None
    assert Schedule.for_config(cfg, 1, 32).can_spend(Progress(budget_rollouts=10 ** 9), 10 ** 6)
