"""The chat proposer: any OpenAI-compatible chat model with a small file-tool loop of our own.

For setups without an agent CLI. The model gets list_files / read_file / grep over the read-only
archive copy (paths confined to it) and write_candidate / finish; no shell, so it needs no
sandbox. Three things keep a long session alive:
- transport errors are retried with backoff (chat_transport.RetryingTransport);
- the history sent is bounded: the system and task messages always, then the last
  `history_turns` turns (an assistant message with its tool results), fewer if their estimated
  size passes `history_tokens`; a note says how many turns were left out. The estimate (4
  characters a token) runs low for JSON and digits, so a 400 answer to a request holding more than
  the last turn (how OpenAI and vLLM refuse a prompt over the context) is resent with fewer turns
  and a budget lowered for the rest of the session;
- a malformed tool call (invalid JSON, wrong types, unknown argument or tool) is answered with a
  tool error that says what was wrong, and the session goes on.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
from pathlib import Path
from typing import Any, Callable

from whale.harness.chat_transport import HTTPTransport, RetryingTransport, Transport, describe
from whale.harness.proposal import Proposal, proposal_from_source
from whale.harness.workspace import build_workspace, remove_tree

CHARS_PER_TOKEN = 4  # the history estimate; only its order of magnitude matters


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
TOOL_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in CHAT_TOOLS}
JSON_TYPES = {"string": str, "integer": int}


def argument_problem(name: str, args: Any) -> str | None:
    """Why `args` does not fit tool `name`'s schema (None when it does)."""
    schema = TOOL_PARAMETERS[name]
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    props = schema["properties"]
    for key, value in args.items():
        if key not in props:
            return f"unknown argument {key!r} (expected: {', '.join(props) or 'none'})"
        want = props[key]["type"]
        if not isinstance(value, JSON_TYPES[want]) or isinstance(value, bool):
            return f"argument {key!r} must be a {want}, got {type(value).__name__}"
    missing = [k for k in schema["required"] if k not in args]
    return f"missing required argument(s): {', '.join(missing)}" if missing else None


def _estimate_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(m)) for m in messages) // CHARS_PER_TOKEN


def bounded_history(messages: list[dict[str, Any]], max_turns: int, max_tokens: int, note: str = "") -> list[dict]:
    """messages[:2] (system, task) + the last turns that fit; see the module docstring.

    A turn starts at an assistant message and holds what follows it (tool results, a nudge), so
    a tool result is never separated from the call it answers. The last turn is always kept.
    """
    head, turns = messages[:2], []
    for m in messages[2:]:
        if m["role"] == "assistant" or not turns:
            turns.append([])
        turns[-1].append(m)
    kept = turns[-max(1, max_turns):]
    while len(kept) > 1 and _estimate_tokens(head + [m for t in kept for m in t]) > max_tokens:
        kept = kept[1:]
    dropped = len(turns) - len(kept)
    omitted = [{"role": "user", "content": f"[{dropped} earlier turn(s) left out to fit the context. {note}]"}] \
        if dropped else []
    return head + omitted + [m for t in kept for m in t]


