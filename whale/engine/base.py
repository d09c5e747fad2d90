"""The engine contract: streaming chat generation with token ids and a weights version.

Every backend (in-process transformers, a vLLM server, a generic OpenAI-compatible endpoint, the
null engine of the harness guard) answers the same `GenerationRequest`s. Harnesses never see an
engine: the rollout runner hands each episode's `llm(...)` call to `Engine.submit` as it arrives
and awaits that call's future alone. Batching is the engine's job: the hf engine lets a sequence
join its running decode batch as soon as a row frees (continuous batching), a vLLM server does the
same, and engines that can only answer whole batches get `QueuedSubmit`, which sends whatever
queued up while the engine was busy as the next `generate` call. Why streaming and not a batch per
`generate`: an episode's next call must never wait for unrelated sequences to finish.

Why token ids matter: fine-tuning rows are the ids that were actually sampled (stop strings and EOS
exactly as generated). Re-tokenising decoded text does not reproduce them, so a backend that
cannot return ids (`returns_ids = False`) serves evaluation and proposers only.
"""

from __future__ import annotations

import math
import random
import threading
import weakref
from bisect import bisect
from collections.abc import Sequence
from concurrent.futures import Future
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


@dataclass(frozen=True)
class Recovery:
    """One attempt to bring an engine's dead server back mid-run: why it was needed, whether it worked."""

    reason: str  # e.g. "exited with code 137", or "not healthy (...)"; a failed attempt says why it failed
    ok: bool


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

    `submit` queues one request and returns at once (from any thread) a future of its `n`
    generations. The future never fails for a bad request (e.g. a prompt longer than the context)
    nor for an engine failure: it resolves to a generation with finish_reason "error" and the
    message as text, so one episode fails, not its batch-mates. `generate` is "submit all, wait
    all": per request, a list of `n` generations, under the same rule.

    `recoveries` grows by one `Recovery` (why, and whether it worked) each time the engine had to bring
    its server back mid-run (a vLLM server that died); an engine without a server keeps it empty. The run logs
    each one as an `engine_recovered` metrics row, so an incident is on record, not only on stderr.

    `weight_sync` is a declared capability (see `WeightSync`): callers decide how to train and
    push weights from it, never by probing attributes. So is `lockstep`: an engine that can batch
    as a function of the request stream alone returns a `LockstepGate`, one that cannot (a vLLM
    server, an endpoint, a queue of whole batches) returns None and its samples depend on timing.
    """

    weights_version: str
    returns_ids: bool
    weight_sync: WeightSync
    recoveries: Sequence[Recovery]  # one per attempt to bring its dead server back, with the outcome

    def submit(self, request: GenerationRequest, sampling: SamplingParams) -> Future[list[Generation]]: ...

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[list[Generation]]: ...

    def count_tokens(self, messages: list[dict[str, Any]]) -> int: ...

    def lockstep(self, clients: int, hold_s: float = 1.0) -> "LockstepGate | None":
        """Batch the calls of `clients` episode slots deterministically (engine/lockstep.py), or None.
        The engine waits at most `hold_s` for a due call; past that it goes on and counts a break."""
        ...

    def load_weights(self, path: str | None, version: str) -> None:
        """Serve the adapter/checkpoint at `path` from now on (None: back to the base model)."""
        ...

    def close(self) -> None: ...


class LockstepGate(Protocol):
    """What `Engine.lockstep` returns: submit per client, in a fixed order within each step.

    A client is running until it submits and again once its call resolves; the engine steps only
    while none is running. `leave` when a client has no more episodes; `close` when the batch ends."""

    def submit(self, client: int, order: int, request: GenerationRequest,
               sampling: SamplingParams) -> Future[list[Generation]]: ...

    def leave(self, client: int) -> None: ...

    def close(self) -> None: ...

    breaks: int  # clients the engine stopped waiting for (0: the batch is bit-reproducible)


@runtime_checkable
class InProcessEngine(Engine, Protocol):
    """An engine with `weight_sync == "in_place"`: it serves `model` (a torch module) with
    `tokenizer`, in this process. The trainer wraps and updates that object and hands the wrapped
    module back with `serve_model`, so rollouts always sample from the weights being trained."""

    model: Any
    tokenizer: Any

    def serve_model(self, model: Any) -> None: ...

    def free_caches(self) -> None:
        """Before a training step: drop what the weight change will invalidate anyway (prefix cache,
        weights derived from the parameters), so the step's activations do not stack on them."""
        ...


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


