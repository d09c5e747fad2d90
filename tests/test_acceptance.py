"""Acceptance that noise cannot fool: the paired decision rules, the null probe on fresh samples,
and the search loop on an engine whose successes are coin flips."""

from __future__ import annotations

import math
import random
import re

import pytest

from whale.config import Config
from whale.engine.base import Generation
from whale.engine.null import NullEngine
from whale.rollout.runner import RolloutRunner
from whale.harness.acceptance import choose, confirm_sequentially, paired_test, pooled, sign_flip_p
from whale.harness.archive import Archive
from whale.harness.guard import null_probe
from whale.harness.loop import HarnessSearch
from whale.harness.proposal import Proposal
from whale.store import BUDGET_PURPOSES
from tests.toy import H0, ScriptedEngine, ToyDomain


# ----------------------------------------------------------------------------- the rules, pure
def test_sign_flip_p_is_exact_for_few_differences():
    assert sign_flip_p([1, 1, 1] + [0] * 29) == pytest.approx(1 / 8)  # 3 won, none lost: not shown at 0.05
    assert sign_flip_p([1] * 5 + [0] * 27) == pytest.approx(1 / 32)
    assert sign_flip_p([0.0] * 10) == 1.0
    assert sign_flip_p([1, -1]) == pytest.approx(3 / 4)
    many = [1.0] * 30 + [-1.0] * 10
    assert sign_flip_p(many) == pytest.approx(sum(math.comb(40, j) for j in range(30, 41)) / 2 ** 40)  # exact
    floats = [random.Random(i).random() for i in range(60)]  # arbitrary floats: too many sums, sampled
    assert 0 < sign_flip_p(floats, seed=1) < 1e-3


def test_paired_test_uses_only_common_problems():
    t = paired_test({"a": 1.0, "b": 0.5, "c": 1.0}, {"a": 0.0, "b": 0.5, "z": 1.0})
    assert t.n == 2 and t.gain == pytest.approx(0.5) and t.mean_a == pytest.approx(0.75)


def test_a_tiny_p_value_is_recorded_and_reported_as_tiny_not_zero():
    from whale.report import fmt_p
    t = paired_test({f"q{i}": 1.0 for i in range(20)}, {f"q{i}": 0.0 for i in range(20)})
    assert t.p == pytest.approx(2.0 ** -20)  # every one of 20 problems won: the exact p
    recorded = t.to_json()["p"]
    assert 0 < recorded == pytest.approx(t.p, rel=1e-2)  # 4 decimals would have recorded 0.0
    assert fmt_p(recorded) == "p < 0.0001" and fmt_p(0.0) == "p < 0.0001" and fmt_p(0.0625) == "p = 0.0625"


def _draw(rng, rate, problems, k):
    return {f"p{i}": sum(rng.random() < rate for _ in range(k)) / k for i in range(problems)}


def _phase(rng, rates, incoming_rate, *, problems=16, k_select=1, k_fresh=2, top=2):
    """One simulated harness phase: select on one draw, decide by `choose` on fresh draws."""
    selection = {f"c{j}": _draw(rng, r, problems, k_select) for j, r in enumerate(rates)}
    incoming_sel = _draw(rng, incoming_rate, problems, k_select)
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    ranked = sorted((c for c in selection if mean(selection[c]) > mean(incoming_sel)), key=lambda c: -mean(selection[c]))
    old_rule = ranked[0] if ranked else None  # best on the selection traces wins
    fresh = {c: _draw(rng, rates[int(c[1:])], problems, k_fresh) for c in ranked[:top]}
    new_rule, _ = choose(_draw(rng, incoming_rate, problems, k_fresh), fresh, alpha=0.05)
    return old_rule, new_rule


def test_a_lucky_candidate_on_noise_is_not_accepted():
    """Four candidates exactly as good as the incoming harness (success 0.3), 16 problems x 1 sample:
    the best of them beats the incoming score by chance most of the time; the fresh paired test
    almost never lets one through."""
    rng = random.Random(0)
    outcomes = [_phase(rng, [0.3] * 4, 0.3) for _ in range(300)]
    old = sum(o is not None for o, _ in outcomes) / len(outcomes)
    new = sum(n is not None for _, n in outcomes) / len(outcomes)
    assert old > 0.6 and new < 0.05, (old, new)


