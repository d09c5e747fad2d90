"""How the scheduler lays out one prefill forward: which sequences go together, and their inputs.

A forward takes consecutive slab rows, left-padded so every row's last token sits in the last
column of the input (one `logits_to_keep` serves all rows). Row j holds the part of its prompt not
copied from a shared prefix (`start` onwards) and, for a choice row, every choice's canonical ids
side by side after the prompt; a 4D boolean mask says what each query sees:
- a prompt token: every column up to its own (causal);
- a choice token: the whole prompt and its own choice's earlier tokens (tree attention), with
  rotary positions counted from the end of the prompt, as if it followed the prompt alone;
- a padding token: column 0 only (a query that sees nothing would give NaN), writing one junk
  column past the row's content that nothing reads before it is overwritten.
"""

from __future__ import annotations

import torch

from whale.engine.jobs import ChoiceRow, Seq


def tree_len(item: Seq | ChoiceRow) -> int:
    return sum(len(c) for c in item.tree)


def suffix_len(item: Seq | ChoiceRow, start: int) -> int:
    """Query tokens of an item whose first `start` prompt tokens are copied: the prompt's rest + choices."""
    return len(item.prompt) - start + tree_len(item)


def prompt_cols(item: Seq | ChoiceRow) -> int:
    """Columns of an item's row that hold its prompt's KV (all but the last for a decode-ready one)."""
    return item.kv_len if isinstance(item, Seq) else len(item.prompt)


def plan_chunks(lengths: list[int], keeps: list[int], vocab: int, max_tokens: int, max_logits_bytes: int,
                forward_tokens: int) -> list[tuple[int, int]]:
    """Split items (lengths sorted longest first) into spans [i, j), one forward each, minimising the
    padded tokens plus `forward_tokens` per forward (its fixed cost), within `max_tokens` padded
    tokens and `max_logits_bytes` of fp32 logits (`keeps[i]` positions kept per row) per forward."""
    best = [0.0] + [float("inf")] * len(lengths)  # best[j]: cost of the first j items
    cut = [0] * (len(lengths) + 1)
    for j in range(1, len(lengths) + 1):
        keep = 1
        for i in range(j - 1, -1, -1):  # the span [i, j); its width is lengths[i]
            keep = max(keep, keeps[i])
            m = j - i
            if m > 1 and (m * lengths[i] > max_tokens or m * keep * vocab * 4 > max_logits_bytes):
                break
            cost = best[i] + forward_tokens + m * lengths[i]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], len(lengths)
    while j > 0:
        spans.append((cut[j], j))
        j = cut[j]
    return spans[::-1]


def prefill_inputs(chunk: list[Seq] | list[ChoiceRow], pad_id: int):
    """(input ids, rotary positions, slab columns, 4D mask, logits to keep) for one forward over `chunk`."""
    m = len(chunk)
    width = max(suffix_len(it, it.start) for it in chunk)
    cols_needed = max(len(it.prompt) + tree_len(it) + 1 for it in chunk)
    keep = max((tree_len(it) for it in chunk if isinstance(it, ChoiceRow)), default=0) + 1
    ids = torch.full((m, width), pad_id, dtype=torch.long)
    pos = torch.zeros((m, width), dtype=torch.long)
    cols = torch.zeros((m, width), dtype=torch.long)
    mask = torch.zeros((m, 1, width, cols_needed), dtype=torch.bool)
    arange = torch.arange(cols_needed)
    for j, it in enumerate(chunk):
        plen, start = len(it.prompt), it.start
        pad = width - suffix_len(it, start)
        q = slice(pad, pad + plen - start)
        ids[j, q] = torch.tensor(it.prompt[start:])
        pos[j, q] = cols[j, q] = torch.arange(start, plen)
        mask[j, 0, q] = arange <= cols[j, q].unsqueeze(-1)
        at, col = pad + plen - start, plen
        for choice in it.tree:
            k = len(choice)
            ids[j, at : at + k] = torch.tensor(choice)
            pos[j, at : at + k] = torch.arange(plen, plen + k)
            cols[j, at : at + k] = torch.arange(col, col + k)
            mask[j, 0, at : at + k, :plen] = True
            mask[j, 0, at : at + k, col : col + k] = torch.ones((k, k), dtype=torch.bool).tril()
            at, col = at + k, col + k
        cols[j, :pad] = col
        mask[j, 0, :pad, 0] = True
    return ids, pos, cols, mask, keep


def choice_scores(row: ChoiceRow, logits: torch.Tensor) -> None:
    """Add log p(choice | prompt) of the row's choices to its job's scores, from its kept logits
    [keep, vocab]: the row ends with its choices side by side, at kept positions [keep - total,
    keep); the last prompt token, just before them, predicts every choice's first token."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    keep = logp.shape[0]
    base = keep - tree_len(row)
    off = 0
    for c, choice in zip(row.choices, row.tree):
        preds = [base - 1] + [base + off + i for i in range(len(choice) - 1)]
        row.job.scores[c] = logp[preds, choice].sum().cpu()
        off += len(choice)
