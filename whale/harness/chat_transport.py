"""How the chat proposer reaches its model: HTTP, record/replay, and retries around either.

A transport is a function from an OpenAI-style /chat/completions request to its JSON response.
`HTTPTransport` is the real one (stdlib only). `ReplayTransport` answers from a JSON file of
recorded exchanges keyed by the request's hash and fails on anything unseen, so proposer tests
are deterministic and offline (GEPA's pattern). `RetryingTransport` retries what is worth
retrying — a dropped connection, a timeout, HTTP 408/429/5xx — with exponential backoff
(honouring Retry-After), and lets everything else (a 400, a 401, a replay miss) through at once.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Callable, Protocol

TRANSIENT_ERRORS = (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException)


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
        self.cache[key] = {"request": json.loads(json.dumps(request)), "response": response}  # a snapshot, not an alias
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.cache, indent=1, sort_keys=True) + "\n")
        return response


def is_transient(error: BaseException) -> bool:
    """Worth another try: no answer at all, a timeout, or HTTP 408 / 429 / 5xx."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code in (408, 429) or error.code >= 500
    return isinstance(error, TRANSIENT_ERRORS)


def retry_after_s(error: BaseException) -> float | None:
    """The server's Retry-After (seconds or an HTTP date), when it sent one."""
    if not isinstance(error, urllib.error.HTTPError) or error.headers is None:
        return None
    value = error.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def describe(error: BaseException) -> str:
    """One line for last_error; an HTTP error carries the start of its body (the server's reason)."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, urllib.error.HTTPError):
        try:
            body = error.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            body = ""
        if body:
            text += f" ({' '.join(body.split())[:300]})"
    return text


class RetryingTransport:
    """`inner` with up to `retries` more attempts on transient errors, waiting
    backoff_s * 2**attempt (capped at max_backoff_s, or the server's Retry-After if longer)."""

    def __init__(self, inner: Transport, retries: int = 4, backoff_s: float = 2.0, max_backoff_s: float = 60.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.inner = inner
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.sleep = sleep
        self.retried = 0  # retries over this object's life (usage reporting)
        self.errors: list[str] = []  # what was retried, for the transcript

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                return self.inner(request)
            except TRANSIENT_ERRORS as e:
                if not is_transient(e) or attempt >= self.retries:
                    raise
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
                delay = max(delay, min(self.max_backoff_s, retry_after_s(e) or 0.0))
                attempt += 1
                self.retried += 1
                self.errors.append(f"attempt {attempt}: {describe(e)}; retrying in {delay:g} s")
                self.sleep(delay)