def test_a_real_gain_is_accepted():
    rng = random.Random(1)
    outcomes = [_phase(rng, [0.3, 0.3, 0.75], 0.3) for _ in range(200)]
    assert sum(n == "c2" for _, n in outcomes) / len(outcomes) > 0.9
    wrong = sum(n not in (None, "c2") for _, n in outcomes) / len(outcomes)
    assert wrong < 0.05


def test_margin_and_alpha_are_respected():
    base = {f"p{i}": 0.0 for i in range(32)}
    better = {f"p{i}": 1.0 if i < 6 else 0.0 for i in range(32)}  # +0.19, p = 1/64
    assert choose(base, {"a": better}, alpha=0.05)[0] == "a"
    assert choose(base, {"a": better}, alpha=0.01)[0] is None
    assert choose(base, {"a": better}, alpha=0.05, margin=0.2)[0] is None
    winner, tests = choose(base, {"a": better, "b": better}, alpha=0.05)  # Bonferroni: 0.025 each
    assert winner == "a" and tests["b"]["level"] == pytest.approx(0.025) and tests["b"]["passes"]


def test_pooled_averages_rounds_on_common_problems():
    assert pooled([{"a": 1.0, "b": 0.0}, {"a": 0.5, "b": 1.0, "c": 1.0}]) == {"a": 0.75, "b": 0.5}
    assert pooled([]) == {}


def _sequential_accepts(rng, base_rates, gain, rounds, k=2):
    rates = {"h0": base_rates, "c": [min(1.0, b + gain) for b in base_rates]}
    draws = []
    def draw(cid, r):  # noqa: E306
        draws.append((cid, r))
        return {f"p{i}": sum(rng.random() < x for _ in range(k)) / k for i, x in enumerate(rates[cid])}
    _, history = confirm_sequentially(draw, "h0", ["c"], alpha=0.05, rounds=rounds)
    assert draws == [(h, r) for r in range(len(history)) for h in ("h0", "c")]  # paired rounds, in order
    for tests in history:
        assert tests["c"]["level"] == pytest.approx(0.05 / rounds, abs=1e-4)  # alpha split over the rounds
    return history[-1]["c"]["passes"], len(history)


def test_sequential_confirmation_keeps_the_bound_and_buys_power():
    """64 problems x 2 fresh samples per round. An equal candidate is accepted at most alpha of the
    time with 3 rounds as with 1; a small true gain (+0.06) is accepted clearly more often with 3
    rounds, and a clear loss or win stops after one round."""
    rng = random.Random(3)
    base = [rng.choice([0.0, 0.1, 0.3, 0.6, 0.9]) for _ in range(64)]
    trials = 300
    null3 = [_sequential_accepts(rng, base, 0.0, 3) for _ in range(trials)]
    assert sum(a for a, _ in null3) / trials < 0.05
    small1 = sum(_sequential_accepts(rng, base, 0.06, 1)[0] for _ in range(trials)) / trials
    small3 = [_sequential_accepts(rng, base, 0.06, 3) for _ in range(trials)]
    power3 = sum(a for a, _ in small3) / trials
    assert power3 > small1 + 0.1, (small1, power3)
    assert 1 < sum(n for _, n in small3) / trials < 3  # extra rounds only while undecided
    big = [_sequential_accepts(rng, base, 0.3, 3) for _ in range(50)]
    assert all(a and n == 1 for a, n in big)
    loss = [_sequential_accepts(rng, base, -0.3, 3) for _ in range(50)]
    assert all(not a and n == 1 for a, n in loss)


