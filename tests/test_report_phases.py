"""The report's phase attribution: each phase's gain between consecutive evaluations."""

from whale.compare import _mean_sd
from whale.report import phase_attribution


def ev(split, tag, per_problem, rollouts):
    return {"event": "eval", "split": split, "tag": tag, "per_problem": per_problem, "n": len(per_problem), "k": 2,
            "mean_at_k": sum(per_problem) / len(per_problem), "ledger": {"budget_rollouts": rollouts}}


def test_gains_are_attributed_to_the_phases_between_evaluations():
    n = 40
    rows = [ev("test", "initial", [0.0] * n, 0),
            {"event": "weight_step"}, {"event": "weight_step"},
            ev("test", "w2", [0.0] * n, 64),
            {"event": "rescore"}, {"event": "iteration_end"}, {"event": "iteration_end"},
            ev("test", "c0-h", [1.0] * 10 + [0.0] * 30, 200),
            {"event": "weight_step"},
            ev("val", "w3", [0.5] * n, 232),  # another split does not break the test chain
            {"event": "weight_step"},
            ev("test", "w4", [1.0] * 20 + [0.0] * 20, 264)]
    parts = phase_attribution(rows, "test")
    assert [p["phases"] for p in parts] == ["W1", "H1", "W2"]
    assert [p["gain"] for p in parts] == [0.0, 0.25, 0.25]
    assert parts[1]["ci95"][0] > 0 and parts[0]["ci95"] == [0.0, 0.0]  # paired over the same problems
    assert [p["budget_rollouts"] for p in parts] == [64, 136, 64]
    assert phase_attribution(rows, "val") == []  # one val evaluation: nothing to attribute


def test_compare_table_says_when_a_mean_covers_fewer_runs():
    """A run without a value (e.g. no test evaluation at its val-best checkpoint) must not make a
    mean over the others read as a mean over all runs."""
    assert _mean_sd([0.5, 0.7]) == "0.600 ± 0.141"
    assert _mean_sd([0.33, None, None]) == "0.330 (1 of 3 runs)"
    assert _mean_sd([0.2, 0.4, None]) == "0.300 ± 0.141 (2 of 3 runs)"
    assert _mean_sd([None]) == "-"
    assert _mean_sd([1536, 1536], digits=0) == "1536 ± 0"


def test_a_phase_that_changed_nothing_does_not_make_an_interval_mixed():
    """A weight phase that trained nothing (every step accepted nothing: no new version) is
    followed by no evaluation (same pair), so the next interval spans it and the harness phase
    after it; the gain belongs to the harness phase. Likewise a harness phase that kept its
    incoming harness leaves the interval to the weight phase around it."""
    n = 20
    rows = [ev("val", "initial", [0.0] * n, 0),
            {"event": "weight_step", "harness": "h0", "weights_version": None},
            {"event": "weight_step", "harness": "h0", "weights_version": None},
            {"event": "rescore", "harness": "h0"}, {"event": "iteration_end", "harness": "h0"},
            {"event": "harness_accepted", "harness": "h5", "accepted": "h5"},
            ev("val", "c0-h", [1.0] * 5 + [0.0] * 15, 100),
            {"event": "weight_step", "harness": "h5", "weights_version": "w2"},
            {"event": "rescore", "harness": "h5"}, {"event": "iteration_end", "harness": "h5"},
            {"event": "harness_accepted", "harness": "h5", "accepted": "h5"},
            {"event": "weight_step", "harness": "h5", "weights_version": "w3"},
            ev("val", "w4", [1.0] * 10 + [0.0] * 10, 200),
            {"event": "weight_step", "harness": "h5", "weights_version": "w4"},
            {"event": "rescore", "harness": "h5"}, {"event": "iteration_end", "harness": "h5"},
            {"event": "harness_accepted", "harness": "h7", "accepted": "h7"},
            ev("val", "c2-h", [1.0] * 12 + [0.0] * 8, 300)]
    parts = phase_attribution(rows, "val")
    assert [(p["phases"], p["idle"]) for p in parts] == [("H1", ["W1"]), ("W2+W3", ["H2"]), ("W3+H3", [])]  # W3 goes on past w4
    assert [round(p["gain"], 6) for p in parts] == [0.25, 0.25, 0.1]


def test_reach_table_names_the_seeds_where_the_reference_never_scored():
    """A best of 0 is reached by every run at its start: the seed is left out, and said so."""
    from whale.compare import _reach_table

    def run(seed, vals):
        return {"cfg": {"seed": seed}, "rows": [ev("val", f"t{i}", [v] * 4, 32 * i) for i, v in enumerate(vals)]}

    by_method = {"weight_only": [run(0, [0.0, 0.0]), run(1, [0.0, 0.5]), run(2, [])],  # seed 2: no val curve at all
                 "whale": [run(0, [0.0, 0.25]), run(1, [0.0, 0.75])]}
    lines = _reach_table(by_method, "weight_only")
    assert "| whale | 1/1 | 32 |" in lines and "| weight_only | 1/1 | 32 |" in lines
    assert lines[-1].startswith("Left out: seed 0, where weight_only's best val mean@k is 0")  # not seed 2
