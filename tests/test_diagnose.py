"""The search reads its archive: failure modes from raw traces, mechanisms chosen for them."""

from __future__ import annotations

import random
from pathlib import Path

from whale.config import Config
from whale.harness import mutation as M
from whale.harness.archive import Archive
from whale.harness.brief import make_brief
from whale.domains.chess.domain import ChessDomain
from whale.domains.math.domain import MathDomain
from whale.domains.searchqa.domain import SearchQADomain
from whale.domains.searchqa.hints import key_terms
from whale.harness.diagnose import diagnose, episode_modes
from whale.harness.proposal import ProposalContext
from whale.rollout.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
SEARCHQA_H0 = (ROOT / "whale" / "domains" / "searchqa" / "h0.py").read_text()


def row(question, query=None, passages=(), answer="<answer>x</answer>", reward=0.0, finish="stop", error=None):
    tools = []
    if query is not None:
        tools.append({"name": "search", "args": [query], "kwargs": {"k": 1},
                      "result": [{"title": t, "text": x} for t, x in passages], "error": None})
    if answer is not None:
        tools.append({"name": "submit", "args": [answer], "kwargs": {}, "result": {"ok": True}, "error": None})
    return {"problem_id": question, "question": question, "reward": reward, "answer": answer, "error": error,
            "calls": [{"messages": [], "completion": "", "finish_reason": finish}], "tool_calls": tools}


Q = "What is the capital of Kenya?"
KENYA = ("Kenya: Government > Capital > name", "Nairobi")
RELATION_FIXES = {"hint: " + n for n in ("more_passages", "longer_passages", "query_rewrite", "question_as_query",
                                          "more_search_turns")}
RELATION_KEEPS_LAYOUT = {"hint: query_rewrite", "hint: question_as_query"}


def searchqa_modes(r):
    return episode_modes(r, SearchQADomain.answer_format, SearchQADomain.hints)


def by_label():
    return {m.label: m for m in M.mutations_for(SearchQA(), Config())}


def test_key_terms_split_entity_from_what_is_asked():
    assert key_terms("What is the currency of San Marino?") == (["san", "marino"], ["currency"])
    assert key_terms("What is the capital of Côte d'Ivoire?")[0][0] == "cote"


def test_each_searchqa_failure_mode_is_recognised():
    cases = {
        "off_topic_query": row(Q, "your query", [("Paris: Government > Capital > name", "Paris")]),
        "off_topic_retrieval": row(Q, "Kenya capital", [("Paris: Government > Capital > name", "Paris")]),
        "missing_relation": row("What is the currency of Kenya?", "Kenya", [KENYA]),
        "empty_retrieval": row(Q, "Kenya", []),
        "unused_tool": row(Q),
        "long_answer": row(Q, "Kenya", [KENYA], answer="<answer>The capital of Kenya is a big city</answer>"),
        "empty_answer": row(Q, "Kenya", [KENYA], answer="<answer></answer>"),
        "no_answer_tag": row(Q, "Kenya", [KENYA], answer="Mombasa"),
        "no_submission": row(Q, "Kenya", [KENYA], answer=None, error="never submitted"),
        "length_cutoff": row(Q, "Kenya", [KENYA], finish="length"),
        "harness_error": row(Q, "Kenya", [KENYA], error="harness raised ValueError: boom"),
        "wrong_answer": row(Q, "Kenyan capital", [KENYA], answer="<answer>Mombasa</answer>"),
    }
    for mode, r in cases.items():
        assert mode in searchqa_modes(r), (mode, searchqa_modes(r))
    assert searchqa_modes(cases["wrong_answer"]) == ["wrong_answer"]


def test_diagnosis_counts_failures_only_and_names_the_dominant_mode():
    rows = [row(Q, "your query", [("Paris: x", "Paris")]) for _ in range(5)] + \
        [row(Q, "Kenya", [KENYA], answer="<answer>It is the city of Nairobi in Kenya</answer>") for _ in range(2)] + \
        [row(Q, "Kenya", [KENYA], answer="<answer>Nairobi</answer>", reward=1.0) for _ in range(3)]
    d = diagnose(rows, SearchQADomain.answer_format, SearchQADomain.hints)
    assert (d.episodes, d.failures, d.dominant) == (10, 7, "off_topic_query")
    assert d.counts["long_answer"] == 2 and "off_topic_query in 5/7" in d.text()
    assert "All 3 episodes succeeded" in diagnose(rows[-3:], SearchQADomain.answer_format, SearchQADomain.hints).text()


