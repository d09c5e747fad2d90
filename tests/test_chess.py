"""Chess domain: Lichess semantics, the move environment, full-line grading, splits, loaders, h0."""

import gzip
import pickle
import random
import re
import shutil
from pathlib import Path

import chess
import pytest

from whale.config import Config
from whale.domains.base import SPLITS
from whale.domains.chess import ChessDomain
from whale.domains.chess import data as chess_data
from whale.domains.chess.env import ChessEnv
from whale.domains.chess.grading import grade_chess
from whale.engine.base import QueuedSubmit
from whale.harness.mutation import apply_mutation, mutations_for
from whale.harness.validate import static_check

FIXTURES = Path(__file__).parent / "fixtures" / "chess"
# Real Lichess puzzles (CC0) used by name below.
MATE1 = chess_data.make_problem("000rZ", "2kr1b1r/p1p2pp1/2pqb3/7p/3N2n1/2NPB3/PPP2PPP/R2Q1RK1 w - - 2 13",
                                ["d4e6", "d6h2"], 662, ["kingsideAttack", "mateIn1"])
MATE2 = chess_data.make_problem("000Zo", "4r3/1k6/pp3r2/1b2P2p/3R1p2/P1R2P2/1P4PP/6K1 w - - 0 35",
                                ["e5f6", "e8e1", "g1f2", "e1f1"], 1363, ["mateIn2"])


def make_cfg(**options):
    cfg = Config()
    cfg.domain.name = "chess"
    cfg.domain.options = options
    return cfg


def small_cfg(weight=40, harness=8, val=8, test=8, **options):
    cfg = make_cfg(**options)
    cfg.domain.splits.weight, cfg.domain.splits.harness = weight, harness
    cfg.domain.splits.val, cfg.domain.splits.test = val, test
    return cfg


def test_first_move_is_applied_and_solution_hidden():
    env = ChessEnv(MATE2)
    board = chess.Board(MATE2.meta["fen"])
    board.push_uci("e5f6")
    state = env.public_state()
    assert state["fen"] == board.fen()
    assert board.fen() in state["question"] and "Black to move" in state["question"]
    assert state["legal_moves"] == sorted(m.uci() for m in board.legal_moves)
    assert state["done"] is False
    # the solution line never shows up in what the harness can read
    assert set(state) == {"question", "fen", "legal_moves", "done"}
    assert "e8e1" not in state["question"] and "g1f2" not in repr(state) and "e1f1" not in repr(state)


def test_full_line_play_solves_and_grades():
    env = ChessEnv(MATE2)
    r1 = env.move("e8e1")
    assert r1["error"] is None and r1["done"] is False and r1["opponent_move"] == "g1f2"
    assert env.public_state()["fen"] == r1["fen"]
    r2 = env.move("e1f1")
    assert r2["done"] is True and r2["solved"] is True and r2["opponent_move"] is None
    assert env.final_answer() == "e8e1 e1f1"
    assert grade_chess(MATE2, env.final_answer()) == 1.0
    assert grade_chess(MATE2, "e8e1") == 0.0  # half the line is not a solve
    assert grade_chess(MATE2, None) == 0.0
    assert grade_chess(MATE2, "") == 0.0


def _puzzle_with_alternative_mate():
    for rec in chess_data.iter_vendored():
        if "mateIn1" not in rec["themes"]:
            continue
        board = chess.Board(rec["fen"])
        board.push_uci(rec["moves"][0])
        for move in board.legal_moves:
            if move.uci() != rec["moves"][1]:
                board.push(move)
                mate = board.is_checkmate()
                board.pop()
                if mate:
                    return rec, move.uci()
    raise AssertionError("no mate-in-1 puzzle with a second mating move in the vendored set")


def test_alternative_checkmate_is_accepted():
    rec, alt = _puzzle_with_alternative_mate()
    problem = chess_data.make_problem(rec["id"], rec["fen"], rec["moves"], rec["rating"], rec["themes"])
    env = ChessEnv(problem)
    result = env.move(alt)
    assert result["done"] and result["solved"]
    assert grade_chess(problem, alt) == 1.0


def test_wrong_legal_move_ends_episode_with_zero():
    env = ChessEnv(MATE1)
    wrong = next(m for m in env.public_state()["legal_moves"] if m != "d6h2")
    result = env.move(wrong)
    assert result["done"] is True and result["solved"] is False and result["error"] is None
    assert env.done and env.public_state()["legal_moves"] == []
    assert grade_chess(MATE1, env.final_answer()) == 0.0
    again = env.move("d6h2")  # no second chance
    assert again["error"] and env.final_answer() == wrong


