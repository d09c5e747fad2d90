"""The real Claude Code and Codex CLIs as proposers, offline, against tests/agent_api.py.

Marker `agent_cli`: these run the pinned CLIs that `bash scripts/install_agents.sh` puts in
.agents/ (the versions in whale/harness/agent.py's PRESETS), and are skipped with that command as
the reason when they are missing. Each round runs under bubblewrap exactly as a user's would; the
local API replays a scripted agent (read BRIEF.md and the archive, write candidates/cand_1.py)
or fails on purpose (hang, 500, 429, 401). The loop's own rules (a failure repeated round after
round stops the search, the proposer budget) are also tested here with a scripted proposer, so
they hold without the CLIs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from agent_api import USAGE_IN, USAGE_OUT, AgentAPI, agent_script
from test_search import BETTER, ScriptedProposer, events, make_cfg, runners, search_for, toy  # noqa: F401 (fixtures)
from toy import H0

from whale.config import ConfigError, load_config
from whale.report import write_report
from whale.run import run_experiment
from whale.harness.agent import PRESETS, AgentCLIProposer
from whale.harness.agent_sandbox import PACKAGE_DIR, Bind, bwrap_problem, check_binds, executable_binds
from whale.harness.brief import make_brief
from whale.harness.proposal import Proposal, ProposerStopped
from whale.store import read_metrics

ROOT = Path(__file__).resolve().parents[1]
AGENT_BIN = ROOT / ".agents" / "node_modules" / ".bin"
MODELS = {"claude_code": "claude-sonnet-4-5", "codex": "gpt-5.5"}  # gpt-5.5: Codex 0.171 knows it, offers apply_patch


def _missing_clis() -> str | None:
    for agent, preset in PRESETS.items():
        exe = AGENT_BIN / preset.executable
        pinned = preset.npm.rsplit("@", 1)[1]
        try:
            out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        if pinned not in out:
            return f"the pinned {preset.npm} is not in .agents/ (bash scripts/install_agents.sh installs it)"
    return bwrap_problem()


MISSING = _missing_clis()


@pytest.fixture
def agent_home(tmp_path, monkeypatch):
    """The CLIs on PATH, a fresh HOME (never the user's ~/.claude or ~/.codex), test keys."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("PATH", f"{AGENT_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-test")
    monkeypatch.setenv("CLAUDE_CODE_MAX_RETRIES", "0")  # an API error ends the round at once, not after 10 retries
    for name in ("ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN", "CODEX_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return home


def _agent(agent: str, api: AgentAPI, timeout_s: float = 60) -> AgentCLIProposer:
    return AgentCLIProposer(agent=agent, model=MODELS[agent], timeout_s=timeout_s,
                            base_url=api.url if agent == "claude_code" else f"{api.url}/v1",
                            env_vars=("CLAUDE_CODE_MAX_RETRIES",))


def _round(toy) -> dict:
    [path] = (toy.archive.root / "_proposals").glob("*/round.json")
    return json.loads(path.read_text())


AGENTS = pytest.mark.parametrize("agent", ["claude_code", "codex"])


# ----------------------------------------------------------------------------- with the real CLIs
@pytest.mark.agent_cli
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
@AGENTS
def test_real_agent_reads_the_archive_and_its_candidate_is_scored(agent, agent_home, toy):
    with AgentAPI(agent_script(BETTER)) as api:
        proposer = _agent(agent, api)
        result = search_for(toy, proposer).run_phase("h0", "base", iterations=2)
    assert proposer.version == PRESETS[agent].npm.rsplit("@", 1)[1]
    sent = json.dumps([body for _, _, body in api.requests])
    assert "Harness search brief" in sent and "Toy base harness" in sent  # BRIEF.md and archive/h0 reached the model
    [cand] = events(result.history, "candidate")
    assert cand["id"] == "h1" and cand["status"] == "valid" and cand["success_rate"] == 1.0
    assert toy.archive.meta("h1")["proposer"] == "agent_cli" and toy.archive.meta("h1")["mechanism"] == "prompt"
    usage = _round(toy)["usage"]
    assert usage["tokens"] == 4 * (USAGE_IN + USAGE_OUT) and usage["seconds"] > 0
    assert ("cost_usd" in usage) == (agent == "claude_code")  # Codex reports no USD
    transcript = next((toy.archive.root / "_proposals").glob("*/transcript.txt")).read_text()
    assert "candidates/cand_1.py" in transcript and transcript.rstrip().endswith("[whale] ok")
    assert result.accepted_id == "h1"


@pytest.mark.agent_cli
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
@pytest.mark.parametrize("agent,case,expect", [
    ("claude_code", "500", "API Error: 500"), ("codex", "500", "high demand"),
    ("claude_code", "429", "429"), ("codex", "429", "429 Too Many Requests"),
    ("claude_code", "401", "401"), ("codex", "401", "401"),
    ("claude_code", "hang", "timed out after 4 s"), ("codex", "hang", "timed out after 4 s"),
    ("claude_code", "nothing", "wrote no candidates"), ("codex", "nothing", "wrote no candidates")])
def test_a_failing_round_is_empty_with_its_reason_on_record_and_the_run_goes_on(agent, case, expect, agent_home, toy):
    script = [("text", "I have nothing to add.")] if case == "nothing" else agent_script(BETTER)
    with AgentAPI(script, mode="ok" if case == "nothing" else case) as api:
        result = search_for(toy, _agent(agent, api, timeout_s=4)).run_phase("h0", "base", iterations=2)
    [failure] = events(result.history, "proposer_failure")
    assert expect in failure["reason"] and result.accepted_id == "h0" and result.iterations == 2
    assert _round(toy)["error"] == failure["reason"]


@pytest.mark.agent_cli
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
@AGENTS
def test_a_garbage_candidate_is_refused_with_the_reason(agent, agent_home, toy):
    with AgentAPI(agent_script("this is not ( python\n")) as api:
        result = search_for(toy, _agent(agent, api)).run_phase("h0", "base", iterations=2)
    [invalid] = events(result.history, "invalid")
    assert "syntax" in invalid["reason"].lower() and result.accepted_id == "h0"


@pytest.mark.agent_cli
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_a_real_agent_failing_alike_every_round_stops_the_search(agent_home, toy):
    with AgentAPI(agent_script(BETTER), mode="500") as api:
        search = search_for(toy, _agent("codex", api))
        with pytest.raises(ProposerStopped, match="failed 3 rounds in a row with: agent exited with code 1: .*high demand"):
            search.run_phase("h0", "base", iterations=10)
    assert len(events(search._history, "proposer_failure")) == 3


@pytest.mark.agent_cli
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_codex_without_its_native_package_is_refused_before_the_run(agent_home, tmp_path, monkeypatch):
    """The launcher alone (what binding only the @openai/codex folder gave the jail)."""
    modules = tmp_path / "node_modules"
    shutil.copytree(ROOT / ".agents" / "node_modules" / "@openai" / "codex", modules / "@openai" / "codex")
    (modules / ".bin").mkdir()
    (modules / ".bin" / "codex").symlink_to("../@openai/codex/bin/codex.js")
    monkeypatch.setenv("PATH", f"{modules / '.bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match="'codex' could not start .* in the sandbox.*Missing optional dependency"):
        AgentCLIProposer(agent="codex")


@pytest.mark.agent_cli
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_a_run_with_claude_code_counts_its_tokens_and_dollars(agent_home, tiny_model_dir, tmp_path, monkeypatch):
    """`whale run` end to end (tiny model, harness_only): the round's cost in ledger and report."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    candidate = '"""Hypothesis: a shorter prompt.\nMechanism: prompt\nParent: h0"""\n' + H0.replace("You add", "Add")
    with AgentAPI(agent_script(candidate)) as api:
        cfg = load_config(None, [
            f"model.name={tiny_model_dir}", "model.dtype=float32", "model.max_model_len=480",
            "domain.module=toy:ParityDomain", "domain.splits.weight=4", "domain.splits.harness=4",
            "domain.splits.val=4", "domain.splits.test=4", "sampling.max_tokens=8", "eval.k=1", "weight.problems_per_step=4",
            "harness.candidates_per_iteration=1", "harness.null_probe_items=4", "harness.confirm_top=0",
            "schedule.kind=harness_only", "schedule.harness_iterations=2", "runner.concurrency=8",
            "runner.grader_processes=1", "harness.proposer=agent_cli", "harness.agent=claude_code",
            f"harness.agent_base_url={api.url}", "harness.agent_model=claude-sonnet-4-5",
            "harness.agent_env=[CLAUDE_CODE_MAX_RETRIES]", "harness.proposer_budget_usd=1.0"])
        run_dir = run_experiment(cfg, out=tmp_path / "run")
    rounds = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()
              if "proposer_tokens" in line]
    assert len(rounds) == 1 and rounds[0]["proposer_tokens"] == 4 * (USAGE_IN + USAGE_OUT)
    assert rounds[0]["proposer_cost_usd"] > 0 and rounds[0]["key"].endswith(":proposer")
    assert [r for r in read_metrics(run_dir) if r.get("event") == "candidate"][0]["id"] == "h1"
    report = write_report(run_dir).read_text()
    assert "## What proposing cost" in report and re.search(r"\| run \| 1 \| 0 \| 4200 \| 0\.\d+ \|", report)


# ----------------------------------------------------------------------------- the loop's rules
def test_the_same_failure_round_after_round_stops_the_search(toy):
    proposer = ScriptedProposer([], error="agent exited with code 1: API Error: 401 invalid key (port 4011)")
    search = search_for(toy, proposer)
    with pytest.raises(ProposerStopped, match=r"failed 3 rounds in a row with: .*401 invalid key .*--resume"):
        search.run_phase("h0", "base", iterations=10)
    assert proposer.calls == 3 and events(search._history, "proposer_stopped")


def test_the_same_failure_across_short_phases_stops_the_search(toy):
    """Phases of two iterations (one proposer round each) still add up: the Codex run that
    repeated one failure 19 times did so over many short phases."""
    proposer = ScriptedProposer([], error="Error: Missing optional dependency @openai/codex-linux-x64")
    for _ in range(2):  # the run starts a new search for every phase
        search_for(toy, proposer).run_phase("h0", "base", iterations=2)
    with pytest.raises(ProposerStopped, match="failed 3 rounds in a row with: .*Missing optional dependency"):
        search_for(toy, proposer).run_phase("h0", "base", iterations=2)
    assert proposer.calls == 3


def test_different_failures_do_not_stop_the_search(toy):
    class Varied(ScriptedProposer):
        def propose(self, *a, **k):
            self.error = ["timed out", "wrote no candidates"][self.calls % 2]
            return super().propose(*a, **k)

    result = search_for(toy, Varied([])).run_phase("h0", "base", iterations=6)
    assert len(events(result.history, "proposer_failure")) == 5 and result.accepted_id == "h0"


class Paid(ScriptedProposer):
    """One (unhelpful) candidate per round, each costing $0.40 and 1000 tokens."""

    def propose(self, archive, domain, n, workspace, context):
        self.calls += 1
        self.last_error, self.last_usage = None, {"seconds": 1.0, "tokens": 1000, "cost_usd": 0.4}
        return [Proposal(BETTER.replace("digits only", f"digits only ({self.calls})"), "h", "prompt")]


@pytest.mark.parametrize("key,value", [("proposer_budget_usd", 1.0), ("proposer_budget_tokens", 3000)])
def test_a_spent_proposer_budget_keeps_the_incoming_harness(toy, key, value):
    setattr(toy.cfg.harness, key, value)
    proposer = Paid([])
    search = search_for(toy, proposer)
    result = search.run_phase("h0", "base", iterations=8)
    [stop] = events(result.history, "proposer_budget")
    assert proposer.calls == 3 and "proposer budget spent" in stop["reason"] and "keeping the incoming harness h0" in stop["reason"]
    assert search.proposer_spent()["tokens"] == 3000
    again = search_for(toy, proposer).run_phase(result.accepted_id, "v2", iterations=8)  # a later phase: no more rounds
    assert proposer.calls == 3 and events(again.history, "proposer_budget")


def test_proposer_budget_must_be_positive():
    with pytest.raises(ConfigError, match="greater than 0"):
        load_config(None, ["harness.proposer_budget_usd=0"])
    assert load_config(None, ["harness.proposer_budget_tokens=null"]).harness.proposer_budget_tokens is None


def test_the_brief_says_how_to_work_and_what_not_to_do():
    from toy import ToyDomain

    cfg = make_cfg(proposer="agent_cli")
    brief = make_brief(ToyDomain(), cfg, 2, weights_version="base", incoming_id="h0")
    order = [brief.index(h) for h in ("## The domain", "## What to read", "## How to work", "## Rules")]
    assert order == sorted(order) and "## Domain hints" not in brief  # the toy domain declares none
    for must in ("Read the failures first", "Prototype before you write: run your harness with `python3`",
                 "No parameter-only variants", "No dataset-specific hacks", "Read nothing outside your working directory",
                 "Do not run benchmarks or evaluate candidates", "`candidates/cand_1.py` ... `candidates/cand_2.py`"):
        assert must in brief, must
    chat = make_brief(ToyDomain(), make_cfg(proposer="chat"), 1, weights_version="base", incoming_id="h0")
    assert "there is no shell" in chat and "python3" not in chat


def test_an_npm_install_is_bound_as_its_whole_node_modules_tree(tmp_path):
    """Codex's launcher looks for its native package beside it, under a folder named node_modules."""
    modules = tmp_path / "lib" / "node_modules"
    launcher = modules / "@openai" / "codex" / "bin" / "codex.js"
    launcher.parent.mkdir(parents=True)
    launcher.write_text("#!/usr/bin/env node\n")
    launcher.chmod(0o755)
    (modules / "@openai" / "codex-linux-x64").mkdir()
    (modules / ".bin").mkdir()
    (modules / ".bin" / "codex").symlink_to("../@openai/codex/bin/codex.js")
    assert executable_binds("codex", str(modules / ".bin")) == [Bind(modules, "ro")]
    (tmp_path / "bin").mkdir()  # nvm / npm -g layout: <prefix>/bin/codex -> ../lib/node_modules/...
    (tmp_path / "bin" / "codex").symlink_to(launcher)
    assert executable_binds("codex", str(tmp_path / "bin")) == [Bind(tmp_path / "bin", "ro"), Bind(modules, "ro")]
    inside = Bind(PACKAGE_DIR / ".agents" / "node_modules", "ro")  # an ignored .agents/ in a checkout
    check_binds([inside], tmp_path / "run", source_tree=False)
    with pytest.raises(ValueError, match="would expose the whale source tree"):
        check_binds([inside], tmp_path / "run")
