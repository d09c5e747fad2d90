"""Problems from reasoning-gym generators: a seeded mixture, dealt into disjoint splits.

reasoning-gym (`pip install 'whale-opt[reasoning-gym]'`) generates item `i` of a task from
`Random(seed + i)` alone, so a task is an endless, reproducible stream. Each split takes its share
of every task (`weights`, largest remainder) from the task's stream, in the order test, val,
harness, weight: the test set depends only on the seed, the tasks and the test size, never on how
big the weight split is. An item whose question text (case and spacing ignored) was already
drawn, by any task or split, is skipped, so the splits are disjoint by content.

The whole generator entry (question, answer, metadata) rides in `Problem.meta["entry"]`: it is
what the task's own `score_answer` needs, and it stays in the parent (the harness sees only the
question).

Why the splits are dealt in a child interpreter: not every generator is reproducible across
interpreter starts. ransom_note draws letters with `rng.choice(list(a_set))`, and a set's order
follows Python's string hash seed, which is random per process unless PYTHONHASHSEED is set; so a
resumed run, a later `whale eval` and the other methods of a comparison each got other problems
(found 2026-12-07: a resume refused its own run, "the data splits differ"). `make_splits` deals in
a child started with PYTHONHASHSEED=0 unless this interpreter already runs with it.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import pickle
import random
import subprocess
import sys
from typing import Any

from whale.domains.base import SPLITS, Problem
from whale.domains.math.data import allocate, normalize_question

DEAL_ORDER = ("test", "val", "harness", "weight")
HASH_SEED = "0"  # PYTHONHASHSEED of the interpreter that deals (module docstring)
STREAM_SIZE = 1_000_000  # the virtual dataset size; items are generated on demand, by index
MAX_SKIPS = 20  # a stream that yields this many duplicates per wanted item is exhausted


class TaskError(ValueError):
    """A task name or task config reasoning-gym does not accept; the message names the task."""


def registry() -> dict[str, Any]:
    """reasoning-gym's task registry (name -> (dataset class, config class))."""
    try:
        from reasoning_gym.factory import DATASETS  # optional extra: imported only for this domain
    except ImportError:
        raise TaskError("domain reasoning_gym needs the reasoning-gym package: "
                        "pip install 'whale-opt[reasoning-gym]'") from None
    return DATASETS


def check_task(name: str) -> None:
    known = registry()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(known)} tasks are known (reasoning_gym.factory.DATASETS)"
        raise TaskError(f"reasoning_gym: unknown task {name!r}{hint}")


def task_seed(seed: int, task: str) -> int:
    """The task stream's seed: from the run seed and the task name (streams of two tasks differ)."""
    return int.from_bytes(hashlib.sha256(f"whale-rg:{seed}:{task}".encode()).digest()[:4], "little")


def make_dataset(task: str, config: dict[str, Any], seed: int = 0, size: int = STREAM_SIZE):
    """A reasoning-gym dataset for `task`; a bad config is a TaskError naming the task."""
    check_task(task)
    from reasoning_gym import create_dataset  # optional extra (see registry)

    try:
        return create_dataset(task, seed=seed, size=size, **config)
    except (TypeError, ValueError, AssertionError) as e:
        raise TaskError(f"reasoning_gym: task {task!r} rejects its config {config}: {e}") from None


def _problem(task: str, index: int, entry: dict[str, Any], config: dict[str, Any]) -> Problem:
    digest = hashlib.sha1(normalize_question(entry["question"]).encode()).hexdigest()[:12]
    clean = {"question": entry["question"], "answer": entry.get("answer"), "metadata": entry.get("metadata", {})}
    return Problem(id=f"{task}-{digest}", question=entry["question"], answer=entry.get("answer"), source=task,
                   meta={"task": task, "index": index, "config": config, "entry": clean})


def make_splits(tasks: dict[str, float], configs: dict[str, dict[str, Any]], sizes: dict[str, int],
                seed: int) -> dict[str, list[Problem]]:
    """Four disjoint splits with the same task mixture, dealt test first, the same in every process
    (module docstring: a child interpreter with a fixed hash seed deals them)."""
    if os.environ.get("PYTHONHASHSEED") == HASH_SEED:
        return deal(tasks, configs, sizes, seed)
    args = pickle.dumps((tasks, configs, sizes, seed))
    done = subprocess.run([sys.executable, "-m", "whale.domains.reasoning_gym.data"], input=args,
                          capture_output=True, env={**os.environ, "PYTHONHASHSEED": HASH_SEED})
    message = done.stderr.decode(errors="replace").strip()
    if done.returncode == 2:  # the child's TaskError, its message alone
        raise TaskError(message)
    if done.returncode != 0:
        raise TaskError(f"reasoning_gym: dealing the splits failed (exit {done.returncode}): {message[-2000:]}")
    return pickle.loads(done.stdout)


def deal(tasks: dict[str, float], configs: dict[str, dict[str, Any]], sizes: dict[str, int],
         seed: int) -> dict[str, list[Problem]]:
    """`make_splits` in this interpreter, whatever its hash seed."""
    streams = {t: make_dataset(t, configs.get(t, {}), seed=task_seed(seed, t)) for t in tasks}
    cursor = {t: 0 for t in tasks}
    seen: set[str] = set()
    out: dict[str, list[Problem]] = {}
    for split in DEAL_ORDER:
        items: list[Problem] = []
        for task, count in allocate(sizes[split], tasks).items():
            got, skips = 0, 0
            while got < count:
                if skips > MAX_SKIPS * count + 100 or cursor[task] >= STREAM_SIZE:
                    raise TaskError(f"reasoning_gym: task {task!r} yields only {got} new distinct problems "
                                    f"of the {count} the {split} split needs; lower the split sizes, its "
                                    "weight, or widen its config")
                index = cursor[task]
                cursor[task] += 1
                entry = streams[task][index]
                key = normalize_question(entry["question"])
                if key in seen:
                    skips += 1
                    continue
                seen.add(key)
                items.append(_problem(task, index, entry, configs.get(task, {})))
                got += 1
        random.Random(f"whale-rg:{seed}:{split}:order").shuffle(items)
        out[split] = items
    return {split: out[split] for split in SPLITS}


if __name__ == "__main__":  # make_splits' child: arguments and splits pickled over stdin / stdout
    try:
        dealt = deal(*pickle.loads(sys.stdin.buffer.read()))
    except TaskError as e:
        sys.stderr.write(str(e))
        sys.exit(2)
    sys.stdout.buffer.write(pickle.dumps(dealt))
