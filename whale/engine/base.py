"""The engine contract: batched chat generation with token ids and a weights version.

Every backend (in-process transformers, a vLLM server, a generic OpenAI-compatible endpoint, the
null engine of the harness guard) answers the same `GenerationRequest`s. Harnesses never see an
engine: the rollout runner gathers their `llm(...)` calls from many episodes into one `generate`
call, which is what keeps a small CPU model busy.

Why token ids matter: fine-tuning rows are the ids that were actually sampled (stop strings and EOS
exactly as generated). Re-tokenising decoded text does not reproduce them, so a backend that
cannot return ids (`returns_ids = False`) serves evaluation and proposers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Run-level sampling; identical in training, search and evaluation (the paper's rule)."""

    temperature: float = 1.0
    top_k: int = 20  # 0 disables
    top_p: float = 1.0
    max_tokens: int = 256  # default per call; a harness may ask for fewer/more up to max_tokens_cap
    max_tokens_cap: int = 1024


@dataclass
class GenerationRequest:
    """One `llm(...)` call of one episode.

    `messages` are OpenAI-style chat messages. If the last one has role `assistant`, the model
    continues that text (prefill) and only the continuation is returned. `choices`, when given,
    makes the engine return exactly one of the strings, drawn at sequence level from
    softmax(log p(choice | prompt) / T) after one shared prefill. `seed` makes sampling of this
    request independent of its batch-mates; sample i of an `n > 1` request uses `seed + i`.
    """

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    stop: list[str] | None = None
    n: int = 1
    choices: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    seed: int | None = None


@dataclass
class Generation:
    """One sampled completion, with everything a training row needs."""

    text: str
    finish_reason: str  # "stop" (EOS or stop string), "length", or "choice"
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    weights_version: str = "base"
    tool_calls: list[dict[str, Any]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


WeightSync = Literal["in_place", "from_disk", "none"]
"""How trained weights reach an engine (`Engine.weight_sync`):

- "in_place": the engine serves a model object in this process; the trainer updates that very
  object (`InProcessEngine.model`), and a push only changes the version tag;
- "from_disk": the engine serves weights it loads from a saved adapter or checkpoint
  (`load_weights(path, version)`): the trainer trains its own copy and saves it first (vLLM);
- "none": inference only (a generic endpoint, the null engine); a weight phase is an error.
"""


@runtime_checkable
class Engine(Protocol):
    """What the rollout runner needs from a model server.

    `generate` returns, per request, a list of `n` generations. It must not raise for a single
    bad request (e.g. a prompt longer than the context): return a generation with
    finish_reason "error" and the message as text instead, so one episode fails, not the batch.

    `weight_sync` is a declared capability (see `WeightSync`): callers decide how to train and
    push weights from it, never by probing attributes.
    """

    weights_version: str
    returns_ids: bool
    weight_sync: WeightSync

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[list[Generation]]: ...

    def count_tokens(self, messages: list[dict[str, Any]]) -> int: ...

    def load_weights(self, path: str | None, version: str) -> None:
        """Serve the adapter/checkpoint at `path` from now on (None: back to the base model)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class InProcessEngine(Engine, Protocol):
    """An engine with `weight_sync == "in_place"`: it serves `model` (a torch module) with
    `tokenizer`, in this process. The trainer wraps and updates that object and hands the wrapped
    module back with `serve_model`, so rollouts always sample from the weights being trained."""

    model: Any
    tokenizer: Any

    def serve_model(self, model: Any) -> None: ...


def weights_kind(folder: Path) -> str:
    """'adapter' for a PEFT adapter folder, 'full' for a model folder; a clear error otherwise.

    Both engines accept either from `load_weights`; this is the one place that tells them apart.
    """
    if (folder / "adapter_config.json").is_file():
        return "adapter"
    if (folder / "config.json").is_file():
        return "full"
    raise ValueError(f"{folder} is neither a PEFT adapter (adapter_config.json) "
                     "nor a model folder (config.json)")
