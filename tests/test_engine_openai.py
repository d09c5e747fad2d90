"""The openai backend against a tiny OpenAI-format server run here (stdlib http.server on 127.0.0.1).

The server records every request body, so the tests check what goes on the wire as well as how
answers (n choices, tool calls, errors, a strict server that refuses vLLM extras) come back.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from whale.engine.base import Engine, GenerationRequest, SamplingParams
from whale.engine.openai import OpenAIEngine

SAMPLING = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=32, max_tokens_cap=64)


class FakeServer:
    """An OpenAI-format chat server whose answers the test scripts through `mode`."""

    def __init__(self):
        self.requests: list[tuple[str, dict, dict]] = []  # (path, body, headers)
        self.mode = "echo"
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, body, dict(self.headers)))
                status, answer = fake.answer(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        if self.mode == "error":
            return 400, {"error": {"message": "This model's maximum context length is 8 tokens", "code": 400}}
        if self.mode == "strict" and any(k in body for k in ("top_k", "continue_final_message")):
            bad = "top_k" if "top_k" in body else "continue_final_message"
            return 400, {"error": {"message": f"Unrecognized request argument supplied: {bad}"}}
        if path == "/v1/completions":  # echo scoring: one "token" per character, log p = -1 each
            prompt = body["prompt"]
            return 200, {"choices": [{"text": prompt, "logprobs": {
                "text_offset": list(range(len(prompt))), "tokens": list(prompt),
                "token_logprobs": [None] + [-1.0] * (len(prompt) - 1)}}]}
        last = body["messages"][-1]["content"]
        n = 1 if self.mode == "ignore_n" else body.get("n", 1)
        choices = []
        for i in range(n):
            message: dict = {"role": "assistant", "content": f"reply {i} to {last}"}
            finish = "stop"
            if self.mode == "tools" and body.get("tools"):
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_x", "type": "function",
                     "function": {"name": "search", "arguments": json.dumps({"query": "paris"})}}]}
                finish = "tool_calls"
            elif self.mode == "length":
                finish = "length"
            choices.append({"index": i, "message": message, "finish_reason": finish})
        return 200, {"choices": choices, "usage": {"prompt_tokens": 11, "completion_tokens": 5 * n}}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def _engine(server, **kwargs) -> OpenAIEngine:
    return OpenAIEngine(server.url, "test-model", api_key_env="WHALE_TEST_KEY", timeout_s=10, **kwargs)


def test_request_shape_and_result(server, monkeypatch):
    monkeypatch.setenv("WHALE_TEST_KEY", "sk-test")
    eng = _engine(server)
    assert isinstance(eng, Engine) and eng.returns_ids is False and eng.base_url.endswith("/v1")
    msgs = [{"role": "user", "content": "hi"}]
    out = eng.generate([GenerationRequest(msgs, max_tokens=500, stop=["\n"], seed=7)], SAMPLING)
    path, body, headers = server.requests[-1]
    assert path == "/v1/chat/completions"
    assert body["model"] == "test-model" and body["messages"] == msgs
    assert body["max_tokens"] == 64  # clamped to max_tokens_cap
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["top_k"] == 20
    assert body["stop"] == ["\n"] and body["seed"] == 7 and body["n"] == 1
    assert "continue_final_message" not in body and "tools" not in body
    assert headers["Authorization"] == "Bearer sk-test"
    [[g]] = out
    assert g.text == "reply 0 to hi" and g.finish_reason == "stop"
    assert g.prompt_ids == [] and g.completion_ids == [] and g.weights_version == "test-model"
    assert g.prompt_tokens == 11 and g.completion_tokens == 5


def test_n_samples_and_server_that_ignores_n(server):
    eng = _engine(server)
    req = GenerationRequest([{"role": "user", "content": "q"}], n=3, seed=100)
    [gens] = eng.generate([req], SAMPLING)
    assert [g.text for g in gens] == ["reply 0 to q", "reply 1 to q", "reply 2 to q"]
    assert len(server.requests) == 1 and server.requests[0][1]["n"] == 3
    server.mode = "ignore_n"
    [gens] = eng.generate([req], SAMPLING)
    assert len(gens) == 3 and len(server.requests) == 4  # asked again for the missing samples
    assert [b["seed"] for _, b, _ in server.requests[1:]] == [100, 101, 102]  # sample i uses seed + i
    server.mode = "echo"
    [gens] = eng.generate([req], SamplingParams(temperature=0.0))
    assert len(gens) == 3 and [b["n"] for _, b, _ in server.requests[4:]] == [1, 1, 1]  # vLLM: greedy needs n=1


def test_prefill_template_kwargs_and_finish_length(server):
    server.mode = "length"
    eng = _engine(server)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<answer>"}]
    [[g]] = eng.generate([GenerationRequest(msgs, template_kwargs={"enable_thinking": False})], SAMPLING)
    body = server.requests[-1][1]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert g.finish_reason == "length"


def test_tool_calls(server):
    server.mode = "tools"
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    [[g]] = _engine(server).generate([GenerationRequest([{"role": "user", "content": "q"}], tools=tools)], SAMPLING)
    assert server.requests[-1][1]["tools"] == tools
    assert g.finish_reason == "stop" and g.text == ""
    assert g.tool_calls == [{"id": "call_x", "type": "function",
                             "function": {"name": "search", "arguments": '{"query": "paris"}'}}]


def test_errors_become_error_generations(server):
    eng = _engine(server)
    server.mode = "error"
    good = GenerationRequest([{"role": "user", "content": "q"}], n=2)
    bad_shape = GenerationRequest([], n=1)
    out = eng.generate([good, bad_shape], SAMPLING)
    assert [g.finish_reason for g in out[0]] == ["error", "error"]
    assert "maximum context length" in out[0][0].text
    assert out[1][0].finish_reason == "error" and "messages" in out[1][0].text
    dead = OpenAIEngine("http://127.0.0.1:9", "m", timeout_s=2, max_retries=0)  # nothing listens there
    [[g]] = dead.generate([GenerationRequest([{"role": "user", "content": "q"}])], SAMPLING)
    assert g.finish_reason == "error" and "cannot reach" in g.text


def test_strict_server_drops_extras_once(server):
    server.mode = "strict"
    eng = _engine(server)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A:"}]
    [[g]] = eng.generate([GenerationRequest(msgs)], SAMPLING)
    assert g.finish_reason == "stop" and eng.send_extras is False
    assert "top_k" in server.requests[0][1] and "top_k" not in server.requests[1][1]
    assert "continue_final_message" not in server.requests[1][1]  # prefill sent as is


def test_choices_need_scoring_support(server, tiny_model_dir):
    req = GenerationRequest([{"role": "user", "content": "pick"}], choices=["a", "bbbb"], n=2, seed=3)
    [gens] = _engine(server).generate([req], SAMPLING)
    assert [g.finish_reason for g in gens] == ["error", "error"] and "vllm or hf backend" in gens[0].text
    assert server.requests == []  # nothing was sent
    # With a local tokenizer the prompt is rendered here and scored by echo + logprobs: each
    # character costs -1, so at T=0 the shorter choice wins.
    eng = _engine(server, tokenizer_path=str(tiny_model_dir))
    [gens] = eng.generate([req], SamplingParams(temperature=0.0))
    assert [g.text for g in gens] == ["a", "a"] and gens[0].finish_reason == "choice"
    bodies = [b for p, b, _ in server.requests if p == "/v1/completions"]
    assert len(bodies) == 2 and bodies[0]["echo"] is True and bodies[0]["prompt"].endswith("<|im_start|>assistant\na")
    [gens] = eng.generate([GenerationRequest(req.messages, choices=["a", "bbbb"], n=16, seed=0)],
                          SamplingParams(temperature=5.0))
    assert {g.text for g in gens} == {"a", "bbbb"}  # softmax(logp / T) with a high T draws both


def test_count_tokens_and_load_weights(server):
    eng = _engine(server)
    assert eng.count_tokens([{"role": "user", "content": "x" * 40}]) == 14  # 40 / 4 + 4
    eng.load_weights(None, "v3")
    assert eng.weights_version == "v3"
    with pytest.raises(ValueError, match="inference only"):
        eng.load_weights("/tmp/adapter", "v4")
    with pytest.raises(ValueError, match="http"):
        OpenAIEngine("localhost:8000", "m")
    eng.close()