class ChatProposer:
    """An OpenAI-compatible chat model with file tools confined to the archive copy.

    Bounded by `max_turns` model calls and `token_budget` total tokens; `max_tokens` is the
    per-response limit sent to the endpoint. `sleep` is the backoff's clock (tests pass a fake).
    """

    name = "chat"

    def __init__(self, model: str, base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 max_turns: int = 24, max_tokens: int = 4096, token_budget: int = 400_000,
                 transport: Transport | None = None, *, retries: int = 4, backoff_s: float = 2.0,
                 history_turns: int = 16, history_tokens: int = 64_000, sleep: Callable[[float], None] = time.sleep):
        if transport is None and not base_url:
            raise ValueError("chat proposer needs harness.chat_base_url (an OpenAI-compatible endpoint)")
        self.model = model
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.token_budget = token_budget
        self.history_turns = history_turns
        self.history_tokens = history_tokens
        self.transport = RetryingTransport(transport or HTTPTransport(base_url, api_key_env), retries, backoff_s,
                                           sleep=sleep)
        self.last_error: str | None = None
        self.last_usage: dict[str, float] = {}
        self.exhausted = False  # a model can always write another candidate

    def propose(self, archive, domain, n, workspace, context) -> list[Proposal]:
        workspace = Path(workspace)
        try:
            return self._session(archive, n, workspace, context)
        finally:
            remove_tree(workspace)  # the archive copy never outlives its round, whatever happened

    def _session(self, archive, n: int, workspace: Path, context) -> list[Proposal]:
        self.last_error, self.last_usage = None, {}
        root = build_workspace(archive, workspace, context.brief)
        tools = ChatTools(root, workspace / "candidates", n)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": context.brief},
            {"role": "user", "content": f"The archive is the root of your file tools. You have no shell: instead of "
                                        f"writing files, submit each candidate with write_candidate. Read the archive, "
                                        f"then call write_candidate exactly {n} time(s) and finish."},
        ]
        log = []
        started, tokens, turns, retried = time.monotonic(), 0, 0, self.transport.retried
        budget = self.history_tokens
        try:
            while turns < self.max_turns and tokens < self.token_budget and not tools.finished:
                turns += 1
                sent = bounded_history(messages, self.history_turns, budget,
                                       note=f"Candidates written so far: {len(tools.proposals)} of {n}.")
                try:
                    response = self.transport({"model": self.model, "messages": sent, "tools": CHAT_TOOLS,
                                               "max_tokens": self.max_tokens})
                except urllib.error.HTTPError as e:
                    if e.code != 400 or sum(m["role"] == "assistant" for m in sent) < 2:
                        raise
                    budget = _estimate_tokens(sent) * 3 // 4  # the estimate was too low for this tokenizer
                    log.append(f"transport: {describe(e)}; resending fewer turns (history estimate {budget})")
                    turns -= 1  # the same turn again
                    continue
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
                    call = call if isinstance(call, dict) else {}  # a garbled call still gets an answer
                    function = call["function"] if isinstance(call.get("function"), dict) else {}
                    result = tools.call(function.get("name"), function.get("arguments") or "{}")
                    log.append(f"tool {function.get('name')}: {result[:500]}")
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
        except (urllib.error.URLError, OSError, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            self.last_error = f"chat proposer failed: {describe(e)}"
        log += [f"transport: {line}" for line in self.transport.errors]
        self.transport.errors = []
        self.last_usage = {"seconds": round(time.monotonic() - started, 2), "tokens": tokens, "turns": turns,
                           "retries": self.transport.retried - retried}
        tag = context.tag or f"it{context.iteration}"
        (archive.proposals_dir(tag) / "transcript.txt").write_text("\n".join(log) + "\n")
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

    def call(self, name: Any, arguments: Any) -> str:
        """Run one tool call; anything wrong with it comes back as an 'error: ...' string."""
        functions: dict[str, Callable[..., str]] = {
            "list_files": self.list_files, "read_file": self.read_file, "grep": self.grep,
            "write_candidate": self.write_candidate, "finish": self.finish}
        if not isinstance(name, str) or name not in functions:
            return f"error: unknown tool {name!r} (tools: {', '.join(functions)})"
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as e:
            return f"error: {name}: arguments are not valid JSON ({e.msg} at character {e.pos}); send a JSON object"
        problem = argument_problem(name, args)
        if problem:
            return f"error: {name}: {problem}"
        try:
            return functions[name](**args)
        except FileNotFoundError:  # its message would hold the workspace's absolute path
            return f"error: {name}: no such file or folder {args.get('path')!r} in the archive"
        except (OSError, ValueError) as e:  # PermissionError: outside the archive; IsADirectoryError, ...
            return f"error: {e.strerror if isinstance(e, OSError) and e.strerror else e}"

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
        offset, limit = max(0, offset), max(1, min(limit, 2000))
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
