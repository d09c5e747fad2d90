"""Proposers: whatever writes new candidate harnesses from the archive.

Three kinds share one small protocol:
- `AgentCLIProposer` runs a coding agent (Claude Code, Codex, aider, ...) as a shell command in a
  workspace that holds a read-only copy of the archive, a writable `candidates/` folder and
  BRIEF.md. This is the paper's proposer.
- `ChatProposer` drives any OpenAI-compatible chat endpoint with a small tool loop of our own
  (list/read/grep the archive copy, write candidates), for setups without an agent CLI.
- `MutationProposer` (mutation.py) applies a fixed library of code transformations offline.

A proposer failure (crash, timeout, nothing written, endpoint down) never stops the run: `propose`
returns [] and says why in `last_error`, and the loop records it.

Workspace isolation: the archive is *copied* (never hard-linked, since a root agent could write
through a hard link into the real archive), files chmod 0444 and folders 0555, with only
harness code, meta, scores, traces, summary and frontier included; val/test results and
weight-phase rollouts are not in the archive at all. Permission bits do not bind root, so the
guarantee for a root agent is that it can only damage the copy, and only `candidates/*.py` is read
back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from whale.search.archive import Archive
from whale.search.validate import parse_docstring_fields

ARCHIVE_FILES = ("harness.py", "meta.json", "scores.json", "traces.jsonl")
ARCHIVE_ROOT_FILES = ("summary.jsonl", "frontier.json")


@dataclass
class Proposal:
    source: str
    hypothesis: str = ""
    mechanism: str = ""
    notes: str = ""
    parent: str | None = None


@dataclass
class ProposalContext:
    """What a proposer needs to know about the phase it proposes for."""

    iteration: int
    weights_version: str
    incoming_id: str
    brief: str = ""  # BRIEF.md text (brief.make_brief)
    prompt_only: bool = False
    base_source: str | None = None  # prompt-only: the harness whose prompts may change
    tag: str = ""  # folder name for this proposal round under harnesses/_proposals/
    seed: int = 0


class Proposer(Protocol):
    last_error: str | None
    last_usage: dict[str, float]

    def propose(self, archive: Archive, domain: Any, n: int, workspace: Path,
                context: ProposalContext) -> list[Proposal]: ...


def proposal_from_source(source: str, notes: str = "", default_parent: str | None = None) -> Proposal:
    fields = parse_docstring_fields(source)
    parent = fields.get("parent", default_parent)
    parent = parent.split()[0].strip("`'\".,") if parent else default_parent
    return Proposal(source=source, hypothesis=fields.get("hypothesis", ""),
                    mechanism=fields.get("mechanism", "unspecified"), notes=notes, parent=parent)


# ----- workspace ---------------------------------------------------------------------------------
def _make_read_only(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def _make_writable(root: Path) -> None:
    if not root.exists():
        return
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o644)


def remove_tree(root: Path) -> None:
    _make_writable(root)
    shutil.rmtree(root, ignore_errors=True)


def build_workspace(archive: Archive, workspace: Path, brief: str) -> Path:
    """workspace/{archive/ (read-only copy), candidates/ (writable), BRIEF.md}; returns archive/."""
    workspace = Path(workspace)
    remove_tree(workspace)
    copy = workspace / "archive"
    copy.mkdir(parents=True)
    for name in ARCHIVE_ROOT_FILES:
        if (archive.root / name).exists():
            shutil.copyfile(archive.root / name, copy / name)
    for cid in archive.ids():
        (copy / cid).mkdir()
        for name in ARCHIVE_FILES:
            src = archive.root / cid / name
            if src.is_file() and not src.is_symlink():
                shutil.copyfile(src, copy / cid / name)
    _make_read_only(copy)
    (workspace / "candidates").mkdir()
    (workspace / "BRIEF.md").write_text(brief)
    os.chmod(workspace / "BRIEF.md", 0o444)
    return copy


def collect_candidates(folder: Path, n: int, default_parent: str | None) -> list[Proposal]:
    out = []
    for path in sorted(folder.glob("*.py"))[: max(0, n)]:
        if path.is_file() and not path.is_symlink():
            out.append(proposal_from_source(path.read_text(errors="replace"), notes=f"file {path.name}",
                                            default_parent=default_parent))
    return out


# ----- coding-agent CLI --------------------------------------------------------------------------
class AgentCLIProposer:
    """Runs `command` (with {workspace} and {brief} substituted) in the workspace, with a timeout.

    The environment is scrubbed to PATH and HOME plus the variables named in `env_vars` (an agent
    needs its API key; nothing else of the parent leaks). The transcript (stdout+stderr) goes to
    harnesses/_proposals/<tag>/transcript.txt.
    """

    name = "agent_cli"

    def __init__(self, command: str, timeout_s: float = 2400, env_vars: tuple[str, ...] = ()):
        if not command or not command.strip():
            raise ValueError("agent_cli proposer needs a command (harness.agent_command)")
        self.command = command
        self.timeout_s = timeout_s
        self.env_vars = tuple(env_vars)
        self.last_error: str | None = None
        self.last_usage: dict[str, float] = {}

    def propose(self, archive, domain, n, workspace, context) -> list[Proposal]:
        self.last_error, self.last_usage = None, {}
        workspace = Path(workspace)
        build_workspace(archive, workspace, context.brief)
        cmd = (self.command.replace("{workspace}", shlex.quote(str(workspace)))
               .replace("{brief}", shlex.quote(str(workspace / "BRIEF.md"))))
        env = {k: os.environ[k] for k in ("PATH", "HOME", *self.env_vars) if k in os.environ}
        transcript = archive.proposals_dir(context.tag or f"it{context.iteration}") / "transcript.txt"
        started = time.monotonic()
        status = "ok"
        try:
            with open(transcript, "w") as out:
                out.write(f"$ {cmd}\n")
                out.flush()
                proc = subprocess.Popen(cmd, shell=True, cwd=workspace, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
                try:
                    rc = proc.wait(timeout=self.timeout_s)
                    if rc != 0:
                        status = f"agent command exited with code {rc}"
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole session: the shell and the agent
                    proc.wait()
                    status = f"agent command timed out after {self.timeout_s:g} s"
        except OSError as e:
            status = f"agent command could not start: {e}"
        self.last_usage = {"seconds": round(time.monotonic() - started, 2)}
        with open(transcript, "a") as out:
            out.write(f"\n[whale] {status}\n")
        proposals = collect_candidates(workspace / "candidates", n, context.incoming_id)
        remove_tree(workspace / "archive")
        if not proposals:
            self.last_error = f"{status}; wrote no candidates" if status != "ok" else "agent wrote no candidates"
        elif status != "ok":
            self.last_error = status  # partial output is still used
        return proposals


# ----- chat model with our own tool loop ---------------------------------------------------------
def _tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


CHAT_TOOLS = [
    _tool("list_files", "List files under a folder of the archive.", {"path": {"type": "string"}}, []),
    _tool("read_file", "Read lines of an archive file.", {"path": {"type": "string"}, "offset": {
        "type": "integer", "description": "first line (0-based)"}, "limit": {"type": "integer"}}, ["path"]),
    _tool("grep", "Regex search in archive files; returns file:line: text.",
          {"pattern": {"type": "string"}, "path": {"type": "string"}}, ["pattern"]),
    _tool("write_candidate", "Submit one candidate harness file.", {
        "name": {"type": "string"}, "source": {"type": "string"}, "hypothesis": {"type": "string"},
        "mechanism": {"type": "string"}}, ["source", "hypothesis", "mechanism"]),
    _tool("finish", "End the session once all candidates are written.", {}, []),
]


class Transport(Protocol):
    def __call__(self, request: dict[str, Any]) -> dict[str, Any]: ...


class HTTPTransport:
    """POST {base_url}/chat/completions with the stdlib; the key comes from an env var."""

    def __init__(self, base_url: str, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 600):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url, data=json.dumps(request).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())


def request_key(request: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()


class ReplayTransport:
    """Record/replay cache of chat responses keyed by sha256 of the sorted-JSON request.

    Replay (default) fails loudly on a request it has not seen, so a test cannot pass by talking
    to nothing. With WHALE_RECORD=1 (or record=True), unseen requests go to `inner` and the cache
    file is rewritten with the answer.
    """

    def __init__(self, path: str | Path, inner: Transport | None = None, record: bool | None = None):
        self.path = Path(path)
        self.inner = inner
        self.record = os.environ.get("WHALE_RECORD") == "1" if record is None else record
        self.cache: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        key = request_key(request)
        if key in self.cache:
            return self.cache[key]["response"]
        if not self.record or self.inner is None:
            raise KeyError(f"replay: unseen chat request {key[:12]} (re-record with WHALE_RECORD=1)")
        response = self.inner(request)
        self.cache[key] = {"request": request, "response": response}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.cache, indent=1, sort_keys=True) + "\n")
        return response


class ChatProposer:
    """An OpenAI-compatible chat model with file tools confined to the archive copy.

    Bounded by `max_turns` model calls and `token_budget` total tokens; `max_tokens` is the
    per-response limit sent to the endpoint.
    """

    name = "chat"

    def __init__(self, model: str, base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 max_turns: int = 24, max_tokens: int = 4096, token_budget: int = 400_000,
                 transport: Transport | None = None):
        if transport is None and not base_url:
            raise ValueError("chat proposer needs harness.chat_base_url (an OpenAI-compatible endpoint)")
        self.model = model
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.token_budget = token_budget
        self.transport = transport or HTTPTransport(base_url, api_key_env)
        self.last_error: str | None = None
        self.last_usage: dict[str, float] = {}

    def propose(self, archive, domain, n, workspace, context) -> list[Proposal]:
        self.last_error, self.last_usage = None, {}
        workspace = Path(workspace)
        root = build_workspace(archive, workspace, context.brief)
        tools = ChatTools(root, workspace / "candidates", n)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": context.brief},
            {"role": "user", "content": f"The archive is the root of your file tools. You have no shell: instead of "
                                        f"writing files, submit each candidate with write_candidate. Read the archive, "
                                        f"then call write_candidate exactly {n} time(s) and finish."},
        ]
        log = []
        started, tokens, turns = time.monotonic(), 0, 0
        try:
            while turns < self.max_turns and tokens < self.token_budget and not tools.finished:
                turns += 1
                response = self.transport({"model": self.model, "messages": messages, "tools": CHAT_TOOLS,
                                           "max_tokens": self.max_tokens})
                tokens += int((response.get("usage") or {}).get("total_tokens", 0))
                message = response["choices"][0]["message"]
                calls = message.get("tool_calls") or []
                messages.append({"role": "assistant", "content": message.get("content") or "",
                                 **({"tool_calls": calls} if calls else {})})
                log.append(f"assistant: {message.get('content') or ''}")
                if not calls:
                    messages.append({"role": "user", "content": "Use the tools: write_candidate, then finish."})
                    continue
                for call in calls:
                    result = tools.call(call["function"]["name"], call["function"].get("arguments") or "{}")
                    log.append(f"tool {call['function']['name']}: {result[:500]}")
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
        except (urllib.error.URLError, OSError, KeyError, IndexError, TypeError, ValueError) as e:
            self.last_error = f"chat proposer failed: {type(e).__name__}: {e}"
        self.last_usage = {"seconds": round(time.monotonic() - started, 2), "tokens": tokens, "turns": turns}
        tag = context.tag or f"it{context.iteration}"
        (archive.proposals_dir(tag) / "transcript.txt").write_text("\n".join(log) + "\n")
        remove_tree(root)
        if not tools.proposals and self.last_error is None:
            self.last_error = f"chat model wrote no candidates in {turns} turns"
        for p in tools.proposals:
            p.parent = p.parent or context.incoming_id
        return tools.proposals


class ChatTools:
    """The chat proposer's tools. Every path is resolved and must stay inside `root`."""

    def __init__(self, root: Path, out_dir: Path, n: int):
        self.root = Path(root).resolve()
        self.out_dir = Path(out_dir)
        self.n = n
        self.proposals: list[Proposal] = []
        self.finished = False

    def resolve(self, path: str | None) -> Path:
        p = (self.root / (path or ".").lstrip("/")).resolve()
        if p != self.root and self.root not in p.parents:
            raise PermissionError(f"path {path!r} is outside the archive")
        return p

    def call(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
            fn: Callable[..., str] = {"list_files": self.list_files, "read_file": self.read_file, "grep": self.grep,
                                      "write_candidate": self.write_candidate, "finish": self.finish}[name]
            return fn(**args)
        except KeyError:
            return f"error: unknown tool {name!r}"
        except (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError, TypeError,
                json.JSONDecodeError) as e:
            return f"error: {e}"

    def list_files(self, path: str = ".") -> str:
        """Files with their line counts (not byte sizes: those vary with trace timings)."""
        folder = self.resolve(path)
        rows = []
        for p in sorted(folder.rglob("*"))[:500]:
            if p.is_file():
                with open(p, "rb") as f:
                    lines = sum(1 for _ in f)
                rows.append(f"{p.relative_to(self.root)}\t{lines} lines")
        return "\n".join(rows) or "(empty)"

    def read_file(self, path: str, offset: int = 0, limit: int = 200) -> str:
        lines = self.resolve(path).read_text(errors="replace").splitlines()
        offset, limit = max(0, int(offset)), max(1, min(int(limit), 2000))
        chunk = "\n".join(lines[offset: offset + limit])[:20000]
        return f"[lines {offset}-{min(len(lines), offset + limit)} of {len(lines)}]\n{chunk}"

    def grep(self, pattern: str, path: str = ".") -> str:
        try:
            rx = re.compile(pattern)
        except re.error:
            rx = re.compile(re.escape(pattern))
        target = self.resolve(path)
        files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
        hits = []
        for f in files:
            for i, line in enumerate(f.read_text(errors="replace").splitlines()):
                if rx.search(line):
                    hits.append(f"{f.relative_to(self.root)}:{i}: {line[:300]}")
                    if len(hits) >= 100:
                        return "\n".join(hits) + "\n[first 100 matches]"
        return "\n".join(hits) or "(no matches)"

    def write_candidate(self, source: str, hypothesis: str, mechanism: str, name: str = "") -> str:
        if len(self.proposals) >= self.n:
            return f"error: already wrote {self.n} candidate(s); call finish"
        prop = proposal_from_source(source)
        prop.hypothesis, prop.mechanism = hypothesis, mechanism
        prop.notes = f"chat candidate {name or len(self.proposals) + 1}"
        self.proposals.append(prop)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"cand_{len(self.proposals)}.py").write_text(source)
        return f"ok: candidate {len(self.proposals)} of {self.n} saved"

    def finish(self) -> str:
        self.finished = True
        return "ok"


