"""Model serving behind one `Engine` protocol: hf (in-process), vllm (server), openai (any endpoint), null.

`make_engine(cfg)` is the one entry point, so training, search and evaluation get the same engine.
"""

from __future__ import annotations

from whale.config import Config, ConfigError
from whale.engine.base import Engine, Generation, GenerationRequest, SamplingParams

__all__ = ["Engine", "Generation", "GenerationRequest", "SamplingParams", "make_engine"]


def make_engine(cfg: Config) -> Engine:
    m = cfg.model
    if m.backend == "hf":
        from whale.engine.default_model import resolve_model_path

        path = resolve_model_path(m.name)  # a model that cannot load says so before torch is imported
        from whale.engine.hf import HFEngine

        return HFEngine(path, dtype=m.dtype, device=m.device,
                        max_batch_size=m.max_batch_size, max_model_len=m.max_model_len,
                        cpu_threads=m.cpu_threads)
    if m.backend == "vllm":
        from whale.engine.default_model import resolve_model_path
        from whale.engine.vllm import VLLMEngine

        return VLLMEngine(str(resolve_model_path(m.name)), base_url=m.base_url, extra_args=m.vllm_args,
                          lora_rank=cfg.weight.lora.r, max_model_len=m.max_model_len, dtype=m.dtype,
                          data_parallel_size=m.data_parallel_size, gpu_memory_utilization=m.gpu_memory_utilization,
                          env=m.vllm_env, max_concurrency=m.max_batch_size, max_restarts=m.vllm_max_restarts)
    if m.backend == "openai":
        from whale.engine.openai import OpenAIEngine

        if not m.base_url:
            raise ConfigError("model.backend 'openai' needs model.base_url")
        return OpenAIEngine(m.base_url, m.name, api_key_env=m.api_key_env)
    if m.backend == "null":
        from whale.engine.null import NullEngine

        return NullEngine(seed=cfg.seed)
    raise ConfigError(f"unknown model.backend {m.backend!r}")
