"""Training rows: the token ids an accepted episode actually sampled, with a loss mask.

Why ids and not text: re-tokenising decoded text does not reproduce what was sampled (stop
strings, EOS, unusual splits of `choices`), and RSFT must raise the probability of exactly the
sequences that earned the reward. So a row is `prompt_ids + completion_ids` of recorded calls,
with loss only on `completion_ids`. EOS is in `completion_ids` only when it was generated; a
`length` finish has none and we add none.

Only calls that reached the episode's outcome are trained (`LLMCall.used`, decided by
whale.rollout.usage): a completion counts when it produced an action (a tool argument, the
submitted answer, the moves played) or was carried into a later used call's prompt; the `n`
siblings a harness did not keep, retries it dropped and single-`choices` calls are not trained,
and a harness can override with `completion.use()` / `completion.discard()`. An accepted episode
whose calls are all unused gives no rows.

Multi-turn episodes: when a call's prompt starts with the full ids (prompt + completion) of an
earlier used call of the same episode, the two merge into one sequence with two loss spans — the
tokens in between (tool output, the next user turn, template glue) get mask 0. This is verl's
response mask, and it trains the earlier turn once instead of twice. Calls that do not extend an
earlier sequence (a fresh conversation, one of `n` parallel samples) become rows of their own. An
unused call never starts or extends a sequence: when a later prompt contains its ids they are
glue (mask 0) of that later call, when no later prompt does they appear nowhere.

Rows are persisted (jsonl, atomic) before training, so a run killed mid-training resumes by
training on the saved rows instead of redoing the rollouts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from whale.rollout.trajectory import Trajectory
from whale.rollout.usage import decide_usage
from whale.store import atomic_write


@dataclass
class TrainingRow:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token was sampled by the model (trained), else 0
    trajectory_key: str  # groups the rows of one episode into one mini-batch slot

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"training row {self.trajectory_key!r}: {len(self.input_ids)} ids but "
                f"{len(self.loss_mask)} mask entries")

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


def trajectory_key(traj: Trajectory) -> str:
    return f"{traj.harness_id}/{traj.problem_id}/{traj.sample}"


def rows_from_trajectory(traj: Trajectory, max_length: int | None = None) -> list[TrainingRow]:
    """Turn the recorded calls of one episode into training rows (see the module docstring).

    Skipped: unused calls, calls without ids (an engine that cannot return them), calls that
    errored, and calls with no completion ids (nothing to train on).
    """
    decide_usage(traj)  # no-op when the runner decided already; old traces are decided here
    key = trajectory_key(traj)
    seqs: list[tuple[list[int], list[int]]] = []  # (ids, mask), in order of first appearance
    for call in traj.calls:
        if (not call.used or call.finish_reason == "error" or not call.prompt_ids
                or not call.completion_ids):
            continue
        prompt, completion = list(call.prompt_ids), list(call.completion_ids)
        target = None
        for ids, mask in reversed(seqs):  # the most recent sequence this prompt extends
            if len(prompt) >= len(ids) and prompt[: len(ids)] == ids:
                target = (ids, mask)
                break
        if target is None:
            seqs.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
        else:
            ids, mask = target
            glue = prompt[len(ids):]
            ids.extend(glue + completion)
            mask.extend([0] * len(glue) + [1] * len(completion))
    rows = []
    for ids, mask in seqs:
        if max_length is not None and len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) == 0:  # the first loss span started beyond max_length
            continue
        rows.append(TrainingRow(input_ids=ids, loss_mask=mask, trajectory_key=key))
    return rows


def rows_from_trajectories(trajs: list[Trajectory], max_length: int | None = None) -> list[TrainingRow]:
    rows: list[TrainingRow] = []
    for traj in trajs:
        rows.extend(rows_from_trajectory(traj, max_length))
    return rows


def save_rows(path: str | Path, rows: list[TrainingRow]) -> None:
    """Write rows as jsonl atomically (a temp file renamed over `path`), so a kill leaves either
    the complete file or none — its existence is what tells a resumed step to skip rollouts."""
    atomic_write(path, "".join(json.dumps(asdict(row), separators=(",", ":")) + "\n" for row in rows))


def load_rows(path: str | Path) -> list[TrainingRow]:
    path = Path(path)
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append(TrainingRow(input_ids=[int(t) for t in d["input_ids"]],
                                        loss_mask=[int(m) for m in d["loss_mask"]],
                                        trajectory_key=str(d["trajectory_key"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a training row ({e})") from None
    return rows