def make_proposer(cfg):
    """The proposer named by cfg.harness.proposer, with a clear error for missing settings."""
    from whale.config import ConfigError

    h = cfg.harness
    if h.proposer == "mutation":
        from whale.search.mutation import MutationProposer  # imports this module: import it late

        return MutationProposer(seed=cfg.seed, cfg=cfg)
    if h.proposer == "agent_cli":
        if not h.agent_command:
            raise ConfigError("harness.proposer 'agent_cli' needs harness.agent_command "
                              "(a shell command; {workspace} and {brief} are substituted)")
        return AgentCLIProposer(h.agent_command, h.agent_timeout_s, tuple(h.agent_env))
    if not (h.chat_model and h.chat_base_url):
        raise ConfigError("harness.proposer 'chat' needs harness.chat_model and harness.chat_base_url "
                          "(an OpenAI-compatible endpoint)")
    return ChatProposer(h.chat_model, h.chat_base_url, h.chat_api_key_env, max_turns=h.chat_max_turns)


def file_mode_is_read_only(path: Path) -> bool:
    return not (os.stat(path).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


__all__ = ["Proposal", "ProposalContext", "Proposer", "AgentCLIProposer", "ChatProposer", "ChatTools",
           "HTTPTransport", "ReplayTransport", "build_workspace", "collect_candidates", "remove_tree", "make_proposer"]