def test_math_and_chess_modes():
    boxed = row("Compute 2+2.", answer="The answer is 4")
    assert {"unused_tool", "no_boxed_answer", "format_mismatch"} <= set(episode_modes(boxed, MathDomain.answer_format,
                                                                                       MathDomain.hints))
    assert episode_modes(boxed, MathDomain.answer_format) == ["format_mismatch"]  # hints off: the general mode only
    illegal = {"question": "mate", "reward": 0.0, "answer": "e2e5", "calls": [],
               "tool_calls": [{"name": "move", "args": ["e2e5"], "kwargs": {},
                               "result": {"error": "illegal or unparsable move 'e2e5' in this position"}}]}
    assert "illegal_move" in episode_modes(illegal, ChessDomain.answer_format, ChessDomain.hints)
    assert episode_modes(row("anything", answer="7")) == ["wrong_answer"]  # a domain that declares nothing


class SearchQA:
    name = "searchqa"
    brief = "search QA"
    answer_format = SearchQADomain.answer_format
    hints = SearchQADomain.hints


def archive_with(tmp_path, rows, version: str = "v0") -> Archive:
    from whale.rollout.trajectory import Trajectory

    archive = Archive(tmp_path)
    archive.add_candidate(SEARCHQA_H0, None, "base")
    trajs = []
    for i, r in enumerate(rows):
        r = {**r, "problem_id": f"p{i}", "sample": 0, "harness_id": "h0"}
        trajs.append(Trajectory.from_json(r))
    archive.record_scores("h0", version, trajs)
    return archive


def test_mutation_proposer_addresses_the_dominant_failure_and_says_why(tmp_path):
    ctx = ProposalContext(iteration=2, weights_version="v0", incoming_id="h0")
    bad_queries = archive_with(tmp_path / "a", [row(Q, "your query", [("Paris: x", "Paris")])] * 8)
    for seed in range(4):
        first = M.MutationProposer(seed=seed).propose(bad_queries, SearchQA(), 2, tmp_path / "ws", ctx)
        assert {p.mechanism for p in first} == {"hint: question_as_query", "hint: force_retrieval"}
    hyp = first[0].hypothesis
    assert "off_topic_query in 8/8" in hyp and "addresses off_topic_query" in hyp and first[0].parent == "h0"
    sentences = archive_with(tmp_path / "b", [row(Q, "Kenya", [KENYA], answer="<answer>" + "word " * 9 + "</answer>")] * 8)
    got = M.MutationProposer(seed=0).propose(sentences, SearchQA(), 2, tmp_path / "ws", ctx)
    assert len(got) == 2 and \
        all("long_answer" in by_label()[p.mechanism].fixes for p in got)


def test_brief_carries_the_same_diagnosis(tmp_path):
    text = diagnose([row(Q, "your query", [("Paris: x", "Paris")])], SearchQADomain.answer_format,
                    SearchQADomain.hints).text()
    brief = make_brief(SearchQA(), Config(), 2, weights_version="v0", incoming_id="h0", diagnoses={"h0": text})
    assert "What the traces show" in brief and text in brief
    assert "adapted to the layout" in brief  # trained weights: keep the context's layout
    assert "adapted to the layout" not in make_brief(SearchQA(), Config(), 2, weights_version="base", incoming_id="h0")


