"""The model the trainer updates when the engine loads weights from disk (`weight_sync == "from_disk"`).

A vLLM server runs in its own process (and its own venv), so the trainer cannot update the weights
it serves: it trains its own transformers copy of the same checkpoint, RSFT saves the adapter after
each step, and the server loads it (`engine.load_weights(path, version)`). The copy never serves a
rollout. It lives on `model.device` (auto: the first GPU, else the CPU) in the dtype the hf engine
would use there; one process, one device (docs/guides/gpu-vllm.md says what several GPUs do and do not do).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer

from whale.config import Config, ConfigError
from whale.engine.default_model import resolve_model_path
from whale.engine.hf import resolve_device, resolve_dtype


def training_model(cfg: Config) -> tuple[Any, Any]:
    """(model, tokenizer) for the trainer of a run whose engine serves weights from disk."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("whale run is one process: under torchrun/accelerate every rank would run the whole "
                          "experiment, start its own vLLM server and write the same run directory. Start it "
                          "with plain `whale run`; spread rollouts with model.data_parallel_size (docs/guides/gpu-vllm.md)")
    path = str(resolve_model_path(cfg.model.name))
    device = resolve_device(cfg.model.device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(cfg.model.dtype, device)).to(device)
    return model, AutoTokenizer.from_pretrained(path)
