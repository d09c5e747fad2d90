"""Proposers: the agent sandbox, hash pinning, the agent presets, the chat proposer's resilience.

The agent tests use stand-in agents: shell lines, and executables named `claude` / `codex` put on
PATH. Each hostile stand-in prints LEAK or BLOCKED per attempt, so a sandbox that lets one
through fails the test by name. The run directory goes under /var/tmp when it can, so that the
sandbox's private /tmp is not what hides it. Chat tests replay recorded exchanges
(tests/fixtures/proposer/*.json; re-record with WHALE_RECORD=1) and never reach an endpoint.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import tempfile
import time
import urllib.error
from pathlib import Path

import pytest

from whale.config import Config, ConfigError
from whale.rollout.trajectory import LLMCall, Trajectory
from whale.harness.agent import AGENT_PROMPT, AgentCLIProposer
from whale.harness.agent_sandbox import PACKAGE_DIR, bwrap_problem
from whale.harness.archive import Archive, ArchiveIntegrityError
from whale.harness.chat import ChatProposer, ChatTools, bounded_history
from whale.harness.chat_transport import ReplayTransport, RetryingTransport
from whale.harness.loop import HarnessSearch
from whale.harness.proposal import ProposalContext
from whale.harness.proposers import make_proposer
from whale.harness.workspace import build_workspace, proposer_workspace_root

FIXTURES = Path(__file__).parent / "fixtures" / "proposer"
NEEDS_BWRAP = pytest.mark.skipif(bwrap_problem() is not None, reason=f"needs bubblewrap: {bwrap_problem()}")

H0 = '''"""Base harness."""
SYSTEM_PROMPT = "You add numbers."
USER_PROMPT = "{question}"


def run(env, llm):
    env.submit(str(llm([{"role": "user", "content": USER_PROMPT.format(question=env.question)}])).strip())
'''
CANDIDATE = H0.replace('"""Base harness."""', '"""Hypothesis: ask for digits.\nMechanism: prompt\nParent: h0"""') \
    .replace("You add numbers.", "You add numbers. Reply with digits only.")


def _traj(pid: str, reward: float) -> Trajectory:
    call = LLMCall(messages=[{"role": "user", "content": f"question {pid}"}], completion="7", finish_reason="stop")
    return Trajectory(problem_id=pid, sample=0, harness_id="h0", calls=[call], reward=reward, answer="7")


@pytest.fixture
def base_dir(tmp_path):
    """A folder outside /tmp when possible (the agent sandbox hides all of /tmp anyway)."""
    if os.access("/var/tmp", os.W_OK):
        path = Path(tempfile.mkdtemp(prefix="whale-test-", dir="/var/tmp"))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path


@pytest.fixture
def run(base_dir):
    """A run directory with test gold in evals/, training rows in rows/ and an archive with h0."""
    run_dir = base_dir / "runs" / "r1"
    archive = Archive(run_dir)
    archive.add_candidate(H0, None, "base", "base harness", "none")
    archive.record_scores("h0", "base", [_traj("p0", 1.0), _traj("p1", 0.0)])
    (run_dir / "evals").mkdir()
    (run_dir / "evals" / "eval-c0-w0-test.jsonl").write_text('{"problem_id": "t0", "gold": "GOLD-ANSWER"}\n')
    (run_dir / "rows").mkdir()
    (run_dir / "rows" / "rows-000.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    yield archive
    shutil.rmtree(proposer_workspace_root(None, run_dir), ignore_errors=True)


def _context(tag="t1", brief="Write one candidate into candidates/."):
    return ProposalContext(iteration=2, weights_version="base", incoming_id="h0", brief=brief, tag=tag)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _transcript(archive: Archive, tag="t1") -> str:
    return (archive.root / "_proposals" / tag / "transcript.txt").read_text()


def hostile_agent(run_dir: Path) -> str:
    """A stand-in agent (a shell script): every way to the run it tries, then one real candidate."""
    r, pkg = shlex.quote(str(run_dir)), shlex.quote(str(PACKAGE_DIR))
    return f"""