def test_a_mechanism_evaluated_under_old_weights_is_proposed_again_under_new_ones(tmp_path):
    archive = archive_with(tmp_path, [row(Q, "your query", [("Paris: x", "Paris")])] * 8)
    ctx = ProposalContext(iteration=2, weights_version="v0", incoming_id="h0")
    first = M.MutationProposer(seed=0).propose(archive, SearchQA(), 1, tmp_path / "ws", ctx)
    cid = archive.add_candidate(first[0].source, "h0", "mutation", first[0].hypothesis, first[0].mechanism)
    archive.record_scores(cid, "v0", [])  # evaluated (and useless) under v0
    again = M.MutationProposer(seed=0).propose(archive, SearchQA(), 1, tmp_path / "ws", ctx)
    assert again[0].source != first[0].source  # same weights: not repeated
    new_weights = ProposalContext(iteration=2, weights_version="v1", incoming_id="h0")
    redo = M.MutationProposer(seed=0).propose(archive, SearchQA(), 2, tmp_path / "ws", new_weights)
    assert first[0].source in [p.source for p in redo]  # new weights: the best-diagnosed fixes are worth another try


def test_mechanisms_that_lost_in_this_run_wait_for_the_untried_relevant_ones(tmp_path):
    from whale.rollout.trajectory import Trajectory

    """Seed 1 of the comparison: long answers dominate, passages also miss the relation. After
    the long-answer fixes lost to their parent, the next five proposals are the five fixes for the
    missing relation (question-as-query among them)."""
    long = row(Q, "Kenya", [KENYA], answer="<answer>" + "word " * 9 + "</answer>")
    no_relation = row(Q, "Kenya", [("Kenya: Geography > Location", "Eastern Africa")], answer="<answer>Africa</answer>")
    archive = archive_with(tmp_path, [long] * 6 + [no_relation] * 4, version="base")
    ctx = ProposalContext(iteration=2, weights_version="base", incoming_id="h0")
    first = M.MutationProposer(seed=0).propose(archive, SearchQA(), 3, tmp_path / "ws", ctx)
    long_fixes = {p.mechanism for p in first}
    assert all("long_answer" in by_label()[name].fixes for name in long_fixes)
    same = archive.traces("h0", "base")
    for p in first:  # scored under the base weights, failing as h0 does: no better than their parent, each one lost
        cid = archive.add_candidate(p.source, "h0", "mutation", p.hypothesis, p.mechanism)
        archive.record_scores(cid, "base", [Trajectory.from_json({**t, "harness_id": cid}) for t in same])
    assert M.mechanism_record(archive) == {name: (1, 0) for name in long_fixes}
    ctx = ProposalContext(iteration=3, weights_version="base", incoming_id="h0")
    nxt = M.MutationProposer(seed=0).propose(archive, SearchQA(), 5, tmp_path / "ws", ctx)
    assert {p.mechanism for p in nxt} == RELATION_FIXES, [p.mechanism for p in nxt]
    # under weights trained since, the layout rule comes first: the three layout-preserving relation
    # fixes, then the layout-preserving fix that lost (under other weights), then layout changes
    archive.record_scores("h0", "v1", [Trajectory.from_json(t) for t in same])
    ctx = ProposalContext(iteration=3, weights_version="v1", incoming_id="h0")
    got = [p.mechanism for p in M.MutationProposer(seed=0).propose(archive, SearchQA(), 5, tmp_path / "ws", ctx)]
    assert set(got[:2]) == RELATION_KEEPS_LAYOUT and got[2] == "hint: answer_first_line", got
    keeps = {label for label, m in by_label().items() if m.keeps_layout}
    assert set(got[3:]) <= RELATION_FIXES - keeps, got


def test_under_trained_weights_layout_preserving_fixes_go_first(tmp_path):
    """Passages that miss the relation: five mechanisms address it; three change the layout of the
    model's context (more or longer passages, more search turns), two only change which passage
    is retrieved (the query). Under
    the base weights the draw among them is seeded; under weights trained in the run the three
    layout-preserving ones come first for every seed (trained weights co-adapt with the layout)."""
    no_relation = row(Q, "Kenya", [("Kenya: Geography > Location", "Eastern Africa")], answer="<answer>Africa</answer>")
    base_first, trained_first = set(), set()
    for seed in range(6):
        for version, seen in (("base", base_first), ("w7", trained_first)):
            archive = archive_with(tmp_path / f"{seed}-{version}", [no_relation] * 8, version=version)
            ctx = ProposalContext(iteration=2, weights_version=version, incoming_id="h0")
            got = M.MutationProposer(seed=seed).propose(archive, SearchQA(), 2, tmp_path / "ws", ctx)
            seen.update(p.mechanism for p in got)
    keeps = {label for label, m in by_label().items() if m.keeps_layout}
    assert trained_first <= RELATION_KEEPS_LAYOUT <= keeps and len(trained_first) >= 2
    assert base_first - keeps, base_first  # without the rule a layout change is drawn first


