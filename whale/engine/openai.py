"""The `openai` backend: any OpenAI-compatible /v1/chat/completions endpoint, stdlib only.

What it is for: evaluation (a hosted or remote model behind a harness) and proposers. It returns
text, never token ids (`returns_ids = False`), because re-tokenising text does not reproduce what
was sampled, so it cannot produce training rows (docs/design.md, 4.1); the `vllm` backend can.

How it maps the engine contract onto the chat API:
- sampling: `temperature`, `top_p`, `seed`, `max_tokens`, `stop`, `n`. `top_k`, prefill
  (`continue_final_message`) and `template_kwargs` (`chat_template_kwargs`) are not part of the
  OpenAI API; they are sent as extra fields, which vLLM and SGLang accept. When a server refuses
  them (HTTP 400 naming one of them, as api.openai.com does), the engine drops all extras for the
  rest of its life and retries once, so top-k is then not applied and a trailing assistant message
  is sent as is: the server answers it with a *new* message instead of continuing it.
- tools: the schemas go in `tools`; the server's `tool_calls` come back as OpenAI-style dicts.
  Servers that do not parse tool calls return the raw markup as text; it is parsed here like the
  in-process engines do (whale.engine.toolcalls).
- choices: need log-probabilities of given continuations, which chat endpoints do not offer. With
  `tokenizer_path` (a local HF tokenizer with the model's chat template) the prompt is rendered
  here and each choice is scored through the legacy /v1/completions endpoint with `echo` and
  `logprobs` (summing the log-probs of the tokens that start inside the choice text; a token that
  straddles the prompt/choice boundary is not counted). Without it, or when the server refuses,
  the call returns finish_reason "error" saying that choices need the vllm or hf backend.
- errors: a failed request never raises; it yields generations with finish_reason "error" and the
  message as text. 429 and 5xx answers and connection errors are retried twice with backoff.
- count_tokens: approximate (characters / 4 plus 4 per message); the endpoint has no tokenizer
  API in general. Budgets enforced with it are therefore approximate too.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from whale.engine.base import Generation, GenerationRequest, Recovery, SamplingParams, draw_choices
from whale.engine.toolcalls import parse_tool_calls

_EXTRA_FIELDS = ("top_k", "continue_final_message", "add_generation_prompt", "chat_template_kwargs")
_RETRY_STATUS = {429, 500, 502, 503, 504}


class HTTPFailure(Exception):
    """An HTTP request that failed: `status` (0 for no answer) and the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


def http_json(url: str, body: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None,
              timeout_s: float = 120.0, retries: int = 0) -> Any:
    """POST `body` as JSON (GET when None) and return the decoded JSON answer.

    Raises HTTPFailure with the server's own error message (OpenAI `{"error": {"message"}}`,
    FastAPI `{"detail"}`, or the raw body). 429/5xx and connection errors are retried `retries`
    times with exponential backoff. An empty 200 answer decodes to None.
    """
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, headers=hdrs, method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
            if not raw.strip():
                return None
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                return raw.decode(errors="replace")
        except urllib.error.HTTPError as e:
            failure = HTTPFailure(e.code, _error_message(e.read()))
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timeout
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            failure = HTTPFailure(0, f"cannot reach {url}: {reason}")
        if attempt < retries and (failure.status == 0 or failure.status in _RETRY_STATUS):
            time.sleep(min(8.0, 0.5 * 2**attempt))
            continue
        raise failure
    raise AssertionError("unreachable")


def _error_message(raw: bytes) -> str:
    text = raw.decode(errors="replace")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:1000] or "(empty answer)"
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:1000]
    return text[:1000]


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """A trailing assistant message is a prefill: the model continues it."""
    return bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"


