"""In-process transformers engine (CPU or one GPU) with continuous batching and prefix sharing.

Why not `model.generate`: WHALE needs every sampled row to be reproducible on its own. Each
sequence draws its random numbers from a private `torch.Generator` seeded from its request, so a
sample does not depend on which other calls happened to share its batch or on when it joined (the
same guarantee as vLLM's per-request seed), and the engine returns the exact prompt and completion
ids for training rows.

`submit` validates and tokenizes a request in the caller's thread and hands it to the scheduler
(whale/engine/scheduler.py), the one thread that runs the model: sequences join the running
decode batch as soon as a row frees and leave when done, prompts that share a prefix with a live
row or with a recent sequence (the k samples of a problem, an episode's next call) copy its KV
instead of recomputing it (whale/engine/kv.py), and `choices` of many requests are scored in one
forward. `engine.stats` counts prefill tokens requested vs computed, decode steps and seconds.

`choices` are scored at sequence level (docs/design.md, 4.1): every choice's canonical ids after the shared
prompt, a choice drawn from softmax(log p(choice | prompt) / T). Token-by-token masking would
distort that distribution.

Weights: `load_weights` and `serve_model` wait until the live sequences have finished (so each
sequence is sampled from one set of weights under one version tag), apply the change while the
scheduler is held idle, and clear the prefix cache.
"""

from __future__ import annotations

import inspect
import os
import platform
import secrets
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from peft import PeftConfig, PeftModel
from peft.utils import load_peft_weights, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from whale.engine.adapted import AdaptedLinears
from whale.engine.base import (Generation, GenerationRequest, Recovery, SamplingParams, error_generations, wait_all,
                               weights_kind)
from whale.engine.default_model import resolve_model_path
from whale.engine.jobs import Job, Seq
from whale.engine.lockstep import Lockstep
from whale.engine.packed import PackedLinears
from whale.engine.packed import available as packs_available
from whale.engine.scheduler import Scheduler
from whale.engine.toolcalls import parse_tool_calls
from whale.errors import EngineStartError
from whale.sysmem import bound_kernel_caches, release_free_memory

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if resolved.type == "cuda" and (resolved.index or 0) >= gpus:
        raise EngineStartError(f"model.device {device}: no such CUDA device here ({gpus} visible; see "
                               "CUDA_VISIBLE_DEVICES and the driver); set model.device to cpu or auto")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """bf16 wherever it is fast (CUDA with bf16, CPUs with AVX512-bf16/AMX), else fp16/fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AVX512-BF16 or AMX on x86, oneDNN's bf16 ISA check
    elsewhere (Arm's BF16 extension).

    Why not oneDNN's check alone on x86: it also says yes on plain AVX-512 (it emulates bf16 there),
    and on such a CPU (an Intel Xeon with AVX-512 but no AVX512-BF16, 2026-12-04) a bf16 GEMM of the
    default model's shapes ran about 3x slower than float32 (benchmarks/prepacked_linear.py), so
    `dtype: auto` made every rollout slower. `model.dtype: bfloat16` still forces it."""
    try:
        if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def usable_cores() -> int:
    """CPUs this process may run on (a container's affinity, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def engine_cpu_threads(requested: int | None) -> int:
    """Intra-op threads for the engine's decode steps on CPU: `requested` (`model.cpu_threads`), else
    OMP_NUM_THREADS when the user set it, else the usable cores but one, and at least one.

    Why not every core: the runner's threads (event loop, RPC, templating, tool calls), the
    sandboxed harnesses and the graders run beside the engine. On 2 cores, two OpenMP threads in
    the engine wait on the core those hold, and `whale demo` took 5:38-6:14 against 4:10-4:57 with
    one (docs/performance.md)."""
    return _threads("cpu_threads", requested, usable_cores() - 1)


def engine_prefill_threads(requested: int | None) -> int:
    """Intra-op threads for the engine's prefill and choice-scoring forwards on CPU: `requested`
    (`model.prefill_threads`), else OMP_NUM_THREADS when the user set it, else every usable core.

    Why more than decode's: a prefill forward is GEMMs over hundreds of tokens, which split across
    cores (a 128 x 576 x 1536 float32 GEMM ran 1.9x faster on 2 threads), and the runner has
    little to do while it waits for the prompts it sent. A decode step's GEMMs of a few dozen
    rows do not split well, and there the runner's core is worth more (engine_cpu_threads). On the
    demo's first test evaluation (2-core AMD EPYC, float32) this took the wall from ~99 to ~82 s
    (docs/performance.md)."""
    return _threads("prefill_threads", requested, usable_cores())


def _threads(key: str, requested: int | None, default: int) -> int:
    """`requested` (the config's `model.<key>`), else OMP_NUM_THREADS when the user set it, else
    `default`; at least one."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"{key} must be >= 1, got {requested}")
        return requested
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, default)


