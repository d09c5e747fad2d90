"""Each schedule's phase sequence, driven by the same state machine the run uses."""


from whale.config import load_config
from whale.schedule import Progress, Schedule


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


def test_fraction_of_an_epoch_rounds_to_at_least_one_step():
    cfg = load_config(None, ["schedule.weight_epochs=0.01"])
    assert Schedule(cfg, 10, 1, 1).phase_steps_fixed() == 1
