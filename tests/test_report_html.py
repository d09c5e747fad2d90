"""report.html and compare.html: one self-contained page per run (and per comparison), and the
figures' fixes: phases shaded where their rollouts went, lineage ticks that are candidates.

The browser test opens the page of a short run in headless Chromium (Debian's `chromium`,
driven by Playwright); it is marked `browser` and skipped where either is missing."""

import os
import re
import shutil
from pathlib import Path

import pytest
from test_run import TESTS, tiny_config

from whale.compare import compare_runs
from whale.plots import close, lineage_figure, phase_spans, to_svg
from whale.report import write_report
from whale.report_html import episode_view, sample_episodes
from whale.run import run_experiment

SECTIONS = ["summary", "curves", "phases", "lineage", "evaluations", "weights", "ledger"]


@pytest.fixture(scope="module")
def short_run(tiny_model_dir, tmp_path_factory):
    """A whale run on the toy parity task (W, H, W; about 20 s on 2 cores) and its report."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(TESTS))
        mp.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        run_dir = run_experiment(tiny_config(tiny_model_dir), out=tmp_path_factory.mktemp("html") / "whale")
    write_report(run_dir)
    return Path(run_dir)


def ledger_batch(key, purpose, rollouts, tokens=0):
    return {"key": key, "purpose": purpose, "of": purpose, "rollouts": rollouts, "llm_calls": rollouts,
            "prompt_tokens": tokens, "completion_tokens": 0}


def test_a_harness_phase_is_shaded_over_every_rollout_it_spent():
    """The demo's harness phase spent 288 budget rollouts (re-scoring, candidates, confirmation
    re-runs); the plot shaded only up to its last iteration row. Spans come from the ledger now."""
    ledger = [ledger_batch("w0", "weight", 32, 100), ledger_batch("eval-w1-val", "eval", 64, 50),
              ledger_batch("c0:rescore:h0@w0#0", "rescore", 32, 10),
              ledger_batch("c0:smoke:h1@w0#0", "smoke", 4, 5),  # recorded only: tokens, not budget
              ledger_batch("c0:harness:h1@w0#0", "harness", 32, 10), ledger_batch("c0:harness:h2@w0#0", "harness", 32, 10),
              {"key": "c0-h2:proposer", "proposer_seconds": 3.0, "proposer_tokens": 900},
              ledger_batch("c0:confirm:h2@w0#0", "confirm", 96, 10), ledger_batch("c0:confirm:h2@w0#1", "confirm", 96, 10),
              ledger_batch("c0:null_probe:h2@w0#0", "null_probe", 16, 5),
              ledger_batch("eval-c0-h-val", "eval", 64, 50),
              ledger_batch("c1:rescore:h2@w0#0", "rescore", 32, 10),  # a second harness phase right after
              {**ledger_batch("w1", "redone", 32, 100), "of": "weight"},  # redone after a kill: its phase still
              ledger_batch("w1", "weight", 32, 100)]
    assert phase_spans(ledger, [], "rollouts") == [("weight", "W1", 0, 32), ("harness", "H1", 32, 320),
                                                   ("harness", "H2", 320, 352), ("weight", "W2", 352, 384)]
    tokens = phase_spans(ledger, [], "tokens")
    assert [s[1] for s in tokens] == ["W1", "H1", "H2", "W2"]
    assert tokens[1][2:] == (150, 210) and tokens[3][2:] == (270, 470)  # eval tokens fall outside the phases


def test_runs_without_a_ledger_file_fall_back_on_the_rows_phase():
    rows = [{"event": "eval", "phase": "weight", "ledger": {"budget_rollouts": 0}},
            {"event": "weight_step", "phase": "weight", "ledger": {"budget_rollouts": 16}},
            {"event": "rescore", "phase": "harness", "ledger": {"budget_rollouts": 24}},
            {"event": "confirm", "phase": "harness", "ledger": {"budget_rollouts": 56}},
            {"event": "harness_accepted", "phase": "harness", "ledger": {"budget_rollouts": 56}},
            {"event": "eval", "phase": "harness", "ledger": {"budget_rollouts": 56}},
            {"event": "weight_step", "phase": "weight", "ledger": {"budget_rollouts": 72}}]
    assert phase_spans([], rows, "rollouts") == [("weight", "W1", 0, 16), ("harness", "H1", 16, 56),
                                                 ("weight", "W2", 56, 72)]


def test_lineage_ticks_are_candidates_and_points_name_their_mechanism():
    summary = [{"id": "h0", "weights_version": "w3", "parent": None, "success_rate": 0.25, "mechanism": ""},
               {"id": "h1", "weights_version": "w3", "parent": "h0", "success_rate": 0.5, "mechanism": "majority_vote"},
               {"id": "h2", "weights_version": "w3", "parent": "h1", "success_rate": 0.75,
                "mechanism": "", "hypothesis": "retry when the answer is empty\nbecause ..."}]
    fig = lineage_figure(summary, accepted=["h2"])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["h0", "h1", "h2"]
    assert list(ax.get_xticks()) == [0, 1, 2]  # one tick per candidate, never 0.25, 0.5, ...
    svg = to_svg(fig)
    close(fig)
    assert "h1: majority_vote" in svg and "h2 ✓: retry when the answer is empty" in svg


def test_traces_show_failed_and_solved_episodes_of_different_problems_in_call_order():
    rows = [{"problem_id": p, "reward": r, "sample": i, "calls": [], "tool_calls": []}
            for i, (p, r) in enumerate([("a", 0), ("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1), ("b", 1)])]
    assert [(e["problem_id"], e["sample"], e["solved"]) for e in sample_episodes(rows)] == \
        [("a", 0, False), ("b", 2, False), ("a", 3, True), ("b", 5, True)]
    calls = [{"completion": "search it"}, {"completion": "Paris"}]
    tools = [{"name": "submit", "after_calls": 2}, {"name": "search", "after_calls": 1}, {"name": "log", "after_calls": None}]
    steps = episode_view({"calls": calls, "tool_calls": tools, "reward": 1.0})["steps"]
    assert [s.get("name") or s["completion"] for s in steps] == ["search it", "search", "Paris", "submit", "log"]


def test_the_page_holds_every_section_and_needs_nothing_from_outside(short_run):
    page = (short_run / "report" / "report.html").read_text()
    for section in SECTIONS:
        assert f'<section id="{section}">' in page, section
    assert "<script" not in page and "<link" not in page  # no code, no stylesheet to fetch
    assert not re.search(r'(src|href)="(?!#|data:)', page)  # only in-page anchors and data: URIs
    assert page.count("<svg") >= 4 and "<img" not in page  # figures inline
    assert len(page) < 1_000_000
    md = (short_run / "report" / "report.md").read_text()  # report.md is still written, with its PNGs
    for image in re.findall(r"\]\(([^)]+\.png)\)", md):
        assert (short_run / "report" / image).is_file(), image


def test_the_lineage_shows_each_candidate_its_verdict_diff_and_traces(short_run):
    page = (short_run / "report" / "report.html").read_text()
    candidates = sorted(p.name for p in (short_run / "harnesses").glob("h*"))
    assert len(candidates) >= 2
    for cid in candidates:
        assert f'id="cand-{cid}"' in page
    assert "incoming harness" in page or "kept in H1" in page  # h0's verdict
    assert "--- h0/harness.py" in page and "+++ h1/harness.py" in page  # h1's diff against its parent
    assert "<b>mechanism</b>" in page
    assert "traces under " in page and "model call 1" in page and "<b>grade</b>" in page


def test_compare_page_draws_the_runs_with_intervals(short_run, tmp_path):
    compare_runs([short_run], tmp_path / "cmp")
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert page.count("<svg") == 2 and "<table>" in page and "<script" not in page
    assert 'href="../' in page or "report/report.html" in page  # each run's own page, by a relative link
    assert (tmp_path / "cmp" / "compare.md").is_file() and (tmp_path / "cmp" / "compare_rollouts.png").is_file()


def chromium_path() -> str | None:
    return os.environ.get("WHALE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
def test_the_page_in_a_real_browser(request, tmp_path):
    """Headless Chromium opens the page from disk, finds each section, opens a candidate's diff and
    an evaluation's trace, and takes a screenshot; no request leaves the page's own file.

    The page is the short run's, or any run's with WHALE_REPORT_PAGE (the demo's:
    `whale demo && WHALE_REPORT_PAGE=runs/demo/report/report.html pytest -m browser`)."""
    if chromium_path() is None:
        pytest.skip("no chromium binary (apt-get install chromium, or set WHALE_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    shots = Path(os.environ.get("WHALE_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    given = os.environ.get("WHALE_REPORT_PAGE")
    page_path = Path(given).resolve() if given else request.getfixturevalue("short_run") / "report" / "report.html"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        requests = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(page_path.as_uri())
        for section in SECTIONS:
            assert page.locator(f"section#{section} h2").first.is_visible(), section
        assert page.locator("section#curves svg").count() == 2
        diff = page.locator("details.diff-box").first
        assert not diff.locator("pre").is_visible()
        diff.locator("summary").click()
        text = diff.locator("pre").inner_text()
        assert diff.locator("pre").is_visible() and re.search(r"^\+\+\+ h\d+/harness.py$", text, re.M), text[:200]
        trace = page.locator("details.eval-traces").first
        trace.locator("> summary").click()
        episode = trace.locator("details.episode").first
        episode.locator("> summary").click()
        assert episode.get_by_text("model call 1").is_visible() and episode.get_by_text("grade").first.is_visible()
        page.screenshot(path=str(shots / "report_full.png"), full_page=True)
        browser.close()
    assert all(u.startswith(("file:", "data:")) for u in requests), requests
    assert (shots / "report_full.png").stat().st_size > 20_000