try_read() {{ if cat "$1" >/dev/null 2>&1; then echo "LEAK read $1"; else echo "BLOCKED read $1"; fi; }}
try_list() {{ if [ -n "$(ls -A "$1" 2>/dev/null)" ]; then echo "LEAK list $1"; else echo "BLOCKED list $1"; fi; }}
try_write() {{ if (echo tampered > "$1") 2>/dev/null; then echo "LEAK write $1"; else echo "BLOCKED write $1"; fi; }}
for f in ../../evals/eval-*-test.jsonl ../evals/eval-*-test.jsonl; do try_read "$f"; done
try_read {r}/evals/eval-c0-w0-test.jsonl
try_list {r}/rows
try_read {r}/rows/rows-000.jsonl
try_list {r}/harnesses
try_read {r}/harnesses/h0/harness.py
try_write {r}/harnesses/evil.py
try_write {r}/harnesses/h0/harness.py
try_write {r}/harnesses/h0/notes.txt
try_write archive/h0/harness.py
try_write archive/evil.py
try_write BRIEF.md
if mount -o remount,bind,rw archive 2>/dev/null && (echo x > archive/h0/harness.py) 2>/dev/null; then
  echo "LEAK remount archive"; else echo "BLOCKED remount archive"; fi
try_read {pkg}/whale/__init__.py
try_list /proc/{os.getpid()}/cwd/
try_read "$HOME/.cache/secret.txt"
for d in /usr/lib/python3/dist-packages /usr/local/lib/python3*/*-packages; do try_list "$d"; done
if [ -n "$WHALE_TEST_SECRET" ]; then echo "LEAK env WHALE_TEST_SECRET"; else echo "BLOCKED env"; fi
grep -q SYSTEM_PROMPT archive/h0/harness.py && echo "READ archive copy"
cat > candidates/cand_1.py <<'WHALE_EOF'
{CANDIDATE}WHALE_EOF
"""


# ----------------------------------------------------------------------------- workspace location
def test_workspace_lives_outside_the_run_directory(run, base_dir):
    search = HarnessSearch(Config(), None, None, run, proposer=None, progress=False)
    run_dir = run.run_dir.resolve()
    assert run_dir not in search.workspace_root.parents and search.workspace_root != run_dir
    with pytest.raises(ValueError, match="outside the run directory"):
        build_workspace(run, run.run_dir / "proposer" / "t1", "brief")
    with pytest.raises(ValueError, match="outside the run directory"):
        proposer_workspace_root(str(run.run_dir / "ws"), run.run_dir)
    other = proposer_workspace_root(None, base_dir / "runs" / "r2")
    assert other != search.workspace_root and other.parent == search.workspace_root.parent


# ----------------------------------------------------------------------------- hash pinning
def test_archive_refuses_a_source_changed_after_it_was_archived(run):
    path = run.root / "h0" / "harness.py"
    assert run.source("h0") == H0 and run.meta("h0")["source_sha256"]
    os.chmod(path, 0o644)
    path.write_text(H0.replace("You add numbers.", "Look for the answers on disk."))
    with pytest.raises(ArchiveIntegrityError, match="h0.*changed on disk after it was archived"):
        run.source("h0")
    with pytest.raises(ArchiveIntegrityError, match="changed on disk"):
        Archive(run.run_dir).source("h0")  # the pin is on disk too, so a reload does not forgive it
    ws = proposer_workspace_root(None, run.run_dir) / "t1"
    with pytest.raises(ArchiveIntegrityError):  # the loop records it as a proposer failure
        AgentCLIProposer("true", sandbox="none").propose(run, None, 1, ws, _context())
    assert not ws.exists()  # no half-built copy of the archive is left behind


def test_archive_keeps_crlf_sources_verifiable(run):
    cid = run.add_candidate(CANDIDATE.replace("\n", "\r\n"), "h0", "test")
    assert run.source(cid) == CANDIDATE  # read as text (universal newlines), verified as bytes


# ----------------------------------------------------------------------------- the agent sandbox
@NEEDS_BWRAP
def test_sandboxed_agent_cannot_reach_the_run_and_its_candidate_comes_back(run, base_dir, monkeypatch):
    home = base_dir / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "secret.txt").write_text("hf token")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WHALE_TEST_SECRET", "s3cret")
    before = _snapshot(run.root)
    proposer = AgentCLIProposer(hostile_agent(run.run_dir), timeout_s=60)
    props = proposer.propose(run, None, 3, proposer_workspace_root(None, run.run_dir) / "t1", _context())
    transcript = _transcript(run)
    assert re.findall(r"^LEAK.*", transcript, re.M) == []
    assert len(re.findall(r"^BLOCKED", transcript, re.M)) >= 18 and "READ archive copy" in transcript
    assert "\nBLOCKED remount archive" in transcript
    assert _snapshot(run.root) == {**before, **{k: v for k, v in _snapshot(run.root).items() if k.startswith("_proposals")}}
    assert run.source("h0") == H0 and not (run.root / "evil.py").exists()
    assert len(props) == 1 and props[0].source == CANDIDATE and props[0].parent == "h0"
    assert proposer.last_error is None
    assert not (proposer_workspace_root(None, run.run_dir) / "t1").exists()  # removed after the round


def test_unsandboxed_agent_is_outside_the_run_and_tampering_is_refused(run, monkeypatch):
    """agent_sandbox: none gives what docs/sandbox.md says and no more: `..` leads nowhere, an
    absolute path still reads the run, and a rewritten archive file is refused, not run."""
    proposer = AgentCLIProposer(hostile_agent(run.run_dir), timeout_s=60, sandbox="none")
    props = proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t1", _context())
    transcript = _transcript(run)
    assert "\nBLOCKED read ../../evals/eval-*-test.jsonl" in transcript
    assert f"\nLEAK read {run.run_dir}/evals/eval-c0-w0-test.jsonl" in transcript  # not a guarantee of this mode
    assert len(props) == 1 and props[0].source == CANDIDATE
    if (run.root / "h0" / "harness.py").read_bytes() != H0.encode():
        with pytest.raises(ArchiveIntegrityError):
            run.source("h0")
    else:  # not root: the 0444 mode held
        assert run.source("h0") == H0


@NEEDS_BWRAP
def test_a_timed_out_sandbox_takes_its_background_processes_with_it(run):
    marker = f"whale-marker-{os.getpid()}-{time.time_ns()}"
    proposer = AgentCLIProposer(f"sh -c 'exec -a {marker} sleep 300' & sleep 300", timeout_s=1)
    proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t1", _context())
    assert "timed out" in proposer.last_error
    time.sleep(0.5)
    alive = [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker.encode() in _read(p)]
    assert alive == []


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_bind_paths_are_checked_when_the_proposer_is_built(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        AgentCLIProposer("true", sandbox="none", binds=[(str(tmp_path / "missing"), "rw")])
    with pytest.raises(ValueError, match="mode 'copy' is for files"):
        AgentCLIProposer("true", sandbox="none", binds=[(str(tmp_path), "copy")])
    with pytest.raises(ValueError, match="mode of .* must be one of ro, rw, copy"):
        AgentCLIProposer("true", sandbox="none", binds=[(str(tmp_path), "rwx")])


def test_missing_bubblewrap_is_a_clear_error_unless_the_config_opts_out(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap, no claude
    with pytest.raises(RuntimeError, match="agent_sandbox is 'bwrap' but bubblewrap .* is not installed"):
        AgentCLIProposer("true")
    assert AgentCLIProposer("true", sandbox="none").sandbox == "none"
    cfg = Config()
    cfg.harness.proposer, cfg.harness.agent_command = "agent_cli", "true"
    with pytest.raises(ConfigError, match="set harness.agent_sandbox=none"):
        make_proposer(cfg)  # what `whale run` prints as a one-line error
    with pytest.raises(RuntimeError, match="needs the `claude` CLI on PATH"):
        AgentCLIProposer(agent="claude_code", sandbox="none")


@NEEDS_BWRAP
def test_agent_binds_may_not_expose_the_run_or_the_source_tree(run):
    for path in (str(run.run_dir), str(run.run_dir.parent), str(PACKAGE_DIR / "whale")):
        proposer = AgentCLIProposer("true", binds=[(path, "ro")])
        assert proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t1", _context()) == []
        assert "would expose" in proposer.last_error


# ----------------------------------------------------------------------------- presets
STAND_IN = """#!/bin/sh
if [ "$1" = --version ]; then echo "9.9.9 (stand-in)"; exit 0; fi
echo '{usage}'
echo "ARGV $*"
echo "ENV $(env | cut -d= -f1 | sort | tr '\\n' ' ')"
echo "session" > "$HOME/{config}/session.txt" && echo "CONFIG writable"
if [ -f "$HOME/.claude.json" ]; then
  echo '{{"rewritten": 1}}' > "$HOME/.claude.json.tmp" && mv "$HOME/.claude.json.tmp" "$HOME/.claude.json" && echo "COPY renamed"
fi
if cat "$HOME/.cache/secret.txt" >/dev/null 2>&1; then echo "LEAK cache"; else echo "BLOCKED cache"; fi
if cat {gold} >/dev/null 2>&1; then echo "LEAK gold"; else echo "BLOCKED gold"; fi
cat > candidates/cand_1.py <<'WHALE_EOF'
{candidate}WHALE_EOF
"""

CLAUDE_RESULT = json.dumps({"type": "result", "subtype": "success", "total_cost_usd": 0.25, "num_turns": 3, "usage": {
    "input_tokens": 100, "cache_creation_input_tokens": 20, "cache_read_input_tokens": 30, "output_tokens": 50}})
CODEX_TURN = json.dumps({"type": "turn.completed", "usage": {"input_tokens": 150, "cached_input_tokens": 10,
                                                               "output_tokens": 50}})


@pytest.fixture
def stand_ins(base_dir, run, monkeypatch):
    """Executables named claude and codex on PATH, and a HOME with their config folders."""
    bin_dir, home = base_dir / "bin", base_dir / "home"
    bin_dir.mkdir()
    gold = shlex.quote(str(run.run_dir / "evals" / "eval-c0-w0-test.jsonl"))
    for exe, config, usage in (("claude", ".claude", CLAUDE_RESULT), ("codex", ".codex", CODEX_TURN)):
        (home / config).mkdir(parents=True)
        (bin_dir / exe).write_text(STAND_IN.format(config=config, gold=gold, candidate=CANDIDATE, usage=usage))
        os.chmod(bin_dir / exe, 0o755)
    (home / ".cache").mkdir()
    (home / ".cache" / "secret.txt").write_text("hf token")
    (home / ".claude.json").write_text('{"user": 1}')
    for name in ("ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL", "CLAUDE_CODE_OAUTH_TOKEN", "CODEX_API_KEY",
                 "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-test")
    monkeypatch.setenv("WHALE_TEST_SECRET", "s3cret")
    return home


def test_preset_command_lines(stand_ins, tmp_path):
    ws = tmp_path / "ws"
    claude = AgentCLIProposer(agent="claude_code", sandbox="none", model="claude-opus-4-6")
    assert claude.argv(ws) == ["claude", "-p", AGENT_PROMPT, "--output-format", "stream-json", "--verbose",
                               "--permission-mode", "acceptEdits", "--tools", "Read,Glob,Grep,Write,Edit",
                               "--model", "claude-opus-4-6"]
    assert claude.version == "9.9.9"  # the preflight ran `claude --version`
    codex = AgentCLIProposer(agent="codex", sandbox="none")
    assert codex.argv(ws) == ["codex", "exec", "--json", "--skip-git-repo-check", "--cd", str(ws),
                              "--sandbox", "workspace-write", "-c", "analytics.enabled=false",
                              "-c", "features.plugins=false", "-c", 'web_search="disabled"', AGENT_PROMPT]
    env = claude.env()
    assert env["ANTHROPIC_API_KEY"] == "sk-ant-test" and "OPENAI_API_KEY" not in env
    assert "WHALE_TEST_SECRET" not in env and "IS_SANDBOX" not in env and "CLAUDE_CODE_BUBBLEWRAP" not in env
    assert env["DISABLE_TELEMETRY"] == env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert set(codex.env()) == {"PATH", "HOME", "LANG", "OPENAI_API_KEY"}


def test_agent_base_url_is_the_right_thing_for_each_cli(stand_ins, tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "https://elsewhere.example")
    claude = AgentCLIProposer(agent="claude_code", sandbox="none", base_url="http://127.0.0.1:8080")
    assert claude.env()["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"  # the config wins over the parent
    codex = AgentCLIProposer(agent="codex", sandbox="none", base_url="http://127.0.0.1:8080/v1")
    argv = codex.argv(ws)
    assert argv[argv.index("model_provider=whale") - 1] == "-c"
    assert 'model_providers.whale={name="whale", base_url="http://127.0.0.1:8080/v1", env_key="OPENAI_API_KEY", ' \
           'wire_api="responses"}' in argv
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.setenv("CODEX_API_KEY", "k")
    with pytest.raises(RuntimeError, match="reads its key from OPENAI_API_KEY"):
        AgentCLIProposer(agent="codex", sandbox="none", base_url="http://127.0.0.1:8080/v1")
    with pytest.raises(ValueError, match="agent_base_url is for the claude_code and codex presets"):
        AgentCLIProposer("true", sandbox="none", base_url="http://127.0.0.1:8080")


def test_an_agent_that_cannot_start_or_log_in_is_refused_when_built(stand_ins, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    with pytest.raises(RuntimeError, match="'claude_code' has no login: set ANTHROPIC_API_KEY or"):
        AgentCLIProposer(agent="claude_code", sandbox="none")
    (stand_ins / ".claude" / ".credentials.json").write_text("{}")  # a `claude` login counts
    assert AgentCLIProposer(agent="claude_code", sandbox="none").version == "9.9.9"
    broken = Path(shutil.which("codex"))
    broken.write_text("#!/bin/sh\necho 'Error: Missing optional dependency @openai/codex-linux-x64' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="'codex' could not start .*exited with 1.*Missing optional dependency"):
        AgentCLIProposer(agent="codex", sandbox="none")


@NEEDS_BWRAP
def test_sandboxed_preset_command_lines(stand_ins, run, tmp_path):
    ws = tmp_path / "ws"
    claude = AgentCLIProposer(agent="claude_code")
    assert claude.argv(ws)[-4:] == ["--permission-mode", "bypassPermissions", "--tools", "Bash,Read,Write,Edit,Glob,Grep"]
    assert ("IS_SANDBOX" in claude.env()) == (os.getuid() == 0) and claude.env()["CLAUDE_CODE_BUBBLEWRAP"] == "1"
    full = claude.full_argv(ws, run.run_dir)
    assert full[0] == "bwrap" and full[full.index("--") + 1:] == claude.argv(ws)
    assert ("--cap-drop" in full) == (os.getuid() == 0) and ("--unshare-user" in full) == (os.getuid() != 0)
    assert "--unshare-net" not in full  # agents call their API
    assert full[full.index(str(stand_ins / ".claude")) - 1] == "--bind-try"
    assert str(stand_ins / ".claude.json") not in full  # a copy needs its descriptor (open_copies)
    full = claude.full_argv(ws, run.run_dir, {stand_ins / ".claude.json": 9})
    assert full[full.index(str(stand_ins / ".claude.json")) - 3:][:3] == ["0600", "--file", "9"]
    assert str(run.run_dir) not in full and "sk-ant-test" not in " ".join(full)
    codex = AgentCLIProposer(agent="codex", binds=[(str(stand_ins / ".codex"), "ro")])
    assert "danger-full-access" in codex.argv(ws)
    full = codex.full_argv(ws, run.run_dir)
    assert full[full.index(str(stand_ins / ".codex")) - 1] == "--ro-bind"


@NEEDS_BWRAP
@pytest.mark.parametrize("agent,config", [("claude_code", ".claude"), ("codex", ".codex")])
def test_stand_in_agent_cli_runs_in_the_sandbox(stand_ins, run, agent, config):
    proposer = AgentCLIProposer(agent=agent, timeout_s=60)
    props = proposer.propose(run, None, 2, proposer_workspace_root(None, run.run_dir) / "t1", _context())
    transcript = _transcript(run)
    assert proposer.last_error is None, transcript
    assert len(props) == 1 and props[0].mechanism == "prompt"
    assert re.findall(r"^LEAK.*", transcript, re.M) == []
    assert "\nBLOCKED cache" in transcript and "\nBLOCKED gold" in transcript
    assert "CONFIG writable" in transcript and (stand_ins / config / "session.txt").read_text() == "session\n"
    assert ("\nCOPY renamed" in transcript) == (agent == "claude_code")  # its atomic rewrite works on the copy
    assert (stand_ins / ".claude.json").read_text() == '{"user": 1}'  # and leaves the host's file alone
    env_line = re.search(r"^ENV (.*)$", transcript, re.M).group(1).split()
    assert "WHALE_TEST_SECRET" not in env_line and {"PATH", "HOME"} <= set(env_line)
    assert re.search(r"^ARGV .*" + re.escape(AGENT_PROMPT.split(":")[0]), transcript, re.M)
    assert proposer.last_usage["tokens"] == 200 and proposer.last_usage["output_tokens"] == 50
    assert proposer.last_usage.get("cost_usd") == (0.25 if agent == "claude_code" else None)


def test_make_proposer_reads_the_agent_keys(stand_ins):
    cfg = Config()
    cfg.harness.proposer, cfg.harness.agent, cfg.harness.agent_sandbox = "agent_cli", "codex", "none"
    cfg.harness.agent_model = "gpt-5.4"
    cfg.harness.agent_binds = [{"path": "~/.codex", "mode": "ro"}]
    agent = make_proposer(cfg)
    assert agent.agent == "codex" and "--model" in agent.argv(Path("/ws")) and "OPENAI_API_KEY" in agent.env_vars
    assert [(b.path, b.mode) for b in agent.binds] == [(stand_ins / ".codex", "ro")]
    cfg.harness.agent_binds = None
    cfg.harness.agent_command = "codex exec hi"
    with pytest.raises(ConfigError, match="agent_command is used only with harness.agent=command"):
        make_proposer(cfg)
    cfg.harness.agent, cfg.harness.agent_command = "command", None
    with pytest.raises(ConfigError, match="needs harness.agent_command"):
        make_proposer(cfg)


# ----------------------------------------------------------------------------- chat proposer
def _call(name, arguments, i=0):
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def _reply(*calls, content=""):
    return {"choices": [{"message": {"role": "assistant", "content": content, "tool_calls": list(calls)}}],
            "usage": {"total_tokens": 40}}


class ScriptedChat:
    """The 'model' whose answers a fixture records (only with WHALE_RECORD=1)."""

    def __init__(self, responses):
        self.responses = list(responses)

    def __call__(self, request):
        return self.responses.pop(0)


def _replay(name: str, script: list) -> ReplayTransport:
    path = FIXTURES / name
    record = os.environ.get("WHALE_RECORD") == "1"
    if not record and not path.exists():
        pytest.fail(f"missing fixture {path}; record it with WHALE_RECORD=1")
    if record and path.exists():
        path.unlink()
    return ReplayTransport(path, inner=ScriptedChat(script) if record else None)


WRITE = {"source": CANDIDATE, "hypothesis": "h0 answers in sentences", "mechanism": "format instruction"}
MALFORMED_SCRIPT = [
    _reply(_call("read_file", '{"path": "h0/harness.py"'), _call("read_file", {"path": 5}, 1),
           _call("read_file", {"path": "h0/harness.py", "offset": "ten"}, 2)),
    _reply(_call("shell", {"cmd": "cat /etc/passwd"}), _call("list_files", {"path": ".", "recursive": True}, 1),
           _call("read_file", "[1, 2]", 2), {"id": "call_3", "type": "function"}),
    _reply(_call("write_candidate", {"hypothesis": "x", "mechanism": "y"}), _call("read_file", {"path": "nope.txt"}, 1)),
    _reply(_call("write_candidate", WRITE)),
    _reply(_call("finish", {}), content="Done."),
]


def test_chat_tool_errors_say_what_was_wrong(tmp_path):
    (tmp_path / "arch").mkdir()
    tools = ChatTools(tmp_path / "arch", tmp_path / "out", n=1)
    assert "not valid JSON" in tools.call("read_file", '{"path": ')
    assert "argument 'path' must be a string, got int" in tools.call("read_file", {"path": 5})
    assert "argument 'offset' must be a integer, got str" in tools.call("read_file", {"path": "a", "offset": "1"})
    assert "must be a JSON object, got list" in tools.call("grep", "[1]")
    assert "unknown argument 'mode'" in tools.call("list_files", {"mode": "r"})
    assert "missing required argument(s): source" in tools.call("write_candidate", {"hypothesis": "", "mechanism": ""})
    assert "unknown tool None" in tools.call(None, "{}") and "unknown tool 'rm'" in tools.call("rm", "{}")
    assert tools.proposals == []


def test_chat_session_survives_malformed_tool_calls(run):
    proposer = ChatProposer("scripted-model", transport=_replay("chat_malformed.json", MALFORMED_SCRIPT))
    props = proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t1", _context())
    assert proposer.last_error is None, proposer.last_error
    assert len(props) == 1 and props[0].source == CANDIDATE and props[0].mechanism == "format instruction"
    transcript = _transcript(run)
    for expected in ("not valid JSON", "must be a string, got int", "must be a integer, got str", "unknown tool 'shell'",
                     "unknown argument 'recursive'", "got list", "unknown tool None", "missing required argument",
                     "no such file or folder 'nope.txt'"):
        assert expected in transcript, expected
    assert proposer.last_usage["turns"] == 5


class Flaky:
    """Raises the given errors on the first calls, then passes requests on."""

    def __init__(self, inner, errors):
        self.inner, self.errors, self.calls = inner, list(errors), 0

    def __call__(self, request):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.inner(request)


def _http_error(code, body=b"", headers=None):
    return urllib.error.HTTPError("http://x/chat/completions", code, "err", headers or {}, io.BytesIO(body))


def test_chat_retries_transport_errors_with_exponential_backoff(run):
    waits = []
    errors = [urllib.error.URLError("connection refused"), TimeoutError("read timed out"), _http_error(503),
              _http_error(429, headers={"Retry-After": "7"}), ConnectionResetError("reset")]
    transport = Flaky(_replay("chat_malformed.json", MALFORMED_SCRIPT), errors)
    proposer = ChatProposer("scripted-model", transport=transport, retries=5, backoff_s=0.5, sleep=waits.append)
    props = proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t1", _context())
    assert proposer.last_error is None and len(props) == 1
    assert waits == [0.5, 1.0, 2.0, 7.0, 8.0]  # doubling; Retry-After when longer
    assert proposer.last_usage["retries"] == 5 and "HTTPError: HTTP Error 503" in _transcript(run)


def test_chat_gives_up_at_once_on_a_client_error_and_after_the_retries_on_a_dead_endpoint(run):
    waits = []
    bad = Flaky(None, [_http_error(400, b'{"error": "context length exceeded"}')])
    proposer = ChatProposer("m", transport=bad, retries=3, backoff_s=1.0, sleep=waits.append)
    assert proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t1", _context()) == []
    assert bad.calls == 1 and waits == [] and "context length exceeded" in proposer.last_error
    dead = Flaky(None, [urllib.error.URLError("refused")] * 4)
    proposer = ChatProposer("m", transport=dead, retries=3, backoff_s=1.0, sleep=waits.append)
    assert proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t2", _context("t2")) == []
    assert dead.calls == 4 and waits == [1.0, 2.0, 4.0] and "refused" in proposer.last_error


LONG_SCRIPT = [_reply(_call("read_file", {"path": "h0/traces.jsonl", "offset": i % 2, "limit": 1})) for i in range(12)] \
    + [_reply(_call("write_candidate", WRITE)), _reply(_call("finish", {}))]


class Recorder:
    def __init__(self, inner):
        self.inner, self.requests = inner, []

    def __call__(self, request):
        self.requests.append(request)
        return self.inner(request)


def test_chat_history_is_bounded_and_keeps_the_task(run):
    transport = Recorder(_replay("chat_long.json", LONG_SCRIPT))
    proposer = ChatProposer("scripted-model", transport=transport, max_turns=30, history_turns=3)
    props = proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t1", _context())
    assert proposer.last_error is None and len(props) == 1 and proposer.last_usage["turns"] == 14
    for request in transport.requests:
        messages = request["messages"]
        assert [m["role"] for m in messages[:2]] == ["system", "user"] and messages[0]["content"] == _context().brief
        assert len(messages) <= 2 + 1 + 3 * 2  # head, note, three turns of (assistant, tool)
    last = transport.requests[-1]["messages"]
    assert "10 earlier turn(s) left out" in last[2]["content"] and "1 of 1" in last[2]["content"]
    assert last[3]["role"] == "assistant"  # a turn is never cut between a call and its result


class SmallContext:
    """A server whose context holds the task and `fits` turns; a longer prompt gets vLLM's 400."""

    def __init__(self, inner, fits):
        self.inner, self.fits, self.calls, self.refused = inner, fits, 0, 0

    def __call__(self, request):
        self.calls += 1
        if sum(m["role"] == "assistant" for m in request["messages"]) > self.fits:
            self.refused += 1
            raise _http_error(400, b'{"error": {"message": "This model\'s maximum context length is 2048 tokens"}}')
        return self.inner(request)


def test_chat_resends_fewer_turns_when_the_server_refuses_a_long_prompt(run):
    """The history estimate (4 characters a token) can run low (JSON, digits): a 400 to a request
    holding several turns is resent with fewer, and the lower budget holds for the session."""
    server = SmallContext(ScriptedChat(LONG_SCRIPT), fits=3)
    proposer = ChatProposer("m", transport=server, max_turns=30)  # history_tokens 64k: the estimate never binds
    props = proposer.propose(run, None, 1, proposer_workspace_root(None, run.run_dir) / "t1", _context())
    assert proposer.last_error is None and len(props) == 1 and proposer.last_usage["turns"] == 14
    assert 1 <= server.refused <= 2 and server.calls == 14 + server.refused
    assert "maximum context length" in _transcript(run) and "resending fewer turns" in _transcript(run)


def test_history_token_cap_drops_old_turns_but_never_the_last():
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    turns = [[{"role": "assistant", "content": "", "tool_calls": [_call("read_file", {"path": "a"})]},
              {"role": "tool", "tool_call_id": "call_0", "content": "x" * 4000}] for _ in range(5)]
    messages = head + [m for t in turns for m in t]
    assert bounded_history(messages, max_turns=10, max_tokens=10**6) == messages
    capped = bounded_history(messages, max_turns=10, max_tokens=2500)
    assert capped[:2] == head and len(capped) == 2 + 1 + 2 * 2 and "3 earlier turn(s)" in capped[2]["content"]
    assert bounded_history(messages, max_turns=10, max_tokens=1)[-2:] == turns[-1]


def test_retrying_transport_passes_non_transient_errors_through():
    transport = RetryingTransport(Flaky(None, [KeyError("replay: unseen")]), retries=3, sleep=lambda s: None)
    with pytest.raises(KeyError):
        transport({})
    assert transport.retried == 0