def test_illegal_moves_are_refused_until_budget_runs_out():
    env = ChessEnv(MATE1, invalid_moves=2)
    fen = env.public_state()["fen"]
    for bad in ("e2e5", "hello"):
        result = env.move(bad)
        assert result["error"] and not result["done"] and result["fen"] == fen
    assert env.move(42)["error"]  # a non-string is refused too, and this third refusal ends it
    assert env.done
    assert env.final_answer() == ""
    assert grade_chess(MATE1, env.final_answer()) == 0.0


def test_san_is_accepted_and_recorded_as_uci():
    env = ChessEnv(MATE1)
    result = env.move("Qh2#")
    assert result["solved"] and env.final_answer() == "d6h2"
    env2 = ChessEnv(MATE2)
    assert env2.move("Re1+")["opponent_move"] == "g1f2"
    assert env2.move("Rf1#")["solved"]


def test_grader_is_picklable_and_replays_answers():
    domain = ChessDomain(make_cfg())
    grader = pickle.loads(pickle.dumps(domain.grader()))
    assert grader(MATE1, "d6h2") == 1.0
    assert grader(MATE1, "zzzz") == 0.0
    assert grader(MATE1, "Qh2#") == 1.0
    assert domain.grade(MATE2, "e8e1 e1f1 extra moves ignored") == 1.0


def test_default_splits_are_mate_in_one_disjoint_and_deterministic():
    cfg = make_cfg()
    splits = ChessDomain(cfg).load_splits()
    assert {k: len(v) for k, v in splits.items()} == {"weight": 512, "harness": 64, "val": 64, "test": 64}
    assert all(p.source == "mateIn1" for v in splits.values() for p in v)
    fens = [p.meta["fen"] for v in splits.values() for p in v]
    assert len(set(fens)) == len(fens)
    again = ChessDomain(make_cfg()).load_splits()
    assert [p.id for p in again["test"]] == [p.id for p in splits["test"]]
    cfg.seed = 1
    other = ChessDomain(cfg).load_splits()
    assert [p.id for p in other["test"]] != [p.id for p in splits["test"]]


def test_test_split_is_stable_when_weight_grows():
    small = ChessDomain(small_cfg(weight=40, slice="all")).load_splits()
    big = ChessDomain(small_cfg(weight=400, slice="all")).load_splits()
    assert [p.id for p in small["test"]] == [p.id for p in big["test"]]


def _positions_faced(p):
    """The test's own replay: every position the solver moves in (board, side, castling, en passant)."""
    board, out = chess.Board(p.meta["fen"]), []
    for i, uci in enumerate(p.answer):
        board.push_uci(uci)
        if i % 2 == 0:
            out.append(" ".join(board.fen().split()[:4]))
    return out


def test_some_vendored_puzzles_share_a_solver_position():
    seen, shared = {}, 0
    for r in chess_data.iter_vendored():
        p = chess_data.make_problem(r["id"], r["fen"], r["moves"], r["rating"], r["themes"])
        for pos in _positions_faced(p):
            shared += pos in seen and seen[pos] != p.id
            seen.setdefault(pos, p.id)
    assert shared >= 3  # so the next test has links to keep together


@pytest.mark.parametrize("seed, weight, harness, val, test", [
    (0, 2000, 200, 200, 300), (1, 2200, 100, 300, 300), (2, 1500, 500, 400, 500), (3, 40, 8, 8, 8),
])
def test_no_solver_position_crosses_splits(seed, weight, harness, val, test):
    cfg = small_cfg(weight=weight, harness=harness, val=val, test=test, slice="all")
    cfg.seed = seed
    splits = ChessDomain(cfg).load_splits()
    assert {k: len(v) for k, v in splits.items()} == {"weight": weight, "harness": harness, "val": val, "test": test}
    owner = {}
    for name, problems in splits.items():
        for p in problems:
            for pos in _positions_faced(p):
                assert owner.setdefault(pos, name) == name, f"{p.id}: position {pos} in {owner[pos]} and {name}"


@pytest.mark.parametrize("settings, options, message", [
    ({"data_path": "puzzles.csv"}, {}, "domain.data_path is read only with domain.source: lichess"),
    ({}, {"hf_split": "train"}, "domain.options.hf_split is read only with domain.source: lichess"),
    ({}, {"slice": "all", "easy_rating": 1000}, "domain.options.easy_rating is read only with domain.options.slice"),
    ({"corpus_path": "c.jsonl"}, {}, "chess: domain.corpus_path is not read"),
    ({"judge_model": "m"}, {}, "chess: domain.judge_model is not read"),
    ({"grader": "em"}, {}, "chess: domain.grader must be one of"),
])
def test_chess_settings_the_mode_ignores_are_errors(settings, options, message):
    cfg = make_cfg(**options)
    for key, value in settings.items():
        setattr(cfg.domain, key, value)
    with pytest.raises(ValueError, match=message):
        ChessDomain(cfg)