def draw_choices(logps: Sequence[float], seeds: list[int], temperature: float) -> list[int]:
    """Indices of the choices drawn for `choices` requests, one per seed: from softmax(logp / T)
    (argmax at T = 0, the first of equal ones), where logp is each choice's log p(choice | prompt).
    Every backend draws here, in float64 with `random.Random(seed)`, so the same seed and scores
    pick the same choice on hf, vllm and openai alike (sequence-level choice, as engine/hf.py says)."""
    logps = [float(x) for x in logps]
    if temperature <= 0:
        best = max(range(len(logps)), key=logps.__getitem__)
        return [best] * len(seeds)
    top = max(x / temperature for x in logps)
    cdf, total = [], 0.0
    for x in logps:
        total += math.exp(x / temperature - top)
        cdf.append(total)
    return [bisect(cdf, random.Random(seed).random() * total, 0, len(cdf) - 1) for seed in seeds]


def error_generations(message: str, weights_version: str = "base") -> list[Generation]:
    """What a failed request resolves to: one generation with finish_reason "error"."""
    return [Generation(text=message, finish_reason="error", weights_version=weights_version)]


def wait_all(futures: list[Future[list[Generation]]]) -> list[list[Generation]]:
    """`generate` on top of `submit`: the results of `futures`, in order."""
    return [f.result() for f in futures]


class QueuedSubmit:
    """`submit` for engines that implement only `generate` (null, test doubles, simple backends).

    Submitted calls queue up; one worker thread per engine sends everything queued (grouped by
    sampling) to `generate` as soon as the previous call returned, so calls that arrive while the
    engine is busy form the next batch, and a lone call goes at once. The worker exits when the
    queue is empty, so an idle engine holds no thread. A `generate` that raises fails the calls of
    that batch with error generations, never the futures.
    """

    recoveries: Sequence[Recovery] = ()  # no server of its own to bring back

    def lockstep(self, clients: int, hold_s: float = 1.0) -> None:
        """Whole batches form from whatever queued meanwhile: no deterministic batching."""
        return None

    def submit(self, request: GenerationRequest, sampling: SamplingParams) -> Future[list[Generation]]:
        future: Future[list[Generation]] = Future()
        with _QUEUES_LOCK:
            queue = _QUEUES.get(self)
            if queue is None:
                queue = _QUEUES[self] = _SubmitQueue()
            queue.items.append((request, sampling, future))
            if not queue.worker_running:
                queue.worker_running = True
                threading.Thread(target=_drain, args=(self, queue), daemon=True,
                                 name=f"whale-submit-{type(self).__name__}").start()
        return future


@dataclass
class _SubmitQueue:
    items: list[tuple[GenerationRequest, SamplingParams, Future]] = field(default_factory=list)
    worker_running: bool = False


_QUEUES: "weakref.WeakKeyDictionary[Any, _SubmitQueue]" = weakref.WeakKeyDictionary()
_QUEUES_LOCK = threading.Lock()


def _drain(engine: Any, queue: _SubmitQueue) -> None:
    while True:
        with _QUEUES_LOCK:
            batch, queue.items = queue.items, []
            if not batch:
                queue.worker_running = False
                return
        groups: dict[SamplingParams, list[tuple[GenerationRequest, Future]]] = {}
        for request, sampling, future in batch:
            if future.set_running_or_notify_cancel():  # a cancelled call is not generated
                groups.setdefault(sampling, []).append((request, future))
        for sampling, group in groups.items():
            try:
                results = engine.generate([r for r, _ in group], sampling)
                if len(results) != len(group):
                    raise RuntimeError(f"generate returned {len(results)} results for {len(group)} requests")
            except Exception as exc:  # noqa: BLE001 - the engine failed this batch; its callers get errors
                results = [error_generations(f"engine error: {type(exc).__name__}: {exc}")] * len(group)
            for (_, future), gens in zip(group, results):
                future.set_result(gens)
