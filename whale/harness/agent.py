"""The coding-agent proposer (the paper's): Claude Code, Codex or any command, run in a sandbox.

`harness.agent` picks how the agent is started:
- `claude_code`: `claude -p PROMPT --output-format stream-json --verbose --permission-mode M --tools T
  [--model X]`, its non-essential traffic off (CLAUDE_QUIET);
- `codex`: `codex exec --json --skip-git-repo-check --cd WORKSPACE --sandbox S -c ... [--model X] PROMPT`,
  with analytics, plugins and web search off (CODEX_QUIET);
- `command`: `harness.agent_command`, a shell line with {workspace} and {brief} substituted.
The pinned versions (PRESETS' `npm`) are the ones tests/test_agent_cli.py runs for real, offline,
against a local stand-in of their APIs. `harness.agent_base_url` points a preset at another
endpoint in the way its CLI needs. Before the first round a preflight checks for a login and runs
`<cli> --version` exactly as a round would, so an agent that cannot start fails `whale run` at once.
Under bubblewrap (`harness.agent_sandbox: bwrap`, the default) our sandbox is the boundary, so
the presets switch the agent's own one off (Claude Code: bypassPermissions, declared with
IS_SANDBOX=1 when we are root, as Claude Code demands; Codex: danger-full-access, since its own
bubblewrap nests badly inside ours). Without it (`agent_sandbox: none`) they keep the agent's own
guard on: Claude Code may only use file tools, with edits auto-accepted; Codex runs with
workspace-write. docs/sandbox.md ("Proposer sandbox") states what each mode guarantees.

The agent gets the workspace (workspace.py) as its working directory, a prompt that points it to
BRIEF.md, a scrubbed environment and a timeout; its stdout and stderr go to
harnesses/_proposals/<tag>/transcript.txt, and only `candidates/*.py` comes back.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from whale.harness.agent_sandbox import (Bind, agent_env, bwrap_argv, bwrap_problem, check_bind_paths, check_binds,
                                        executable_binds, expand, open_copies)
from whale.harness.proposal import Proposal
from whale.harness.workspace import build_workspace, collect_candidates, remove_tree

AGENT_PROMPT = ("Read BRIEF.md in the current directory and follow it exactly: study the archive in archive/, "
                "then write the candidate harness files into candidates/. Everything you need is in this "
                "directory; do not run evaluations.")
# Claude Code's tools under our sandbox: files and a shell (to prototype a harness on a trace);
# no web tools, no sub-agents. Without the sandbox: file tools only.
CLAUDE_TOOLS_SANDBOXED = "Bash,Read,Write,Edit,Glob,Grep"
CLAUDE_TOOLS_UNSANDBOXED = "Read,Glob,Grep,Write,Edit"
# Claude Code's calls besides the model's (telemetry, error reports, update checks; ~40 DNS look-ups)
CLAUDE_QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
# Codex's: usage analytics, plugin sync, the hosted web-search tool
CODEX_QUIET = ("analytics.enabled=false", "features.plugins=false", 'web_search="disabled"')
CODEX_PROVIDER = "whale"  # the provider entry harness.agent_base_url adds


def claude_code_argv(workspace: Path, model: str | None, sandboxed: bool, base_url: str | None = None) -> list[str]:
    argv = ["claude", "-p", AGENT_PROMPT, "--output-format", "stream-json", "--verbose"]
    if sandboxed:
        argv += ["--permission-mode", "bypassPermissions", "--tools", CLAUDE_TOOLS_SANDBOXED]
    else:
        argv += ["--permission-mode", "acceptEdits", "--tools", CLAUDE_TOOLS_UNSANDBOXED]
    return argv + (["--model", model] if model else [])  # base_url goes through the environment


def codex_argv(workspace: Path, model: str | None, sandboxed: bool, base_url: str | None = None) -> list[str]:
    """Codex 0.171 ignores OPENAI_BASE_URL: another endpoint is a provider entry in its config,
    given here as `-c` overrides (the same keys as config.toml, without touching ~/.codex)."""
    argv = ["codex", "exec", "--json", "--skip-git-repo-check", "--cd", str(workspace),
            "--sandbox", "danger-full-access" if sandboxed else "workspace-write"]
    for override in CODEX_QUIET:
        argv += ["-c", override]
    if base_url:
        provider = (f'{{name="{CODEX_PROVIDER}", base_url={json.dumps(base_url)}, env_key="OPENAI_API_KEY", '
                    'wire_api="responses"}')
        argv += ["-c", f"model_provider={CODEX_PROVIDER}", "-c", f"model_providers.{CODEX_PROVIDER}={provider}"]
    return argv + (["--model", model] if model else []) + [AGENT_PROMPT]


def _events(transcript: str):
    for line in transcript.splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                yield event


def agent_usage(transcript: str) -> dict[str, float]:
    """Tokens (and cost) an agent reported in its JSON event stream: Claude Code's final `result`
    event (with its USD estimate), Codex's `turn.completed` events (tokens only). Empty for
    anything else (a `command` agent)."""
    tokens = {"input_tokens": 0, "output_tokens": 0}
    found: dict[str, float] = {}
    for event in _events(transcript):
        usage = event.get("usage")
        if not isinstance(usage, dict) or event.get("type") not in ("result", "turn.completed"):
            continue
        try:
            if event["type"] == "result":  # Claude Code: totals for the session
                tokens["input_tokens"] = sum(int(usage.get(k) or 0) for k in (
                    "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))
                tokens["output_tokens"] = int(usage.get("output_tokens") or 0)
                if event.get("total_cost_usd") is not None:
                    found["cost_usd"] = float(event["total_cost_usd"])
            else:  # Codex: one event per turn
                tokens["input_tokens"] += int(usage.get("input_tokens") or 0)
                tokens["output_tokens"] += int(usage.get("output_tokens") or 0)
        except (ValueError, TypeError):
            continue
        found.update(tokens)
    if found:
        found["tokens"] = found["input_tokens"] + found["output_tokens"]
    return found


def agent_error(transcript: str) -> str | None:
    """The agent's own last word on a failure, from its JSON events: Claude Code's `result` with
    is_error, Codex's `turn.failed` / `error`. So a round's reason says "API Error: 401 ..." and
    not only "exited with code 1"."""
    found = None
    for event in _events(transcript):
        if event.get("type") == "result" and event.get("is_error"):
            found = str(event.get("result") or event.get("subtype") or "error")
        elif event.get("type") == "turn.failed" and isinstance(event.get("error"), dict):
            found = str(event["error"].get("message") or "turn failed")
        elif event.get("type") == "error" and not found:
            found = str(event.get("message") or "error")
    return " ".join(found.split())[:300] if found else None


@dataclass(frozen=True)
class AgentPreset:
    executable: str
    npm: str  # the npm package that installs it, at the version our tests ran (scripts/install_agents.sh)
    argv: Callable[[Path, str | None, bool, str | None], list[str]]
    env_vars: tuple[str, ...]  # passed through when set in the parent
    config_binds: tuple[tuple[str, str], ...]  # (path, mode): the agent's own config and login
    login_vars: tuple[str, ...]  # one of these set, or login_file present, or the agent cannot log in
    login_file: str


PRESETS = {
    "claude_code": AgentPreset("claude", "@anthropic-ai/claude-code@2.1.197", claude_code_argv,
                               ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL",
                                "CLAUDE_CODE_OAUTH_TOKEN"),
                               (("~/.claude", "rw"), ("~/.claude.json", "copy")),
                               ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN"),
                               "~/.claude/.credentials.json"),
    "codex": AgentPreset("codex", "@openai/codex@0.171.0", codex_argv, ("OPENAI_API_KEY", "CODEX_API_KEY"),
                         (("~/.codex", "rw"),), ("OPENAI_API_KEY", "CODEX_API_KEY"), "~/.codex/auth.json"),
}
AGENTS = ("claude_code", "codex", "command")
SANDBOXES = ("bwrap", "none")
PREFLIGHT_TIMEOUT_S = 60


class AgentCLIProposer:
    """Runs a coding agent in its workspace (see the module docstring) with a timeout.

    `binds`: (path, mode) pairs for the agent's own files, mode ro / rw / copy; None takes the
    preset's defaults (bound when they exist). `env_vars`: variables passed besides PATH, HOME, LANG and the
    preset's. `base_url`: the endpoint a preset's agent calls instead of its vendor's (Claude Code:
    ANTHROPIC_BASE_URL; Codex: a provider entry keyed by OPENAI_API_KEY). A sandbox or an agent
    that cannot start, or has no login, is an error here, at construction (the preflight), not
    hours later.
    """

    name = "agent_cli"

    def __init__(self, command: str | None = None, timeout_s: float = 2400, env_vars: tuple[str, ...] = (), *,
                 agent: str = "command", model: str | None = None, sandbox: str = "bwrap",
                 binds: list[tuple[str, str]] | None = None, base_url: str | None = None):
        if agent not in AGENTS:
            raise ValueError(f"harness.agent must be one of {', '.join(AGENTS)}, got {agent!r}")
        if sandbox not in SANDBOXES:
            raise ValueError(f"harness.agent_sandbox must be one of {', '.join(SANDBOXES)}, got {sandbox!r}")
        if agent == "command" and not (command and command.strip()):
            raise ValueError("harness.agent 'command' needs harness.agent_command "
                             "(a shell command; {workspace} and {brief} are substituted)")
        if agent != "command" and command:
            raise ValueError(f"harness.agent_command is used only with harness.agent=command, not {agent!r}")
        if agent == "command" and base_url:
            raise ValueError("harness.agent_base_url is for the claude_code and codex presets; a command agent "
                             "takes its endpoint from its own command line or harness.agent_env")
        self.agent, self.command, self.model, self.sandbox, self.base_url = agent, command, model, sandbox, base_url
        self.timeout_s = timeout_s
        self.preset = PRESETS.get(agent)
        self.env_vars = tuple(env_vars) + (self.preset.env_vars if self.preset else ())
        if binds is None:
            self.binds = [Bind(expand(p), m, required=False) for p, m in (self.preset.config_binds if self.preset else ())]
        else:
            self.binds = [Bind(expand(p), m) for p, m in binds]
        check_bind_paths(self.binds)
        self.home = os.environ.get("HOME")
        self.last_error: str | None = None
        self.last_usage: dict[str, float] = {}
        self.exhausted = False  # a model can always write another candidate
        self.version = ""
        self.exe_binds: list[Bind] = []  # the agent's install folder (read-only), checked against the run only
        if self.preset and shutil.which(self.preset.executable) is None:
            raise RuntimeError(f"harness.agent '{agent}' needs the `{self.preset.executable}` CLI on PATH "
                               f"(npm install {self.preset.npm}; scripts/install_agents.sh puts it in .agents/)")
        if sandbox == "bwrap":
            problem = bwrap_problem()
            if problem:
                raise RuntimeError(f"harness.agent_sandbox is 'bwrap' but {problem}; install bubblewrap "
                                   "(apt-get install bubblewrap) or set harness.agent_sandbox=none to run the agent "
                                   "unsandboxed (docs/sandbox.md says what that gives up)")
            self.exe_binds = self._executable_binds()
        if self.preset:
            self._preflight()

    def _executable_binds(self) -> list[Bind]:
        """The agent's install folder, when it lives outside /usr (see executable_binds)."""
        path = os.environ.get("PATH", "")
        if self.preset:
            return executable_binds(self.preset.executable, path)
        try:
            words = shlex.split(self.command or "")
        except ValueError:  # unbalanced quotes: the shell will say so when it runs
            return []
        return executable_binds(words[0], path) if words else []

    def _preflight(self) -> None:
        """A login to use, and `<cli> --version` run exactly as a round will run it (sandbox,
        binds, environment): a missing native package or a bind the CLI needs shows here."""
        preset = self.preset
        env = self.env()
        if self.agent == "codex" and self.base_url and "OPENAI_API_KEY" not in env:
            raise RuntimeError("harness.agent 'codex' with harness.agent_base_url reads its key from OPENAI_API_KEY, "
                               "which is not set (set it, to any value if the endpoint takes none)")
        if not any(v in env for v in preset.login_vars) and not os.path.isfile(expand(preset.login_file)):
            raise RuntimeError(f"harness.agent '{self.agent}' has no login: set {' or '.join(preset.login_vars)}, "
                               f"or log in with `{preset.executable}` so that {preset.login_file} exists")
        with tempfile.TemporaryDirectory(prefix="whale-preflight-") as tmp:
            workspace = Path(tmp) / "ws"
            for sub in ("archive", "candidates"):
                (workspace / sub).mkdir(parents=True)
            (workspace / "BRIEF.md").write_text("")
            with open_copies(self.binds if self.sandbox == "bwrap" else []) as fds:
                argv = [preset.executable, "--version"]
                if self.sandbox == "bwrap":
                    argv = bwrap_argv(workspace, self.binds + self.exe_binds, self.home, argv, fds)
                try:
                    out = subprocess.run(argv, cwd=workspace, env=env, capture_output=True, text=True,
                                         stdin=subprocess.DEVNULL, timeout=PREFLIGHT_TIMEOUT_S,
                                         pass_fds=tuple(fds.values()))
                except (OSError, subprocess.TimeoutExpired) as e:
                    raise RuntimeError(f"harness.agent '{self.agent}' could not start: {e}") from None
        said = " ".join((out.stdout + out.stderr).split())[:300]
        if out.returncode != 0:
            raise RuntimeError(f"harness.agent '{self.agent}' could not start (`{preset.executable} --version` "
                               f"exited with {out.returncode}{' in the sandbox' if self.sandbox == 'bwrap' else ''}): "
                               f"{said or 'no output'}")
        found = re.search(r"\d+\.\d+\.\d+\S*", said)
        self.version = found.group(0) if found else said

    def argv(self, workspace: Path) -> list[str]:
        """The agent's own command line (inside the sandbox when there is one)."""
        if self.preset:
            return self.preset.argv(workspace, self.model, self.sandbox == "bwrap", self.base_url)
        cmd = (self.command.replace("{workspace}", shlex.quote(str(workspace)))
               .replace("{brief}", shlex.quote(str(workspace / "BRIEF.md"))))
        return ["/bin/sh", "-c", cmd]

    def env(self) -> dict[str, str]:
        """PATH, HOME, LANG, the preset's defaults, then what the parent sets of the preset's and
        agent_env's variables (so a user can override a default), then the base URL."""
        quiet = CLAUDE_QUIET if self.agent == "claude_code" else {}
        env = {**agent_env((), self.home), **quiet, **agent_env(self.env_vars, self.home)}
        if self.agent == "claude_code" and self.sandbox == "bwrap":
            env["CLAUDE_CODE_BUBBLEWRAP"] = "1"  # it runs inside bubblewrap (Claude Code's own name for it)
            if os.getuid() == 0:
                env["IS_SANDBOX"] = "1"  # true here; Claude Code refuses bypassPermissions as root without it
        if self.agent == "claude_code" and self.base_url:
            env["ANTHROPIC_BASE_URL"] = self.base_url
        return env

    def full_argv(self, workspace: Path, run_dir: Path, copy_fds: dict[Path, int] | None = None) -> list[str]:
        """What is executed: the agent's argv, wrapped in bwrap unless agent_sandbox is none."""
        workspace = Path(workspace).absolute()
        if self.sandbox == "none":
            return self.argv(workspace)
        check_binds(self.binds, run_dir)
        check_binds(self.exe_binds, run_dir, source_tree=False)
        return bwrap_argv(workspace, self.binds + self.exe_binds, self.home, self.argv(workspace), copy_fds)

    def propose(self, archive, domain, n, workspace, context) -> list[Proposal]:
        workspace = Path(workspace).absolute()
        try:
            return self._propose(archive, n, workspace, context)
        finally:
            remove_tree(workspace)  # the archive copy never outlives its round, whatever happened

    def _propose(self, archive, n: int, workspace: Path, context) -> list[Proposal]:
        self.last_error, self.last_usage = None, {}
        transcript = archive.proposals_dir(context.tag or f"it{context.iteration}") / "transcript.txt"
        started = time.monotonic()
        try:
            build_workspace(archive, workspace, context.brief)
            with open_copies(self.binds if self.sandbox == "bwrap" else []) as fds:
                argv = self.full_argv(workspace, archive.run_dir, fds)
                status = self._run(argv, workspace, transcript, tuple(fds.values()))
        except (OSError, ValueError) as e:
            status = f"agent could not start: {e}"
            with open(transcript, "a") as out:
                out.write(f"[whale] {status}\n")
        text = transcript.read_text(errors="replace")
        self.last_usage = {"seconds": round(time.monotonic() - started, 2), **agent_usage(text)}
        said = agent_error(text)
        proposals, skipped = collect_candidates(workspace / "candidates", n, context.incoming_id)
        if said and (status != "ok" or not proposals):
            status = f"{status}: {said}" if status != "ok" else f"agent reported: {said}"
        problems = [status] if status != "ok" else []
        problems += [f"skipped {s}" for s in skipped]
        if not proposals:
            self.last_error = "; ".join(problems + ["wrote no candidates"]) if problems else "agent wrote no candidates"
        elif problems:
            self.last_error = "; ".join(problems)  # partial output is still used
        return proposals

    def _run(self, argv: list[str], workspace: Path, transcript: Path, pass_fds: tuple[int, ...] = ()) -> str:
        with open(transcript, "w") as out:
            version = f" {self.version}" if self.version else ""
            out.write(f"[whale] agent {self.agent}{version}, sandbox {self.sandbox}\n$ {shlex.join(argv)}\n")
            out.flush()
            proc = subprocess.Popen(argv, cwd=workspace, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=pass_fds)
            try:
                rc = proc.wait(timeout=self.timeout_s)
                status = "ok" if rc == 0 else f"agent exited with code {rc}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the session: bwrap (its PID namespace dies with it) or the shell
                proc.wait()
                status = f"agent timed out after {self.timeout_s:g} s"
            out.write(f"\n[whale] {status}\n")
        return status
