"""Model serving behind one `Engine` protocol: hf (in-process), vllm (server), openai (any endpoint), null.

`make_engine(cfg)` is the one entry point, so training, search and evaluation get the same engine.
Each backend's module is imported when it is chosen: hf and vllm load torch, openai the HTTP stack,
and the command line imports this package before any of them is needed.
"""

from __future__ import annotations

from whale.config import Config, ConfigError
from whale.engine.base import Engine, Generation, GenerationRequest, SamplingParams
from whale.engine.default_model import resolve_model_path
from whale.engine.null import NullEngine

__all__ = ["Engine", "Generation", "GenerationRequest", "SamplingParams", "make_engine"]


def make_engine(cfg: Config) -> Engine:
    m = cfg.model
    if m.backend == "hf":
        path = resolve_model_path(m.name)  # a model that cannot load says so before torch is imported
        from whale.engine.hf import HFEngine  # lazy: torch, transformers, peft

        return HFEngine(path, dtype=m.dtype, device=m.device,
                        max_batch_size=m.max_batch_size, max_model_len=m.max_model_len,
                        kv_cache_bytes=m.kv_cache_mib << 20, prefix_cache_bytes=m.prefix_cache_mib << 20,
                        cpu_threads=m.cpu_threads, prefill_threads=m.prefill_threads)
    if m.backend == "vllm":
        from whale.engine.hf import resolve_device  # lazy: torch
        from whale.engine.vllm import VLLMEngine  # lazy: torch

        if m.colocate and resolve_device(m.device).type != "cuda":
            raise ConfigError("model.colocate needs a CUDA GPU for the trainer and the vLLM server (sleep mode is "
                              "not supported on CPU); set model.colocate false")
        if m.colocate and cfg.compute.train_ranks > 1:
            raise ConfigError("model.colocate is the one-GPU mode: use compute.train_ranks 1 with it, or give the "
                              "server its own GPUs (docs/guides/scale-out.md)")

        return VLLMEngine(str(resolve_model_path(m.name)), base_url=m.base_url, extra_args=m.vllm_args,
                          lora_rank=cfg.weight.lora.r, max_model_len=m.max_model_len, dtype=m.dtype,
                          data_parallel_size=m.data_parallel_size, gpu_memory_utilization=m.gpu_memory_utilization,
                          env=m.vllm_env, max_concurrency=m.max_batch_size, max_restarts=m.vllm_max_restarts,
                          full_sync=m.vllm_full_sync, colocate=m.colocate)
    if m.backend == "openai":
        from whale.engine.openai import OpenAIEngine  # lazy: the HTTP stack (ssl, http), ~30 ms

        if not m.base_url:
            raise ConfigError("model.backend 'openai' needs model.base_url")
        return OpenAIEngine(m.base_url, m.name, api_key_env=m.api_key_env)
    if m.backend == "null":
        return NullEngine(seed=cfg.seed)
    raise ConfigError(f"unknown model.backend {m.backend!r}")