def test_a_refused_round_ends_the_confirmation_as_it_stands():
    base = {f"p{i}": 0.0 for i in range(32)}
    ahead = {f"p{i}": 1.0 if i < 3 else 0.0 for i in range(32)}  # 3 won, none lost: p = 1/8, not shown
    asked = []
    def draw(cid, r):  # noqa: E306
        return ahead if cid == "c" else base
    def more(alive, r):  # noqa: E306
        asked.append((list(alive), r))
        return False
    rates, history = confirm_sequentially(draw, "h0", ["c"], alpha=0.05, rounds=3, more=more)
    assert asked == [(["c"], 1)] and len(history) == 1 and not history[0]["c"]["passes"]
    assert rates == {"c": ahead}
    _, allowed = confirm_sequentially(draw, "h0", ["c"], alpha=0.05, rounds=3, more=lambda a, r: True)
    assert len(allowed) == 3  # the same draws every round: still not shown, all three rounds spent


# ----------------------------------------------------------------------------- with real rollouts
class CoinEngine(ScriptedEngine):
    """Right answer with probability 0.9 when the prompt says 'carefully', 0.55 'steadily', else 0.3; the coin is
    seeded by the request's seed and its prompt, so different prompts give independent coins on
    the same seeds (as a real model's samples would)."""

    returns_ids = False

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            text = " ".join(m["content"] for m in r.messages)
            a, b = (int(x) for x in re.findall(r"What is (\d+) \+ (\d+)", text)[0])
            rate = 0.9 if "carefully" in text else 0.55 if "steadily" in text else 0.3
            gens = []
            for i in range(r.n):
                rng = random.Random(f"{r.seed}/{i}/{text}")
                ans = str(a + b) if rng.random() < rate else "?"
                gens.append(Generation(text=ans, finish_reason="stop", weights_version=self.weights_version,
                                       prompt_tokens=len(text.split()), completion_tokens=1))
            out.append(gens)
        return out


def variant(note: str) -> str:
    return H0.replace('"You add numbers."', repr(f"You add numbers. {note}"))


class OneRound:
    name = "scripted"
    last_error, last_usage, exhausted = None, {}, False

    def __init__(self, sources):
        self.sources = sources

    def propose(self, archive, domain, n, workspace, context):
        out, self.sources = [Proposal(s, "noise", "prompt") for s in self.sources], []
        return out


@pytest.fixture(scope="module")
def coin():
    cfg = Config()
    cfg.runner.concurrency = 8
    cfg.harness.smoke_examples = 1
    domain = ToyDomain(16)
    runner, null = RolloutRunner(CoinEngine(), domain, cfg), RolloutRunner(NullEngine(), domain, cfg)
    yield cfg, domain, runner, null
    runner.close()
    null.close()


def run_search(coin, tmp_path, sources, seed, can_spend=None):
    cfg, domain, runner, null = coin
    cfg = cfg.model_copy(deep=True)
    cfg.seed, cfg.harness.candidates_per_iteration = seed, len(sources)
    archive = Archive(tmp_path / f"run{seed}")
    archive.add_candidate(H0, None, "base")
    ledger = []
    search = HarnessSearch(cfg, domain, runner, archive, OneRound(sources), progress=False, null_runner=null,
                           ledger_callback=lambda p, t: ledger.append((p, len(t))))
    return search.run_phase("h0", "base", iterations=2, can_spend=can_spend), archive, ledger


def test_search_keeps_the_incoming_harness_against_lucky_noise(coin, tmp_path):
    lucky_seen = 0
    for seed in range(2):
        noise = [variant(f"Note {j}.") for j in range(4)]  # all as good as h0 (0.3)
        result, archive, ledger = run_search(coin, tmp_path, noise, seed)
        best = archive.ranking("base")[0]
        lucky_seen += best != "h0"
        assert result.accepted_id == "h0" and result.gain == 0.0
        if best != "h0":  # the old rule would have taken `best`; the fresh re-run refused it
            confirms = [r for r in result.history if r["event"] == "confirm"]
            assert confirms and not any(r["passes"] for r in confirms)
            assert ("confirm", 16 * 2) in ledger  # incoming and candidates re-run: 16 problems x 2
    assert lucky_seen >= 1  # the selection was fooled, so the test is not vacuous