def validate_request(req: GenerationRequest) -> list[str]:
    """Check the shape of one request; return its stop strings. Raises ValueError."""
    if not isinstance(req.messages, list) or not req.messages or not all(isinstance(m, dict) for m in req.messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    if not isinstance(req.n, int) or req.n < 1:
        raise ValueError(f"n must be a positive integer, got {req.n!r}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {req.stop!r}")
    if req.choices is not None and (not req.choices or not all(isinstance(c, str) and c for c in req.choices)):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    if req.max_tokens is not None and (not isinstance(req.max_tokens, int) or req.max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive integer, got {req.max_tokens!r}")
    return stop


def normalise_tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """Server tool calls as `{"id", "type": "function", "function": {"name", "arguments": str}}`."""
    out = []
    for i, c in enumerate(calls or []):
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        out.append({"id": c.get("id") or f"call_{i}", "type": "function",
                    "function": {"name": fn.get("name", ""),
                                 "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out or None


class OpenAIEngine:
    """The `Engine` protocol over an OpenAI-compatible chat endpoint (inference only, no ids)."""

    returns_ids = False
    weight_sync = "none"  # inference only: a generic endpoint cannot load our weights
    recoveries: tuple[Recovery, ...] = ()  # someone else's endpoint: failed calls are retried, not recovered

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 120.0,
                 max_concurrency: int = 16, tokenizer_path: str | None = None, max_retries: int = 2):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be the endpoint's model name")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        url = base_url.rstrip("/")
        if urllib.parse.urlparse(url).path in ("", "/"):
            url += "/v1"  # a bare host means the usual /v1 prefix
        self.base_url = url
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.weights_version = model
        self.send_extras = True  # becomes False once the server refuses a non-OpenAI field
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="whale-openai")

    # ------------------------------------------------------------------ http

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return http_json(self.base_url + path, body, headers=self._headers(), timeout_s=self.timeout_s,
                         retries=self.max_retries)

    # ------------------------------------------------------------------ generate

    def submit(self, request: GenerationRequest, sampling: SamplingParams) -> Future[list[Generation]]:
        """One HTTP request per call, sent at once from the pool (the server batches); never fails."""
        return self._pool.submit(self._one, request, sampling)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Generation]]:
        return list(self._pool.map(lambda r: self._one(r, sampling), requests))

    def _error(self, message: str, n: int = 1) -> list[Generation]:
        return [Generation(text=message, finish_reason="error", weights_version=self.weights_version)
                for _ in range(max(1, n if isinstance(n, int) else 1))]

    def _one(self, req: GenerationRequest, sampling: SamplingParams) -> list[Generation]:
        try:
            stop = validate_request(req)
            if req.choices is not None:
                return self._choose(req, sampling)
            return self._chat(req, sampling, stop)
        except HTTPFailure as e:
            return self._error(f"error: {e}", req.n)
        except Exception as e:  # one bad request fails one episode, never the batch
            return self._error(f"error: {type(e).__name__}: {e}", req.n)

    def _chat_body(self, req: GenerationRequest, sampling: SamplingParams, stop: list[str], n: int,
                   seed: int | None) -> dict[str, Any]:
        max_tokens = min(req.max_tokens or sampling.max_tokens, sampling.max_tokens_cap)
        body: dict[str, Any] = {"model": self.model, "messages": req.messages, "max_tokens": max_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p, "n": n}
        if stop:
            body["stop"] = stop
        if seed is not None:
            body["seed"] = seed
        if req.tools:
            body["tools"] = req.tools
        if self.send_extras:
            if sampling.top_k > 0:
                body["top_k"] = sampling.top_k
            if is_prefill(req.messages):
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
            if req.template_kwargs:
                body["chat_template_kwargs"] = req.template_kwargs
        return body

    def _chat(self, req: GenerationRequest, sampling: SamplingParams, stop: list[str]) -> list[Generation]:
        gens: list[Generation] = []
        for _ in range(req.n):  # servers that ignore `n` answer with fewer choices: ask again
            missing = req.n - len(gens)
            seed = None if req.seed is None else req.seed + len(gens)
            # vLLM refuses n > 1 with greedy sampling ("n must be 1 when using greedy sampling").
            ask = 1 if sampling.temperature <= 0 else missing
            resp = self._chat_request(req, sampling, stop, ask, seed)
            choices = resp.get("choices") or []
            if not choices:
                raise ValueError(f"the server answered without choices: {str(resp)[:300]}")
            usage = resp.get("usage") or {}
            for c in choices[:missing]:
                gens.append(self._generation(c, req, usage, len(choices)))
            if len(gens) >= req.n:
                break
        return gens

    def _chat_request(self, req, sampling, stop, n, seed) -> dict[str, Any]:
        try:
            return self._post("/chat/completions", self._chat_body(req, sampling, stop, n, seed))
        except HTTPFailure as e:
            if self.send_extras and e.status in (400, 422) and any(f in e.message for f in _EXTRA_FIELDS):
                self.send_extras = False  # the server is strict OpenAI: stop sending vLLM-style extras
                return self._post("/chat/completions", self._chat_body(req, sampling, stop, n, seed))
            raise

    def _generation(self, choice: dict[str, Any], req: GenerationRequest, usage: dict[str, Any],
                    n_choices: int) -> Generation:
        message = choice.get("message") or {}
        text = message.get("content") or ""
        tool_calls = normalise_tool_calls(message.get("tool_calls"))
        if tool_calls is None and req.tools:
            tool_calls = parse_tool_calls(text)
        reason = choice.get("finish_reason")
        finish = "length" if reason == "length" else "stop"  # stop, tool_calls, content_filter, ...
        completion_tokens = int(usage.get("completion_tokens") or 0) // max(1, n_choices)
        return Generation(text=text, finish_reason=finish, weights_version=self.weights_version,
                          tool_calls=tool_calls, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          completion_tokens=completion_tokens)

    # ------------------------------------------------------------------ choices

    def _choose(self, req: GenerationRequest, sampling: SamplingParams) -> list[Generation]:
        if self.tokenizer_path is None:
            return self._error(
                "error: choices need per-token log-probabilities, which a chat endpoint does not give; "
                "use the vllm or hf backend, or give the openai backend tokenizer_path so that it can "
                "score choices through /v1/completions (echo + logprobs)", req.n)
        prompt = self._render(req)
        logps = []
        for choice in req.choices or []:
            body = {"model": self.model, "prompt": prompt + choice, "max_tokens": 0, "echo": True,
                    "logprobs": 0, "temperature": 0}
            try:
                resp = self._post("/completions", body)
                lp = (resp["choices"][0].get("logprobs") or {})
                offsets, values = lp["text_offset"], lp["token_logprobs"]
            except (HTTPFailure, KeyError, IndexError, TypeError) as e:
                return self._error(f"error: this server cannot score choices through /v1/completions with "
                                   f"echo + logprobs ({e}); use the vllm or hf backend for choices", req.n)
            logps.append(sum(v for off, v in zip(offsets, values) if off >= len(prompt) and v is not None))
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        picks = draw_choices(logps, [seed + i for i in range(req.n)], sampling.temperature)
        return [Generation(text=req.choices[i], finish_reason="choice", weights_version=self.weights_version,
                           prompt_tokens=self.count_tokens(req.messages)) for i in picks]

    def _render(self, req: GenerationRequest) -> str:
        """The prompt text as the model sees it, from the local tokenizer's chat template."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # lazy: heavy, and only a local tokenizer_path needs it

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        prefill = is_prefill(req.messages)
        return self._tokenizer.apply_chat_template(req.messages, tools=req.tools, tokenize=False,
                                                   add_generation_prompt=not prefill, continue_final_message=prefill,
                                                   **(req.template_kwargs or {}))

    # ------------------------------------------------------------------ the rest of the protocol

    def lockstep(self, clients: int, hold_s: float = 1.0) -> None:
        """No deterministic batching: a remote endpoint batches as it likes."""
        return None

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Approximate: 1 token per 4 characters of content (and tool calls), plus 4 per message."""
        chars = 0
        for m in messages:
            chars += len(str(m.get("content") or ""))
            if m.get("tool_calls"):
                chars += len(json.dumps(m["tool_calls"]))
        return chars // 4 + 4 * len(messages)

    def load_weights(self, path: str | None, version: str) -> None:
        """Only a version tag change (path None) is possible: the endpoint's weights are not ours."""
        if path is not None:
            raise ValueError(f"the openai backend is inference only and cannot load weights from {path}; "
                             "use the vllm backend (runtime LoRA loading) or the hf backend to serve trained weights")
        self.weights_version = version

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
