"""The null engine: a model that knows nothing, for the harness guard.

A harness can score well without the model doing anything useful: it may answer from rules it
wrote itself (a chess harness that always plays the first capture, a QA harness that submits a
fixed string). The guard (whale/harness/guard.py) runs the same problems once with the real engine
and once with this one; when the two scores are close, the model is not what earns the reward.

To be a fair "knows nothing" baseline it must not be trivially worse than chance where the harness
offers choices: with `choices` it picks uniformly among them (a harness that constrains decoding to
the legal moves keeps its random-legal-move floor); otherwise it emits random printable words.
Every request is seeded from its own content and `seed`, so a probe is reproducible and one
request's sample does not depend on its batch-mates. It returns no token ids and so can never
produce training rows.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from typing import Any

from whale.engine.base import Generation, GenerationRequest, QueuedSubmit, SamplingParams

_LETTERS = string.ascii_lowercase + string.digits


class NullEngine(QueuedSubmit):
    weights_version = "null"
    returns_ids = False
    weight_sync = "none"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def _rng(self, request: GenerationRequest, index: int) -> random.Random:
        digest = hashlib.sha256(
            json.dumps([self.seed, request.seed, index, request.messages, request.choices], sort_keys=True,
                       default=str).encode()
        ).hexdigest()
        return random.Random(int(digest[:16], 16))

    def _random_text(self, rng: random.Random, max_tokens: int, stop: list[str] | None) -> tuple[str, str]:
        n_words = rng.randint(1, max(1, max_tokens))
        words = ["".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 8))) for _ in range(n_words)]
        text = " ".join(words)
        for s in stop or []:
            if s and s in text:
                return text[: text.index(s)], "stop"
        return text, ("length" if n_words >= max_tokens else "stop")

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Generation]]:
        out = []
        for req in requests:
            prompt_tokens = self.count_tokens(req.messages)
            gens = []
            for i in range(max(1, req.n)):
                rng = self._rng(req, i)
                if req.choices:
                    text, finish = rng.choice(list(req.choices)), "choice"
                else:
                    limit = min(req.max_tokens or sampling.max_tokens, sampling.max_tokens_cap)
                    text, finish = self._random_text(rng, limit, req.stop)
                gens.append(Generation(text=text, finish_reason=finish, weights_version=self.weights_version,
                                       prompt_tokens=prompt_tokens, completion_tokens=len(text.split())))
            out.append(gens)
        return out

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        """A rough count (words); the null engine has no tokenizer and needs none."""
        return sum(len(str(m.get("content") or "").split()) + 4 for m in messages)

    def load_weights(self, path: str | None, version: str) -> None:
        """No weights: the null engine stays "null" whatever it is asked to load."""

    def close(self) -> None:
        pass