def test_search_accepts_a_real_gain_with_its_fresh_paired_gain(coin, tmp_path):
    sources = [variant("Note 1."), variant("Add carefully.")]
    result, archive, ledger = run_search(coin, tmp_path, sources, seed=7)
    assert result.accepted_id == "h2" and 0.3 < result.gain < 0.9
    confirm = archive.meta("h2")["confirm"]["base/p1"]
    assert confirm["k"] == 2 and confirm["mean"] > 0.7
    probe = archive.meta("h2")["null_probe"]["base/p1"]
    assert not probe["flagged"] and probe["null"] == 0.0  # the null engine never adds numbers
    assert "confirm" in BUDGET_PURPOSES


def test_sequential_confirmation_in_the_loop_accepts_a_modest_gain_one_round_missed(coin, tmp_path):
    """'steadily' is right 0.55 of the time against h0's 0.3, on 16 problems x 2 fresh samples per
    round. On seed 0 the first round shows nothing (p = 0.5): one round keeps h0; with three, the
    rounds pooled accept it, and every round's rollouts are counted, cached and reported."""
    cfg, domain, runner, null = coin
    one, _, _ = run_search(coin, tmp_path / "one", [variant("Add steadily.")], seed=0)
    assert one.accepted_id == "h0"
    cfg3 = cfg.model_copy(deep=True)
    cfg3.harness.confirm_rounds = 3
    result, archive, ledger = run_search((cfg3, domain, runner, null), tmp_path / "three", [variant("Add steadily.")], seed=0)
    confirms = [r for r in result.history if r["event"] == "confirm"]
    assert [r["round"] for r in confirms] == [1, 2, 3] and all(r["rounds"] == 3 for r in confirms)
    assert [r["passes"] for r in confirms] == [False, False, True]
    assert all(r["level"] == pytest.approx(0.05 / 3, abs=1e-4) for r in confirms)
    assert result.accepted_id == "h1" and result.gain == pytest.approx(confirms[-1]["gain"])
    assert ledger.count(("confirm", 16 * 2)) == 6  # incoming and candidate, three rounds
    for cid in ("h0", "h1"):
        assert sorted(archive.meta(cid)["confirm"]) == ["base/p1", "base/p1/r2", "base/p1/r3"]
    first = archive.meta("h1")["confirm"]["base/p1"]["per_problem"]
    one_first = Archive(tmp_path / "one" / "run0").meta("h1")["confirm"]["base/p1"]["per_problem"]
    assert first and first == one_first  # round 1 is the same draw with one round or three: the same seeds

    asked = []  # a budget with room for one more round only: round 3 is refused, asked with its cost
    budget = lambda n: asked.append(n) or len(asked) == 1  # noqa: E731
    cut, cut_archive, cut_ledger = run_search((cfg3, domain, runner, null), tmp_path / "cut", [variant("Add steadily.")],
                                              seed=0, can_spend=budget)
    assert asked == [2 * 16 * 2, 2 * 16 * 2] and cut.accepted_id == "h0"  # incoming + candidate, 16 x 2 each
    assert [r["event"] for r in cut.history if r["event"].startswith("confirm")] == ["confirm", "confirm", "confirm_stopped"]
    assert cut_ledger.count(("confirm", 16 * 2)) == 4


def test_null_probe_passes_a_small_real_gain_and_flags_a_harness_that_ignores_the_model(coin):
    cfg, domain, runner, null = coin
    cfg = cfg.model_copy(deep=True)
    cfg.harness.null_probe_items = 16
    items = domain.problems
    small = {p.id: (1.0 if i < 2 else 0.0) for i, p in enumerate(items)}  # real 0.125, null 0.0
    honest = null_probe(runner, H0, items, cfg, null_runner=null, real_rewards=small, samples=2)
    assert honest["real"] < 0.2 and honest["null"] == 0.0 and not honest["flagged"]  # old rule: flagged (< 0.05 drop)
    cheat = H0.replace("env.submit(str(out))", "env.submit(str(env.add(*[int(x) for x in "
                       "__import__('re').findall(r'\\d+', env.question)[:2]])))")
    fresh = {p.id: 1.0 for p in items}
    flagged = null_probe(runner, cheat, items, cfg, null_runner=null, real_rewards=fresh, samples=1)
    assert flagged["null"] == 1.0 and flagged["p"] == 1.0 and flagged["flagged"]