def test_easy_slice_spills_into_mate_in_two_and_filters_apply():
    splits = ChessDomain(small_cfg(weight=900)).load_splits()
    sources = {p.source for v in splits.values() for p in v}
    assert sources == {"mateIn1", "mateIn2"}
    capped = ChessDomain(small_cfg(slice="all", max_rating=900)).load_splits()
    assert all(p.meta["rating"] <= 900 for v in capped.values() for p in v)
    with pytest.raises(ValueError, match="only .* distinct puzzles"):
        ChessDomain(small_cfg(weight=2000, slice="mateIn1")).load_splits()
    with pytest.raises(ValueError, match="slice"):
        ChessDomain(make_cfg(slice="hard"))
    with pytest.raises(ValueError, match="unknown domain.options"):
        ChessDomain(make_cfg(max_ratin=900))
    themed = ChessDomain(small_cfg(slice="all", themes="fork")).load_splits()
    assert all("fork" in p.meta["themes"] for v in themed.values() for p in v)


def test_vendored_puzzles_all_replay_legally():
    records = list(chess_data.iter_vendored())
    assert len(records) == 2953
    assert len({r["id"] for r in records}) == len(records)
    for rec in records:
        board = chess.Board(rec["fen"])
        for uci in rec["moves"]:
            move = chess.Move.from_uci(uci)
            assert move in board.legal_moves, (rec["id"], uci)
            board.push(move)
        if "mateIn1" in rec["themes"] or "mateIn2" in rec["themes"]:
            assert board.is_checkmate(), rec["id"]
        assert 1 <= len(rec["moves"]) - 1 <= 9


def test_vendored_data_carries_its_licence_note():
    header = chess_data.PUZZLE_FILE.read_text().splitlines()[0]
    assert "CC0" in header and "database.lichess.org" in header


def _lichess_cfg(path, **options):
    cfg = small_cfg(weight=4, harness=1, val=1, test=2, **options)
    cfg.domain.source = "lichess"
    cfg.domain.data_path = str(path)
    return cfg