def test_at_equal_relevance_code_mechanisms_go_before_prompt_rewrites(tmp_path):
    """Chess, a parent that already draws its move from the legal moves and answers wrongly every
    time: four mechanisms address wrong answers equally (a vote, annotated moves, a tactics
    reminder, a system prompt). For every seed the two slots go to the code mechanisms, not to
    the prompt text (never accepted in our runs; see MutationProposer.propose)."""
    cfg = Config()
    cfg.domain.name = "chess"
    chess = ChessDomain(cfg)
    by_name = {m.name: m for m in M.mutations_for(chess, cfg)}
    choosing = M.apply_mutation(by_name["constrained_choice"], chess.base_harness(), "h0", random.Random(0))
    wrong = [{"problem_id": f"p{i}", "sample": 0, "harness_id": "h0", "question": "Chess puzzle. Position (FEN): ...",
              "answer": "e2e4", "reward": 0.0, "calls": [{"messages": [], "completion": "e2e4", "finish_reason": "stop"}],
              "tool_calls": [{"name": "move", "args": ["e2e4"], "kwargs": {}, "result": {"ok": True}, "error": None}]}
             for i in range(8)]
    picked = set()
    for seed in range(6):
        archive = Archive(tmp_path / str(seed))
        archive.add_candidate(choosing, None, "base")
        archive.record_scores("h0", "base", [Trajectory.from_json(r) for r in wrong])
        ctx = ProposalContext(iteration=2, weights_version="base", incoming_id="h0")
        got = M.MutationProposer(seed=seed, cfg=cfg).propose(archive, chess, 2, tmp_path / "ws", ctx)
        picked.update(p.mechanism for p in got)
    assert picked == {"majority_vote", "hint: annotate_moves"}, picked


def test_the_mutation_proposer_says_when_it_has_nothing_left_to_write(tmp_path):
    """Prompt-only on chess has two prompt mechanisms: proposing round after round, each proposal
    archived and scored like its parent, the rounds with something new are not `exhausted`, and
    the first empty round is (so the search ends its phase instead of stopping the run)."""
    cfg = Config()
    cfg.domain.name = "chess"
    chess = ChessDomain(cfg)
    wrong = [{"problem_id": f"p{i}", "sample": 0, "harness_id": "h0", "question": "Chess puzzle. Position (FEN): ...",
              "answer": "e2e4", "reward": 0.0, "calls": [{"messages": [], "completion": "e2e4", "finish_reason": "stop"}],
              "tool_calls": [{"name": "move", "args": ["e2e4"], "kwargs": {}, "result": {"ok": True}, "error": None}]}
             for i in range(8)]
    archive = Archive(tmp_path / "run")
    archive.add_candidate(chess.base_harness(), None, "base")
    archive.record_scores("h0", "base", [Trajectory.from_json(r) for r in wrong])
    proposer = M.MutationProposer(seed=0, cfg=cfg)
    rounds = []
    for it in range(2, 30):
        ctx = ProposalContext(iteration=it, weights_version="base", incoming_id="h0", prompt_only=True,
                              base_source=chess.base_harness())
        got = proposer.propose(archive, chess, 3, tmp_path / "ws", ctx)
        rounds.append((len(got), proposer.exhausted))
        if not got:
            break
        for p in got:
            cid = archive.add_candidate(p.source, p.parent, "mutation", p.hypothesis, p.mechanism)
            archive.record_scores(cid, "base", [Trajectory.from_json({**r, "harness_id": cid}) for r in wrong])
    assert rounds[-1] == (0, True), rounds
    assert rounds[0][0] > 0 and not any(done for n, done in rounds[:-1]), rounds
