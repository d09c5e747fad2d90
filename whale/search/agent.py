"""The coding-agent proposer (the paper's): Claude Code, Codex or any command, run in a sandbox.

`harness.agent` picks how the agent is started:
- `claude_code`: `claude -p PROMPT --output-format stream-json --verbose --permission-mode M [--model X]`
- `codex`: `codex exec --skip-git-repo-check --cd WORKSPACE --json --sandbox S [--model X] PROMPT`
- `command`: `harness.agent_command`, a shell line with {workspace} and {brief} substituted.
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
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from whale.search.agent_sandbox import (Bind, agent_env, bwrap_argv, bwrap_problem, check_bind_paths, check_binds,
                                        executable_binds, expand, open_copies)
from whale.search.proposal import Proposal
from whale.search.workspace import build_workspace, collect_candidates, remove_tree

AGENT_PROMPT = ("Read BRIEF.md in the current directory and follow it exactly: study the archive in archive/, "
                "then write the candidate harness files into candidates/. Everything you need is in this "
                "directory; do not run evaluations.")


def claude_code_argv(workspace: Path, model: str | None, sandboxed: bool) -> list[str]:
    argv = ["claude", "-p", AGENT_PROMPT, "--output-format", "stream-json", "--verbose"]
    if sandboxed:
        argv += ["--permission-mode", "bypassPermissions"]
    else:
        argv += ["--permission-mode", "acceptEdits", "--allowedTools", "Read,Glob,Grep,Write,Edit"]
    return argv + (["--model", model] if model else [])


def codex_argv(workspace: Path, model: str | None, sandboxed: bool) -> list[str]:
    argv = ["codex", "exec", "--skip-git-repo-check", "--cd", str(workspace), "--json",
            "--sandbox", "danger-full-access" if sandboxed else "workspace-write"]
    return argv + (["--model", model] if model else []) + [AGENT_PROMPT]


def agent_usage(transcript: str) -> dict[str, float]:
    """Tokens (and cost) an agent reported in its JSON event stream: Claude Code's final `result`
    event, Codex's `turn.completed` events. Empty for anything else (a `command` agent)."""
    tokens = {"input_tokens": 0, "output_tokens": 0}
    found: dict[str, float] = {}
    for line in transcript.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
            usage = event.get("usage") if isinstance(event, dict) else None
            if not isinstance(usage, dict) or event.get("type") not in ("result", "turn.completed"):
                continue
            if event["type"] == "result":  # Claude Code: totals for the session
                tokens["input_tokens"] = sum(int(usage.get(k) or 0) for k in (
                    "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))
                tokens["output_tokens"] = int(usage.get("output_tokens") or 0)
                if event.get("total_cost_usd") is not None:
                    found["cost_usd"] = float(event["total_cost_usd"])
            else:  # Codex: one event per turn
                tokens["input_tokens"] += int(usage.get("input_tokens") or 0)
                tokens["output_tokens"] += int(usage.get("output_tokens") or 0)
            found.update(tokens)
        except (ValueError, TypeError):
            continue
    if found:
        found["tokens"] = found["input_tokens"] + found["output_tokens"]
    return found


@dataclass(frozen=True)
class AgentPreset:
    executable: str
    argv: Callable[[Path, str | None, bool], list[str]]
    env_vars: tuple[str, ...]  # passed through when set in the parent
    config_binds: tuple[tuple[str, str], ...]  # (path, mode): the agent's own config and login


PRESETS = {
    "claude_code": AgentPreset("claude", claude_code_argv,
                               ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL",
                                "CLAUDE_CODE_OAUTH_TOKEN"),
                               (("~/.claude", "rw"), ("~/.claude.json", "copy"))),
    "codex": AgentPreset("codex", codex_argv, ("OPENAI_API_KEY", "CODEX_API_KEY", "OPENAI_BASE_URL"),
                         (("~/.codex", "rw"),)),
}
AGENTS = ("claude_code", "codex", "command")
SANDBOXES = ("bwrap", "none")


class AgentCLIProposer:
    """Runs a coding agent in its workspace (see the module docstring) with a timeout.

    `binds`: (path, mode) pairs for the agent's own files, mode ro / rw / copy; None takes the
    preset's defaults (bound when they exist). `env_vars`: variables passed besides PATH, HOME, LANG and the
    preset's. A sandbox that cannot start is an error here, at construction, not hours later.
    """

    name = "agent_cli"

    def __init__(self, command: str | None = None, timeout_s: float = 2400, env_vars: tuple[str, ...] = (), *,
                 agent: str = "command", model: str | None = None, sandbox: str = "bwrap",
                 binds: list[tuple[str, str]] | None = None):
        if agent not in AGENTS:
            raise ValueError(f"harness.agent must be one of {', '.join(AGENTS)}, got {agent!r}")
        if sandbox not in SANDBOXES:
            raise ValueError(f"harness.agent_sandbox must be one of {', '.join(SANDBOXES)}, got {sandbox!r}")
        if agent == "command" and not (command and command.strip()):
            raise ValueError("harness.agent 'command' needs harness.agent_command "
                             "(a shell command; {workspace} and {brief} are substituted)")
        if agent != "command" and command:
            raise ValueError(f"harness.agent_command is used only with harness.agent=command, not {agent!r}")
        self.agent, self.command, self.model, self.sandbox = agent, command, model, sandbox
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
        if self.preset and shutil.which(self.preset.executable) is None:
            raise RuntimeError(f"harness.agent '{agent}' needs the `{self.preset.executable}` CLI on PATH")
        if sandbox == "bwrap":
            problem = bwrap_problem()
            if problem:
                raise RuntimeError(f"harness.agent_sandbox is 'bwrap' but {problem}; install bubblewrap "
                                   "(apt-get install bubblewrap) or set harness.agent_sandbox=none to run the agent "
                                   "unsandboxed (docs/sandbox.md says what that gives up)")
            self.binds += self._executable_binds()

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

    def argv(self, workspace: Path) -> list[str]:
        """The agent's own command line (inside the sandbox when there is one)."""
        if self.preset:
            return self.preset.argv(workspace, self.model, self.sandbox == "bwrap")
        cmd = (self.command.replace("{workspace}", shlex.quote(str(workspace)))
               .replace("{brief}", shlex.quote(str(workspace / "BRIEF.md"))))
        return ["/bin/sh", "-c", cmd]

    def env(self) -> dict[str, str]:
        env = agent_env(self.env_vars, self.home)
        if self.agent == "claude_code" and self.sandbox == "bwrap" and os.getuid() == 0:
            env["IS_SANDBOX"] = "1"  # true here; Claude Code refuses bypassPermissions as root without it
        return env

    def full_argv(self, workspace: Path, run_dir: Path, copy_fds: dict[Path, int] | None = None) -> list[str]:
        """What is executed: the agent's argv, wrapped in bwrap unless agent_sandbox is none."""
        workspace = Path(workspace).absolute()
        if self.sandbox == "none":
            return self.argv(workspace)
        check_binds(self.binds, run_dir)
        return bwrap_argv(workspace, self.binds, self.home, self.argv(workspace), copy_fds)

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
        self.last_usage = {"seconds": round(time.monotonic() - started, 2),
                           **agent_usage(transcript.read_text(errors="replace"))}
        proposals, skipped = collect_candidates(workspace / "candidates", n, context.incoming_id)
        problems = [status] if status != "ok" else []
        problems += [f"skipped {s}" for s in skipped]
        if not proposals:
            self.last_error = "; ".join(problems + ["wrote no candidates"]) if problems else "agent wrote no candidates"
        elif problems:
            self.last_error = "; ".join(problems)  # partial output is still used
        return proposals

    def _run(self, argv: list[str], workspace: Path, transcript: Path, pass_fds: tuple[int, ...] = ()) -> str:
        with open(transcript, "w") as out:
            out.write(f"[whale] agent {self.agent}, sandbox {self.sandbox}\n$ {shlex.join(argv)}\n")
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
