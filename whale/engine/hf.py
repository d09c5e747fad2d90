"""In-process transformers engine (CPU or one GPU), with its own batched decode loop.

Why not `model.generate`: WHALE needs every sampled row to be reproducible on its own. Each
sequence draws its random numbers from a private `torch.Generator` seeded from its request, so a
sample does not depend on which other calls happened to share its batch (the same guarantee as
vLLM's per-request seed). The loop also drops finished rows from the KV cache, so a batch costs
what its live rows cost, and it returns the exact prompt and completion ids for training rows.

`choices` are scored at sequence level (DESIGN §4): one prefill of the prompt, then every choice's
canonical ids in one batched forward over the shared KV cache; a choice is drawn from
softmax(log p(choice | prompt) / T). Token-by-token masking would distort that distribution.
"""

from __future__ import annotations

import copy
import inspect
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from whale.engine.base import Generation, GenerationRequest, SamplingParams, weights_kind
from whale.engine.default_model import resolve_model_path
from whale.engine.toolcalls import parse_tool_calls

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHOICE_LOGITS_BYTES = 1 << 28  # cap on the fp32 logits of one batched choice forward (256 MiB)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
    try:
        bf16_ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        bf16_ok = False
    return torch.bfloat16 if bf16_ok else torch.float32


@dataclass
class _Seq:
    """One sequence to sample: sample `sample` of request `req`."""

    req: int
    sample: int
    prompt_ids: list[int]
    max_new: int
    seed: int
    stop: list[str]
    ids: list[int] = field(default_factory=list)
    finish: str = "length"


