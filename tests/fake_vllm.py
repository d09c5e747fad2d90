"""A stand-in for a vLLM server, speaking the endpoints the vllm backend uses (tests only).

In process (`FakeVLLM()`), or as the server process WHALE starts: tests/fixtures/fake_vllm_pkg has
a `vllm.entrypoints.openai.api_server` module that runs `main()` here, so a `VLLMEngine` with
`python=sys.executable` and that folder on PYTHONPATH starts, kills and restarts real processes.
A process writes what it was started with and every request to $FAKE_VLLM_LOG (JSON lines).

Answers like vLLM: a character is a token (id = code point), EOS is 2, max_model_len 64. The text
of a sample is its seed's letter, once or twice (seed parity), so a length-parity grader accepts
about half. Log-probs are made up but fixed: log p(token t) = -t / 100, whatever the context.
A prompt containing "SLOW" is answered only once `release` is set (submit-dispatch tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeVLLM:
    def __init__(self, port: int = 0, log_path: str | None = None):
        self.calls: list[tuple[str, dict]] = []
        self.adapters: list[str] = []
        self.release = threading.Event()
        self.log_path = log_path
        self._log_lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.record(self.path, {})
                if self.path == "/health":
                    return self._send(200, {})
                models = [{"id": "base-model", "parent": None, "max_model_len": 64}]
                models += [{"id": n, "parent": "base-model"} for n in fake.adapters]
                self._send(200, {"data": models})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.record(self.path, body)
                self._send(*fake.answer(self.path, body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def serve_in_thread(self) -> "FakeVLLM":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def record(self, path: str, body: dict) -> None:
        self.calls.append((path, body))
        if self.log_path:
            with self._log_lock, open(self.log_path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "path": path, "body": body}) + "\n")

    def answer(self, path, body):
        if path == "/tokenize":
            if "messages" in body:
                text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
                text += "" if body["continue_final_message"] else "<assistant>"
            else:
                text = body["prompt"]
            return 200, {"tokens": [ord(c) for c in text], "count": len(text)}
        if path == "/v1/completions":
            model = body.get("model")
            if model != "base-model" and model not in self.adapters:
                return 404, {"error": {"message": f"The model `{model}` does not exist."}}
            prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
            if any("SLOW" in "".join(chr(t) for t in p) for p in prompts):
                self.release.wait(timeout=30)
            choices = []
            for i, prompt in enumerate(prompts):
                if "logprob_token_ids" in body:
                    top = {f"token_id:{t}": -t / 100 for t in body["logprob_token_ids"]}
                    choices.append({"index": i, "text": "", "finish_reason": "length",
                                    "logprobs": {"top_logprobs": [top]}})
                else:
                    text = chr(ord("a") + body["seed"] % 26) * (1 + body["seed"] % 2)
                    ids = [ord(c) for c in text] + [2]
                    choices.append({"index": i, "text": text, "finish_reason": "stop", "token_ids": ids})
            return 200, {"choices": choices}
        if path == "/v1/load_lora_adapter":
            self.adapters.append(body["lora_name"])
            return 200, {}
        if path == "/v1/unload_lora_adapter":
            self.adapters.remove(body["lora_name"])
            return 200, {}
        if path == "/collective_rpc" and "broken" in body["kwargs"]["weights_path"]:
            return 500, {"error": {"message": "reload_weights failed: no safetensors"}}
        if path.split("?")[0] in ("/collective_rpc", "/reset_prefix_cache", "/pause", "/resume", "/sleep", "/wake_up"):
            return 200, {"success": True}
        return 404, {"detail": "Not Found"}

    def posted(self, path):
        return [b for p, b in self.calls if p == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def read_log(path) -> list[dict]:
    """The records of every fake server process that wrote to `path`, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    """`python -m vllm.entrypoints.openai.api_server --model M --port P ...` as a fake server process."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    log_path = os.environ.get("FAKE_VLLM_LOG")
    fake = FakeVLLM(args.port, log_path)
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k == "CUDA_VISIBLE_DEVICES"}
    fake.record("start", {"argv": sys.argv[1:], "env": env})
    fake.httpd.serve_forever()