def test_lichess_csv_loader_on_fixture(tmp_path):
    csv_path = FIXTURES / "lichess_puzzles.csv"
    domain = ChessDomain(_lichess_cfg(csv_path))
    splits = domain.load_splits()
    problems = [p for s in SPLITS for p in splits[s]]
    assert len(problems) == 8
    ids = {p.id for p in problems}
    assert not ({"lichess-000rZ", "lichess-DUP01"} <= ids)  # same position: at most one of them
    assert "lichess-005f3" not in ids  # 11 solution plies: beyond max_plies 9
    # every loaded line replays: playing it in the env solves it
    for p in problems:
        env = domain.make_env(p)
        for uci in p.answer[1::2]:
            env.move(uci)
        assert env.done and env.solved and domain.grade(p, env.final_answer()) == 1.0
    # .csv.gz gives the same splits
    gz = tmp_path / "puzzles.csv.gz"
    with open(csv_path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    gz_splits = ChessDomain(_lichess_cfg(gz)).load_splits()
    assert [p.id for p in gz_splits["test"]] == [p.id for p in splits["test"]]
    # too few puzzles: a clear error
    cfg = _lichess_cfg(csv_path)
    cfg.domain.splits.weight = 50
    with pytest.raises(ValueError, match="only 9 distinct puzzles"):
        ChessDomain(cfg).load_splits()


def test_lichess_parquet_loader(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import csv

    import pyarrow.parquet as pq

    with open(FIXTURES / "lichess_puzzles.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["Rating"] = int(r["Rating"])
    path = tmp_path / "puzzles.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    splits = ChessDomain(_lichess_cfg(path)).load_splits()
    assert sum(len(v) for v in splits.values()) == 8


def test_lichess_loader_errors(tmp_path):
    cfg = _lichess_cfg(tmp_path / "missing.csv")
    cfg.domain.data_path = None
    with pytest.raises(ValueError, match="data_path"):
        ChessDomain(cfg).load_splits()
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="Lichess header"):
        ChessDomain(_lichess_cfg(bad)).load_splits()


# --- h0, run in-process against a stand-in for the sandbox's env proxy ----------------------


class EnvProxy:
    """What the sandbox gives a harness: public_state as attributes, tools as methods."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        if name in self._env.tools or name == "submit":
            return getattr(self._env, name)
        return self._env.public_state()[name]


def _h0_module():
    ns = {}
    exec(compile(ChessDomain(make_cfg()).base_harness(), "h0.py", "exec"), ns)
    return ns


def test_h0_imports_only_stdlib_and_keeps_the_legal_moves_out_of_prompts():
    source = ChessDomain(make_cfg()).base_harness()
    imports = re.findall(r"^\s*(?:import|from)\s+(\w+)", source, re.M)
    assert set(imports) <= {"re", "json", "random"}
    assert "legal_moves" not in source
    ns = _h0_module()
    assert isinstance(ns["SYSTEM_PROMPT"], str) and isinstance(ns["USER_PROMPT"], str)


def test_h0_plays_a_two_move_line_with_retries():
    ns = _h0_module()
    env = ChessEnv(MATE2)
    seen = []
    script = iter(["I think Re1", "<move>e8e1</move>", "<move>Rf1</move>", "<move>a1a1</move>", "<move>e1f1</move>"])

    def llm(messages, **kw):
        seen.append(messages[-1]["content"])
        return next(script)

    ns["run"](EnvProxy(env), llm)
    assert env.solved and env.final_answer() == "e8e1 e1f1"
    start = chess.Board(MATE2.meta["fen"])
    start.push_uci("e5f6")
    assert start.fen() in seen[0] and "Black to move" in seen[0] and "<move>" in seen[0]
    assert "could not read" in seen[1]  # format retry after the untagged reply
    assert "g1f2" in seen[2]  # the opponent's reply is reported
    assert "could not read" in seen[3]  # 'Rf1' is not UCI: format retry
    assert "not a legal move" in seen[4]  # a1a1: illegal-move retry


def test_h0_gives_up_after_second_format_failure():
    ns = _h0_module()
    env = ChessEnv(MATE1)
    calls = []

    def llm(messages, **kw):
        calls.append(1)
        return "no idea"

    ns["run"](EnvProxy(env), llm)
    assert len(calls) == 2 and env.final_answer() == ""


# --- through the real runner: sandboxed h0, proxied env, grading in a worker process ---------


class MateEngine(QueuedSubmit):
    """Answers every chess prompt with a checkmating move for the FEN it finds (tests only)."""

    returns_ids = False

    def __init__(self):
        self.weights_version = "base"

    def generate(self, requests, sampling):
        from whale.engine.base import Generation

        out = []
        for r in requests:
            text = "\n".join(m["content"] for m in r.messages)
            board = chess.Board(re.findall(r"FEN\): (\S+ [wb] \S+ \S+ \d+ \d+)", text)[-1])
            move = next((m for m in board.legal_moves if _mates(board, m)), next(iter(board.legal_moves)))
            out.append([Generation(text=f"<move>{move.uci()}</move>", finish_reason="stop")] * r.n)
        return out

    def count_tokens(self, messages):
        return sum(len(m["content"]) for m in messages)

    def load_weights(self, path, version):
        self.weights_version = version

    def close(self):
        pass


def _mates(board, move):
    board.push(move)
    try:
        return board.is_checkmate()
    finally:
        board.pop()


def test_h0_through_the_runner_solves_mate_in_one():
    from whale.rollout.runner import RolloutRunner

    cfg = small_cfg()
    domain = ChessDomain(cfg)
    problems = domain.load_splits()["test"][:4]
    runner = RolloutRunner(MateEngine(), domain, cfg)
    try:
        trajs = runner.run(domain.base_harness(), problems)
    finally:
        runner.close()
    assert [t.error for t in trajs] == [None] * 4
    assert [t.reward for t in trajs] == [1.0] * 4
    assert all(t.source == "mateIn1" and len(t.answer.split()) == 1 for t in trajs)


@pytest.mark.parametrize("order", [("constrained_choice", "annotate_moves"), ("annotate_moves", "constrained_choice"),
                                   ("constrained_choice", "legal_move_list")])
def test_move_lists_reach_the_constrained_draw_in_either_order(order):
    """The legal-move context (annotated or plain) and the constrained choice compose whichever
    is applied first: the call that draws the move among the legal moves sees the list. (Applied
    after the choice, the list used to be left out of exactly that call.)"""
    cfg = make_cfg()
    domain = ChessDomain(cfg)
    by_name = {m.name: m for m in mutations_for(domain, cfg)}
    source = domain.base_harness()
    for i, name in enumerate(order):
        source = apply_mutation(by_name[name], source, f"h{i}", random.Random(0))
        assert source is not None and static_check(source, cfg) is None
    ns = {}
    exec(compile(source, "harness.py", "exec"), ns)
    env, drawn = ChessEnv(MATE1), []

    def llm(messages, **kw):
        if kw.get("choices"):
            drawn.append(next(m["content"] for m in reversed(messages) if m["role"] == "user"))
            return "d6h2" if "d6h2" in kw["choices"] else kw["choices"][0]
        return "<move>a1a1</move>"

    ns["run"](EnvProxy(env), llm)
    assert drawn and "Legal moves: " in drawn[0], drawn
    if "annotate_moves" in order:
        assert "d6h2 (mate" in drawn[0], drawn[0]
    assert env.solved