class HFEngine:
    """The `Engine` protocol on a transformers causal LM (optionally with a PEFT adapter)."""

    returns_ids = True
    weight_sync = "in_place"  # the trainer updates self.model; see engine.base.WeightSync

    def __init__(
        self,
        name_or_path: str,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_batch_size: int = 32,
        max_model_len: int = 4096,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch_size < 1 or max_model_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_model_len >= 2 "
                             f"(got {max_batch_size}, {max_model_len})")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.weights_version = "base"
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
            # torch defaults to the machine's cores; in a container limited to fewer, oversubscription hurts.
            usable = len(os.sched_getaffinity(0))
            if torch.get_num_threads() > usable:
                torch.set_num_threads(usable)
        self.path = resolve_model_path(name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).to(self.device).eval()
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.eos_ids = self._eos_ids()
        self._cache_kw = self._cache_kwarg()
        self._adapter_count = 0  # names of adapters loaded beside another one

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
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        return len(self._prompt_ids(messages))

    # ------------------------------------------------------------------ generate

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Generation]]:
        results: list[list[Generation | None]] = []
        seqs: list[_Seq] = []
        choice_jobs = []
        for r, req in enumerate(requests):
            try:
                prompt, max_new, n, seed, stop = self._check(req, sampling)
            except Exception as exc:  # one bad request fails one episode, never the batch
                results.append([self._error(f"error: {exc}")])
                continue
            results.append([None] * n)
            if req.choices is not None:
                choice_jobs.append((r, prompt, list(req.choices), [seed + i for i in range(n)]))
            else:
                seqs.extend(_Seq(r, i, prompt, max_new, seed + i, stop) for i in range(n))

        was_training = self.model.training
        self.model.eval()
        try:
            # no_grad rather than inference_mode: the trainer may fine-tune this same model in
            # place, and inference tensors cached inside modules would break its backward pass.
            with torch.no_grad():
                for r, prompt, choices, seeds in choice_jobs:
                    try:
                        picks = self._choose(prompt, choices, seeds, sampling.temperature)
                    except Exception as exc:
                        results[r] = [self._error(f"error: {exc}")]
                        continue
                    for i, c in enumerate(picks):
                        ids = self.tokenizer.encode(choices[c], add_special_tokens=False)
                        results[r][i] = self._generation(choices[c], "choice", prompt, ids, requests[r])
                seqs.sort(key=lambda s: len(s.prompt_ids))
                for start in range(0, len(seqs), self.max_batch_size):
                    self._decode(seqs[start : start + self.max_batch_size], sampling)
        finally:
            if was_training:
                self.model.train()

        for s in seqs:
            results[s.req][s.sample] = self._finish(s, requests[s.req])
        return results  # type: ignore[return-value]

    def _check(self, req: GenerationRequest, sampling: SamplingParams):
        """Validate one request; return (prompt ids, max new tokens, n, seed, stop strings)."""
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
        max_new = req.max_tokens if req.max_tokens is not None else sampling.max_tokens
        if not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_new!r}")
        max_new = min(max_new, sampling.max_tokens_cap, self.max_model_len - len(prompt))
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        return prompt, max_new, req.n, int(seed), stop

    def _error(self, text: str) -> Generation:
        return Generation(text=text, finish_reason="error", weights_version=self.weights_version)

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

    def _finish(self, s: _Seq, req: GenerationRequest) -> Generation:
        """Text of a finished sequence: without a final EOS, cut before the first stop string."""
        body = s.ids[:-1] if s.ids and s.ids[-1] in self.eos_ids and s.finish == "stop" else s.ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        cuts = [text.find(x) for x in s.stop if x in text]
        if cuts:
            text = text[: min(cuts)]
        return self._generation(text, s.finish, s.prompt_ids, s.ids, req)

    # ------------------------------------------------------------------ decode loop

    def _cache_kwarg(self) -> str:
        """The forward argument that takes the KV cache: `cache` in recent transformers, else the old name."""
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _forward(self, cache, **kwargs):
        return self.model(use_cache=True, return_dict=True, **{self._cache_kw: cache}, **kwargs)

    def _decode(self, batch: list[_Seq], sampling: SamplingParams) -> None:
        """Sample every sequence of `batch` to EOS, a stop string or its token limit, in place."""
        from transformers import DynamicCache

        dev = self.device
        lens = [len(s.prompt_ids) for s in batch]
        width = max(lens)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):  # left padding: the next token of every row is at column -1
            input_ids[i, width - lens[i] :] = torch.tensor(s.prompt_ids)
            mask[i, width - lens[i] :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # One uniform per step per row, drawn up front from the row's own generator: the stream
        # depends only on (seed, max_new), never on the batch.
        uniforms = torch.zeros((len(batch), max(s.max_new for s in batch)))
        for i, s in enumerate(batch):
            gen = torch.Generator().manual_seed(s.seed % (1 << 63))
            uniforms[i, : s.max_new] = 1.0 - torch.rand(s.max_new, generator=gen)  # in (0, 1]
        uniforms = uniforms.to(dev)
        eos = torch.tensor(sorted(self.eos_ids), device=dev)
        windows = [max((len(x) for x in s.stop), default=0) + 4 for s in batch]

        mask = mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        out = self._forward(cache, input_ids=input_ids.to(dev), attention_mask=mask,
                            position_ids=positions.to(dev), logits_to_keep=1)
        next_pos = torch.tensor(lens, device=dev).unsqueeze(-1)
        rows = torch.arange(len(batch), device=dev)  # row of `batch` behind each live cache row
        live = list(range(len(batch)))
        step = 0
        while True:
            tokens = self._sample(out.logits[:, -1, :], uniforms[rows, step], sampling)
            is_eos = torch.isin(tokens, eos).tolist()
            keep = []
            for j, (tok, hit_eos) in enumerate(zip(tokens.tolist(), is_eos)):
                s = batch[live[j]]
                s.ids.append(tok)
                if hit_eos:
                    s.finish = "stop"
                elif s.stop and self._hit_stop(s, windows[live[j]]):
                    s.finish = "stop"
                elif len(s.ids) >= s.max_new:
                    s.finish = "length"
                else:
                    keep.append(j)
            if not keep:
                return
            if len(keep) < len(live):  # drop finished rows: they stop costing compute
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                mask, next_pos, rows, tokens = mask[idx], next_pos[idx], rows[idx], tokens[idx]
                live = [live[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=-1)
            out = self._forward(cache, input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=next_pos)
            next_pos = next_pos + 1
            step += 1

    def _hit_stop(self, s: _Seq, window: int) -> bool:
        """Did the last token complete a stop string? Decoding a short tail keeps this O(1) per step."""
        tail = self.tokenizer.decode(s.ids[-window:], skip_special_tokens=False)
        return any(x in tail for x in s.stop)

    @staticmethod
    def _sample(logits: torch.Tensor, u: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """Next token per row by inverse-CDF sampling with the row's uniform `u` (greedy at T=0)."""
        if sampling.temperature <= 0:
            return logits.argmax(dim=-1)
        logits = logits.float() / sampling.temperature
        order = None
        if 0 < sampling.top_k < logits.shape[-1]:
            logits, order = logits.topk(sampling.top_k, dim=-1)  # sorted, largest first
        elif sampling.top_p < 1.0:
            logits, order = logits.sort(dim=-1, descending=True, stable=True)
        probs = torch.softmax(logits, dim=-1)
        if sampling.top_p < 1.0:  # nucleus: keep the smallest prefix with mass >= top_p
            probs = probs.masked_fill(probs.cumsum(-1) - probs >= sampling.top_p, 0.0)
        cdf = probs.cumsum(-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp_(max=cdf.shape[-1] - 1)
        return (pick if order is None else order.gather(-1, pick)).squeeze(-1)

    # ------------------------------------------------------------------ choices

    @torch.no_grad()
    def choice_logprobs(self, prompt_ids: list[int], choices: list[str]) -> torch.Tensor:
        """log p(choice | prompt) summed over each choice's canonical ids, one shared prefill."""
        enc = [self.tokenizer.encode(c, add_special_tokens=False) for c in choices]
        longest = max(len(e) for e in enc)
        if len(prompt_ids) + longest > self.max_model_len:
            raise ValueError(f"prompt too long ({len(prompt_ids)} tokens + {longest} for the longest choice)")
        from transformers import DynamicCache

        dev = self.device
        cache = DynamicCache(config=self.model.config)
        out = self._forward(cache, input_ids=torch.tensor([prompt_ids], device=dev), logits_to_keep=1)
        first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        vocab = out.logits.shape[-1]
        chunk = max(1, min(len(enc), _CHOICE_LOGITS_BYTES // max(1, longest * vocab * 4)))
        scores = []
        for start in range(0, len(enc), chunk):
            part = enc[start : start + chunk]
            width = max(len(e) for e in part)
            ids = torch.full((len(part), width), self.pad_id, dtype=torch.long)
            valid = torch.zeros((len(part), width), dtype=torch.bool)
            for i, e in enumerate(part):  # right padding: choice tokens sit right after the prompt
                ids[i, : len(e)] = torch.tensor(e)
                valid[i, : len(e)] = True
            ids, valid = ids.to(dev), valid.to(dev)
            total = first[ids[:, 0]]
            if width > 1:
                part_cache = copy.deepcopy(cache) if start + chunk < len(enc) else cache
                part_cache.batch_repeat_interleave(len(part))
                attn = torch.cat([torch.ones((len(part), len(prompt_ids)), dtype=torch.long, device=dev),
                                  valid.long()], dim=-1)
                pos = torch.arange(len(prompt_ids), len(prompt_ids) + width - 1, device=dev).expand(len(part), -1)
                logits = self._forward(part_cache, input_ids=ids[:, :-1], attention_mask=attn[:, :-1],
                                       position_ids=pos).logits.float()
                token_lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                total = total + (token_lp * valid[:, 1:]).sum(-1)
            scores.append(total)
        return torch.cat(scores).cpu()

    def _choose(self, prompt_ids: list[int], choices: list[str], seeds: list[int], temperature: float) -> list[int]:
        """Indices of the drawn choices, one per seed: softmax(logp / T), argmax at T=0."""
        logp = self.choice_logprobs(prompt_ids, choices)
        if temperature <= 0:
            return [int(logp.argmax())] * len(seeds)
        cdf = torch.softmax(logp / temperature, dim=-1).cumsum(-1)
        picks = []
        for seed in seeds:
            u = 1.0 - torch.rand(1, generator=torch.Generator().manual_seed(seed % (1 << 63)))
            picks.append(int(torch.searchsorted(cdf, u * cdf[-1]).clamp(max=len(choices) - 1)))
        return picks

    # ------------------------------------------------------------------ weights

    def load_weights(self, path: str | None, version: str) -> None:
        """Serve new weights under the tag `version`.

        None: the model was trained in place, only the tag changes. A PEFT adapter folder
        (adapter_config.json) replaces the current adapter; a full model folder (config.json)
        replaces the weights. Both copy into the existing parameters when the shapes match, so a
        trainer holding this model (and its optimizer) keeps working on the same tensors.
        """
        if path is not None:
            folder = Path(path)
            if weights_kind(folder) == "adapter":
                self._load_adapter(folder)
            else:
                self._load_full(folder)
        self.weights_version = version

    def _load_full(self, folder: Path) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        new = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype)
        if not isinstance(self.model, PeftModel):
            ours, theirs = self.model.state_dict(), new.state_dict()
            if ours.keys() == theirs.keys() and all(ours[k].shape == theirs[k].shape for k in ours):
                with torch.no_grad():
                    self.model.load_state_dict(theirs)
                return
        self.model = new.to(self.device).eval()  # other architecture, or drop the adapter wrapper
        self._cache_kw = self._cache_kwarg()
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
        from peft import PeftConfig, PeftModel
        from peft.utils import load_peft_weights, set_peft_model_state_dict

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

    def serve_model(self, model) -> None:
        """Serve `model` from now on: the trainer's (possibly peft-wrapped) version of self.model."""
        self.model = model
        self._cache_kw = self._cache_kwarg()

    def _free_cuda(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        self._free_cuda()