class HFEngine:
    """The `Engine` protocol on a transformers causal LM (optionally with a PEFT adapter).

    `max_batch_size` caps the live decode rows; `kv_cache_bytes` bounds their KV storage (rows join
    while rows x longest row fit; None: no bound but the rows; engine/kv.py); `prefix_cache_bytes`
    bounds the KV kept from finished sequences for reuse (0 turns that cache off; rows in flight
    are always shared).
    Full-attention decoder models only (Llama, Qwen2/3, SmolLM, ...): the scheduler builds the
    attention mask itself, which a sliding-window layer would not respect.
    """

    returns_ids = True
    weight_sync = "in_place"  # the trainer updates self.model; see engine.base.WeightSync
    recoveries: tuple[Recovery, ...] = ()  # in process: no server that could die and come back

    def __init__(
        self,
        name_or_path: str,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_batch_size: int = 64,
        max_model_len: int = 4096,
        prefix_cache_bytes: int = 1 << 30,
        kv_cache_bytes: int | None = None,
        cpu_threads: int | None = None,
        prefill_threads: int | None = None,
    ):
        if max_batch_size < 1 or max_model_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_model_len >= 2 "
                             f"(got {max_batch_size}, {max_model_len})")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.weights_version = "base"
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # torch defaults to the machine's cores; in a container limited to fewer, oversubscription
            # hurts. This is the process's count (training's); the engine thread sets its own below.
            usable = usable_cores()
            if torch.get_num_threads() > usable:
                torch.set_num_threads(usable)
        if self.device.type == "cpu":
            bound_kernel_caches()  # unless a GEMM ran before in this process (sysmem.py; the CLI sets it first)
        # the engine thread's intra-op threads (decode; prefill), read at every step (OpenMP's count is per thread)
        self.cpu_threads = engine_cpu_threads(cpu_threads) if self.device.type == "cpu" else None
        self.prefill_threads = engine_prefill_threads(prefill_threads) if self.device.type == "cpu" else None
        self.path = resolve_model_path(name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).to(self.device).eval()
        _check_full_attention(self.model.config)
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.eos_ids = self._eos_ids()
        self.cache_kwarg = self._cache_kwarg()
        # CPU, bfloat16: Linear layers of decode-sized batches on weights packed once (engine/packed.py)
        self.packed_linears = (PackedLinears() if self.device.type == "cpu" and self.dtype == torch.bfloat16
                               and packs_available() else None)
        # CPU: a LoRA layer's update inside its base layer's GEMM, on joined weights (engine/adapted.py)
        self.adapted_linears = (AdaptedLinears(self.dtype, self.packed_linears)
                                if self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) else None)
        self._adapter_count = 0  # names of adapters loaded beside another one
        # the fast tokenizer is one Rust object shared by callers' threads and the engine thread
        self._tok_lock = threading.Lock()
        self.kv_token_bytes = _kv_token_bytes(self.model.config, self.dtype)
        self.scheduler = Scheduler(self, prefix_cache_bytes, kv_cache_bytes)

    @property
    def stats(self) -> dict[str, float]:
        """Counters since start: prefill tokens requested / computed / padded, decode steps, seconds."""
        return self.scheduler.stats

    def memory_bytes(self) -> dict[str, int]:
        """What the engine holds besides the model's own weights, in bytes: the KV slab's storage (the
        idle slab's kept buffers included), the prefix cache, the bf16 packs and the joined LoRA
        weights (engine/kv.py, packed.py, adapted.py); and the model's parameters."""
        sched = self.scheduler
        return {"model": sum(p.numel() * p.element_size() for p in self.model.parameters()),
                "kv_slab": sched.slab.storage_bytes, "prefix_cache": sched.prefix.bytes,
                "packs": self.packed_linears.nbytes if self.packed_linears is not None else 0,
                "joined_lora": self.adapted_linears.nbytes if self.adapted_linears is not None else 0}

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for value in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if not ids:
            raise ValueError(f"model {self.path} defines no EOS token (tokenizer or generation_config)")
        return ids

    # ------------------------------------------------------------------ prompts

    def _prompt_ids(self, messages: list[dict[str, Any]], tools=None, template_kwargs=None) -> list[int]:
        """Chat template applied; a final assistant message is continued (prefill), not closed."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        prefill = messages[-1].get("role") == "assistant"
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
            tokenize=False,
            **(template_kwargs or {}),
        )
        with self._tok_lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode(self, text: str) -> list[int]:
        with self._tok_lock:
            return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False)

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        return len(self._prompt_ids(messages))

    # ------------------------------------------------------------------ submit / generate

    def submit(self, request: GenerationRequest, sampling: SamplingParams) -> Future[list[Generation]]:
        """Queue one request (any thread, returns at once); a bad request resolves to an error generation."""
        future: Future[list[Generation]] = Future()
        try:
            job = self.make_job(request, sampling, future)
        except Exception as exc:  # one bad request fails one episode, never its batch-mates
            future.set_result([self._error(f"error: {exc}")])
            return future
        self.scheduler.enqueue([job])
        return future

    def lockstep(self, clients: int, hold_s: float = 1.0) -> Lockstep:
        """Schedule the calls of `clients` episode slots in lockstep (engine/lockstep.py): the batches,
        and so the samples, follow from the episodes alone, whatever the timing."""
        return Lockstep(self.scheduler, self.make_job, clients, hold_s)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Generation]]:
        """Submit all, wait all (enqueued together, so the first prefill sees every request)."""
        futures, jobs = [], []
        for req in requests:
            future: Future[list[Generation]] = Future()
            futures.append(future)
            try:
                jobs.append(self.make_job(req, sampling, future))
            except Exception as exc:
                future.set_result([self._error(f"error: {exc}")])
        self.scheduler.enqueue(jobs)
        return wait_all(futures)

    def make_job(self, req: GenerationRequest, sampling: SamplingParams, future: Future) -> Job:
        """Validate one request and turn it into a scheduler job (raises ValueError on bad input)."""
        if not isinstance(req.n, int) or req.n < 1:
            raise ValueError(f"n must be a positive integer, got {req.n!r}")
        stop = req.stop or []
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {req.stop!r}")
        if req.choices is not None:
            if not req.choices or not all(isinstance(c, str) and c for c in req.choices):
                raise ValueError("choices must be a non-empty list of non-empty strings")
        prompt = self._prompt_ids(req.messages, req.tools, req.template_kwargs)
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt too long ({len(prompt)} tokens)")
        seed = int(req.seed if req.seed is not None else secrets.randbits(62))
        seeds = [seed + i for i in range(req.n)]
        if req.choices is not None:
            return self._choice_job(prompt, list(req.choices), future, sampling, req, seeds)
        max_new = req.max_tokens if req.max_tokens is not None else sampling.max_tokens
        if not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_new!r}")
        max_new = min(max_new, sampling.max_tokens_cap, self.max_model_len - len(prompt))
        return Job(future, "sample", prompt, sampling, req, seeds, max_new, stop)

    def _choice_job(self, prompt: list[int], choices: list[str], future: Future, sampling: SamplingParams,
                    req: GenerationRequest | None, seeds: list[int]) -> Job:
        encoded = [self._encode(c) for c in choices]
        if not all(encoded):
            raise ValueError("every choice must encode to at least one token")
        longest = max(len(e) for e in encoded)
        if len(prompt) + longest > self.max_model_len:
            raise ValueError(f"prompt too long ({len(prompt)} tokens + {longest} for the longest choice)")
        job = Job(future, "choice" if req is not None else "score", prompt, sampling, req, seeds)
        job.choice_ids = encoded
        return job

    def _error(self, text: str) -> Generation:
        return error_generations(text, self.weights_version)[0]

    def _generation(self, text, finish, prompt, ids, req) -> Generation:
        return Generation(
            text=text,
            finish_reason=finish,
            prompt_ids=list(prompt),
            completion_ids=list(ids),
            weights_version=self.weights_version,
            tool_calls=parse_tool_calls(text) if req.tools else None,
            prompt_tokens=len(prompt),
            completion_tokens=len(ids),
        )

    def finish_generation(self, s: Seq) -> Generation:
        """Text of a finished sequence: without a final EOS, cut before the first stop string."""
        body = s.ids[:-1] if s.ids and s.ids[-1] in self.eos_ids and s.finish == "stop" else s.ids
        text = self._decode(body)
        cuts = [text.find(x) for x in s.job.stop if x in text]
        if cuts:
            text = text[: min(cuts)]
        return self._generation(text, s.finish, s.prompt, s.ids, s.job.request)

    def choice_generation(self, job: Job, pick: int) -> Generation:
        choice = job.request.choices[pick]
        return self._generation(choice, "choice", job.prompt, job.choice_ids[pick], job.request)

    def hit_stop(self, ids: list[int], stop: list[str], window: int) -> bool:
        """Did the last token complete a stop string? Decoding a short tail keeps this O(1) per step."""
        tail = self._decode(ids[-window:])
        return any(x in tail for x in stop)

    def _cache_kwarg(self) -> str:
        """The forward argument that takes the KV cache: `cache` in recent transformers, else the old name.

        Read from the transformers model itself: a peft wrapper passes it through as **kwargs."""
        base = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    # ------------------------------------------------------------------ choices

    def choice_logprobs(self, prompt_ids: list[int], choices: list[str]) -> torch.Tensor:
        """log p(choice | prompt) summed over each choice's canonical ids (scored by the scheduler)."""
        future: Future = Future()
        job = self._choice_job(list(prompt_ids), list(choices), future, SamplingParams(), None, [])
        self.scheduler.enqueue([job])
        [result] = future.result()
        if isinstance(result, Generation):
            raise RuntimeError(result.text)
        return result

    # ------------------------------------------------------------------ weights

    def load_weights(self, path: str | None, version: str) -> None:
        """Serve new weights under the tag `version`.

        None: the model was trained in place, only the tag changes. A PEFT adapter folder
        (adapter_config.json) replaces the current adapter; a full model folder (config.json)
        replaces the weights. Both copy into the existing parameters when the shapes match, so a
        trainer holding this model (and its optimizer) keeps working on the same tensors.
        """
        with self.scheduler.paused():  # live sequences finish on the old weights, under the old tag
            if path is not None:
                folder = Path(path)
                if weights_kind(folder) == "adapter":
                    self._load_adapter(folder)
                else:
                    self._load_full(folder)
                self.cache_kwarg = self._cache_kwarg()
            self.weights_version = version

    def _load_full(self, folder: Path) -> None:
        new = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype)
        if not isinstance(self.model, PeftModel):
            ours, theirs = self.model.state_dict(), new.state_dict()
            if ours.keys() == theirs.keys() and all(ours[k].shape == theirs[k].shape for k in ours):
                with torch.no_grad():
                    self.model.load_state_dict(theirs)
                return
        _check_full_attention(new.config)
        self.model = new.to(self.device).eval()  # other architecture, or drop the adapter wrapper
        self._free_cuda()

    @staticmethod
    def _adapter_shape(cfg) -> tuple:
        """What must agree for an adapter's weights to be copied into another adapter's tensors."""
        def norm(v):
            return v if v is None or isinstance(v, str) else sorted(v)

        return (str(cfg.peft_type), getattr(cfg, "r", None), getattr(cfg, "lora_alpha", None),
                norm(getattr(cfg, "target_modules", None)), norm(getattr(cfg, "exclude_modules", None)),
                getattr(cfg, "use_rslora", None), getattr(cfg, "use_dora", None), getattr(cfg, "bias", None),
                sorted(getattr(cfg, "rank_pattern", None) or {}), sorted(getattr(cfg, "alpha_pattern", None) or {}))

    def _load_adapter(self, folder: Path) -> None:
        if isinstance(self.model, PeftModel):
            active = self.model.active_adapter
            config = PeftConfig.from_pretrained(str(folder))
            if self._adapter_shape(config) == self._adapter_shape(self.model.peft_config[active]):
                weights = load_peft_weights(str(folder), device=str(self.device))
                result = set_peft_model_state_dict(self.model, weights, adapter_name=active)
                missing = [k for k in result.missing_keys if "lora_" in k and f".{active}." in k]
                if not result.unexpected_keys and not missing:
                    return  # copied into the active adapter's tensors
            # Different shape: load beside it, switch, and drop every other adapter.
            self._adapter_count += 1
            name = f"whale_{self._adapter_count}"
            self.model.load_adapter(str(folder), adapter_name=name, is_trainable=True)
            self.model.set_adapter(name)
            for other in [a for a in self.model.peft_config if a != name]:
                self.model.delete_adapter(other)
        else:
            # is_trainable: the trainer may continue training the served adapter (e.g. on resume).
            self.model = PeftModel.from_pretrained(self.model, str(folder), is_trainable=True)
        self.model.to(self.device).eval()

    def free_caches(self) -> None:
        """Drop what the next weight change invalidates anyway, so a training step does not hold it
        beside its activations: the prefix cache, the bf16 packs and the joined LoRA weights (each
        about one more copy of the model's Linear weights; rebuilt at their next use, as after any
        optimizer step). The KV slab's kept storage stays (bounded by `kv_cache_bytes`)."""
        with self.scheduler.paused():  # clears the prefix cache on the way out
            if self.adapted_linears is not None:
                self.adapted_linears.clear()
            if self.packed_linears is not None:
                self.packed_linears.clear()
        release_free_memory()

    def serve_model(self, model) -> None:
        """Serve `model` from now on: the trainer's (possibly peft-wrapped) version of self.model."""
        with self.scheduler.paused():
            self.model = model
            self.cache_kwarg = self._cache_kwarg()

    def _free_cuda(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Stop the engine thread (calls still queued resolve to errors) and drop the model."""
        self.scheduler.close()
        self.model = None  # type: ignore[assignment]
        self._free_cuda()


def _kv_token_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token holds over all layers (the slab's per-token cost)."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * heads * dim * dtype.itemsize


def _check_full_attention(config) -> None:
    """The scheduler's masks give every layer full causal attention; refuse models that need other."""
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    if kinds != {"full_attention"} or window:
        raise ValueError(f"the hf engine serves full-attention decoder models; {type(config).__name__} has "
                         f"{sorted(kinds)} layers (sliding window {window}); use the vllm backend for it")
