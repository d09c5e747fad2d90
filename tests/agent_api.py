"""A local stand-in for the two agent APIs, so the real Claude Code and Codex CLIs run offline.

One stdlib HTTP server on 127.0.0.1 answers
- Anthropic Messages: `POST /v1/messages` (Claude Code always streams: message_start,
  content_block_start/delta/stop with text_delta or input_json_delta, message_delta, message_stop);
- OpenAI Responses: `POST /v1/responses` (Codex: response.created, response.output_item.added/done,
  response.completed with usage), with `function_call` (exec_command) and `custom_tool_call`
  (apply_patch) items whose results come back as function_call_output / custom_tool_call_output.

It replays a script of agent-neutral steps, one per model turn: ("shell", command), ("write",
path, text) or ("text", message). The turn is chosen by how many tool results the request carries,
so the conversation is the same whatever the CLI sends in between. Requests that offer no tools
(titles, summaries) get a one-word text answer. `mode` makes every turn fail instead: "500",
"429", "401" (any HTTP status) or "hang" (never answers). Tests only: nothing here is product code.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

USAGE_IN, USAGE_OUT = 1000, 50  # tokens reported per turn


def agent_script(candidate: str) -> list[tuple]:
    """The scripted round: read the brief and the archive, write one candidate, say so."""
    return [("shell", "cat BRIEF.md"),
            ("shell", "ls archive && cat archive/h0/harness.py && head -c 2000 archive/h0/traces.jsonl"),
            ("write", "candidates/cand_1.py", candidate),
            ("text", "Wrote candidates/cand_1.py.")]


def _sse(events: list[tuple[str, dict]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


class AgentAPI:
    """`with AgentAPI(script) as api:` serves at `api.url`; `api.requests` logs (method, path, body)."""

    def __init__(self, script: list[tuple], mode: str = "ok"):
        self.script, self.mode = script, mode
        self.requests: list[tuple[str, str, Any]] = []
        self.turns = 0  # scripted turns answered
        self._stop = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                api.requests.append(("GET", self.path, None))
                self._send(200, "application/json", b"{}")

            def do_HEAD(self):
                self._send(200, "application/json", b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                api.requests.append(("POST", self.path, body))
                path = self.path.split("?")[0]
                if path.endswith("/messages/count_tokens"):
                    return self._send(200, "application/json", json.dumps({"input_tokens": 100}).encode())
                if not (path.endswith("/messages") or path.endswith("/responses")):
                    return self._send(404, "application/json", b'{"error": {"message": "not found"}}')
                if api.mode == "hang":
                    api._stop.wait(600)
                    return
                if api.mode.isdigit():
                    kind = {"401": "authentication_error", "429": "rate_limit_error"}.get(api.mode, "api_error")
                    error = {"type": "error", "error": {"type": kind, "message": f"mock {api.mode}"}}
                    return self._send(int(api.mode), "application/json", json.dumps(error).encode(),
                                      {"retry-after": "0"})
                if path.endswith("/messages"):
                    payload = api.anthropic(body)
                else:
                    payload = api.openai(body)
                self._send(200, "text/event-stream", payload)

            def _send(self, code: int, ctype: str, data: bytes, headers: dict | None = None):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "AgentAPI":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()

    def _step(self, done: int, has_tools: bool) -> tuple:
        if not has_tools:
            return ("text", "OK")
        self.turns += 1
        return self.script[min(done, len(self.script) - 1)]

    # ----- Anthropic Messages -------------------------------------------------------------------
    def anthropic(self, body: dict) -> bytes:
        messages = body.get("messages", [])
        done = sum(1 for m in messages if isinstance(m.get("content"), list)
                   for c in m["content"] if isinstance(c, dict) and c.get("type") == "tool_result")
        step = self._step(done, bool(body.get("tools")))
        system = json.dumps(body.get("system", ""))
        cwd = re.search(r"Primary working directory: ([^\s\\]+)", system) or re.search(r"[Ww]orking directory: ([^\s\\]+)", system)
        if step[0] == "text":
            block, stop = {"type": "text", "text": ""}, "end_turn"
            delta = {"type": "text_delta", "text": step[1]}
        else:
            if step[0] == "shell":
                name, args = "Bash", {"command": step[1], "description": "Read files"}
            else:
                path = f"{cwd.group(1)}/{step[1]}" if cwd else step[1]
                name, args = "Write", {"file_path": path, "content": step[2]}
            block, stop = {"type": "tool_use", "id": f"toolu_{done}_{time.monotonic_ns()}", "name": name, "input": {}}, "tool_use"
            delta = {"type": "input_json_delta", "partial_json": json.dumps(args)}
        msg = {"id": f"msg_{time.monotonic_ns()}", "type": "message", "role": "assistant", "model": body.get("model", "m"),
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": USAGE_IN, "output_tokens": 1}}
        return _sse([("message_start", {"type": "message_start", "message": msg}),
                     ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
                     ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
                     ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                     ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                        "usage": {"output_tokens": USAGE_OUT}}),
                     ("message_stop", {"type": "message_stop"})])

    # ----- OpenAI Responses ---------------------------------------------------------------------
    def openai(self, body: dict) -> bytes:
        items = body.get("input", [])
        items = items if isinstance(items, list) else []
        done = sum(1 for i in items if isinstance(i, dict)
                   and i.get("type") in ("function_call_output", "custom_tool_call_output"))
        step = self._step(done, bool(body.get("tools")))
        rid, n = f"resp_{time.monotonic_ns()}", done
        if step[0] == "text":
            item = {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": step[1], "annotations": []}]}
        elif step[0] == "shell" or "apply_patch" not in {t.get("name") for t in body.get("tools", [])}:
            # Codex offers apply_patch only for models it knows; otherwise files are written by a shell command
            cmd = step[1] if step[0] == "shell" else f"cat > {step[1]} <<'WHALE_EOF'\n{step[2]}WHALE_EOF"
            item = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "exec_command",
                    "arguments": json.dumps({"cmd": cmd}), "status": "completed"}
        else:
            patch = "".join(f"+{line}\n" for line in step[2].splitlines())
            item = {"type": "custom_tool_call", "id": f"ctc_{n}", "call_id": f"call_{n}", "name": "apply_patch",
                    "input": f"*** Begin Patch\n*** Add File: {step[1]}\n{patch}*** End Patch\n", "status": "completed"}
        response = {"id": rid, "object": "response", "status": "in_progress", "output": [], "model": body.get("model")}
        usage = {"input_tokens": USAGE_IN, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": USAGE_OUT,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": USAGE_IN + USAGE_OUT}
        return _sse([("response.created", {"type": "response.created", "response": response}),
                     ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                                     "item": {**item, "status": "in_progress"}}),
                     ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
                     ("response.completed", {"type": "response.completed",
                                             "response": {**response, "status": "completed", "output": [item],
                                                          "usage": usage}})])
