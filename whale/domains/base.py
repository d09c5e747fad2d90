"""The `Domain` protocol: data splits, the episode environment, the verifier and the base harness.

A domain keeps three things apart (docs/design.md, 4.3): serialisable `Problem`s with their
gold answers, the episode environment whose tools the harness may call, and a pure `grade`
function that the parent runs after the episode. The harness never sees `Problem.answer`.

Tools are proxied automatically: every name in `EpisodeEnv.tools` becomes a method on the `env`
proxy inside the sandbox; attributes in `public_state()` become read-only attributes there and are
refreshed after every tool call (chess's `env.fen` changes as moves are played).

Two declared members tell the harness search what it may rely on: `answer_format` (what the grader
reads in a submission: the domain-general mechanisms of the offline proposer and its diagnosis act
on it) and `hints` (domain knowledge for proposers: mechanisms, failure modes and brief text,
switched by `harness.domain_hints`; `Hints()` when a domain has none).

Your own task: write a class with these members in your own module and name it in the config as
`domain.module: "my_module:MyDomain"` (see examples/custom_domain.py, examples/label_domain.py).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Protocol, Sequence, TypeVar, runtime_checkable

from whale.config import BudgetConfig, ConfigError

if TYPE_CHECKING:
    from whale.harness.mechanism import Hints

SPLITS = ("weight", "harness", "val", "test")
DEAL_ORDER = ("test", "val", "harness", "weight")  # held-out splits first: a bigger weight split leaves them alone
T = TypeVar("T")


def split_sizes(sizes: Any) -> dict[str, int]:
    """`domain.splits` as a dict, refusing negative sizes."""
    out = {name: int(getattr(sizes, name)) for name in SPLITS}
    bad = [f"{k}={v}" for k, v in out.items() if v < 0]
    if bad:
        raise DataError(f"domain.splits sizes must be >= 0 (got {', '.join(bad)})")
    return out


def content_groups(items: Sequence[T], keys: Callable[[T], Iterable[Hashable]]) -> list[list[T]]:
    """Items linked by any shared content key (an entity, an expression, a position), as groups.

    Connected components, so "currency of France" and "currency of the country whose capital is
    Paris" (both keyed by the country) and any chain of such links end up in one group. Groups
    and their members keep the order of `items`.
    """
    parent = list(range(len(items)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Hashable, int] = {}
    for i, item in enumerate(items):
        for key in keys(item):
            j = owner.setdefault(key, i)
            a, b = root(i), root(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[T]] = {}
    for i, item in enumerate(items):
        groups.setdefault(root(i), []).append(item)
    return list(groups.values())


def deal_groups(groups: Sequence[list[T]], sizes: dict[str, int], names: Sequence[str], what: str,
                seed: Any = None) -> dict[str, list[T]]:
    """Fill the splits `names` in order with whole groups, so no content key is in two splits.

    Groups are taken in the given (seeded) order; one that does not fit the room left in a split
    waits for the next split, so sizes come out exactly as configured. With `seed`, each split's
    members are shuffled (seeded by split name), so `--limit N` still sees a mix.
    """
    left = list(groups)
    out: dict[str, list[T]] = {}
    for name in names:
        room, taken, rest = sizes[name], [], []
        for g in left:
            if 0 < len(g) <= room:
                taken.extend(g)
                room -= len(g)
            else:
                rest.append(g)
        if room:
            remaining = sum(len(g) for g in rest)
            raise DataError(f"{what}: cannot fill the {name} split ({sizes[name]}) with whole groups of related "
                            f"problems: {room} places left and {remaining} problems in {len(rest)} groups remain "
                            f"(splits ask for {', '.join(f'{n}={sizes[n]}' for n in names)}); lower domain.splits "
                            "or add data")
        if seed is not None:
            random.Random(f"{seed}:{name}").shuffle(taken)
        out[name], left = taken, rest
    return out


@dataclass(frozen=True)
class Setting:
    """A domain setting and the mode that reads it: given in any other mode it is an error, not a no-op."""

    help: str
    when: str = ""  # the mode in words ("domain.source: searchr1"); "" = read in every mode
    applies: Callable[[Any], bool] = lambda d: True  # noqa: E731 - d is the DomainConfig


def refuse_unread_settings(domain: str, d: Any, fields: dict[str, Setting], options: dict[str, Setting]) -> None:
    """One error naming the first setting this domain, in this mode, would silently ignore.

    `fields` are the DomainConfig keys the domain reads (data_path, corpus_path, retriever_url,
    judge_model, budget.invalid_moves), `options` every key it knows in `domain.options`.
    """
    given = {k: getattr(d, k) for k in ("data_path", "corpus_path", "retriever_url", "judge_model")}
    given = {k: v for k, v in given.items() if v not in (None, "")}
    if d.budget.invalid_moves != BudgetConfig().invalid_moves:
        given["budget.invalid_moves"] = d.budget.invalid_moves
    for key in given:
        setting = fields.get(key)
        if setting is None:
            raise ConfigError(f"{domain}: domain.{key} is not read by this domain; remove it")
        if not setting.applies(d):
            raise ConfigError(f"{domain}: domain.{key} is read only with {setting.when}; remove it or change the mode")
    unknown = sorted(set(d.options) - set(options))
    if unknown:
        raise ConfigError(f"{domain}: unknown domain.options {unknown}; known: {', '.join(options) or 'none'}")
    for key in d.options:
        if not options[key].applies(d):
            raise ConfigError(f"{domain}: domain.options.{key} is read only with {options[key].when}; "
                              "remove it or change the mode")


class DataError(ConfigError):
    """Data a run cannot use (a missing file, a malformed row, a split it cannot fill), phrased for the user.

    A ConfigError, so the command line prints it as one line and exits 2 instead of a traceback;
    a ValueError, so callers that catch those still do.
    """


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a bad line is an error naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n} is not valid JSON: {e}") from None
    return rows


@dataclass
class Problem:
    id: str
    question: str
    answer: Any  # gold: str, list of aliases, or a domain-specific JSON value
    source: str = ""  # data source, for per-source breakdowns
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class EpisodeError(Exception):
    """Raised by a tool for a refused request; the message goes back to the harness."""


class EpisodeEnv:
    """Parent-side state of one episode. Subclasses add tool methods named in `tools`."""

    tools: tuple[str, ...] = ()
    fatal_error: str | None = None  # set by a tool that cannot go on: the episode ends with this error

    def __init__(self, problem: Problem):
        self.problem = problem
        self.submitted: str | None = None

    def public_state(self) -> dict[str, Any]:
        """Attributes the harness can read as `env.<name>`. Never include the gold answer."""
        return {"question": self.problem.question}

    def submit(self, answer: str) -> dict[str, Any]:
        if self.submitted is not None:
            raise EpisodeError("env.submit was already called for this episode")
        self.submitted = str(answer)
        return {"ok": True}

    @property
    def done(self) -> bool:
        return self.submitted is not None

    def final_answer(self) -> str | None:
        """What gets graded (chess overrides: the moves played)."""
        return self.submitted

    def close(self) -> None:
        """Release per-episode resources (e.g. a sandboxed Python tool)."""


@dataclass(frozen=True)
class AnswerFormat:
    """What the grader reads in a submission, declared by the domain.

    The offline proposer's domain-general mechanisms (an answer prefill, a repair call, extraction,
    constrained choice) and the diagnosis's `format_mismatch` read it, so they work on a task they
    were never written for. `pattern` is a regex a gradable submission contains (group 1, when it
    has one, is the answer); `open`/`close` are the text around an answer the model can be
    prefilled with and stopped at; `choices` is the finite set of answers the grader accepts,
    exactly as written.
    """

    description: str  # in words, for briefs and repair prompts: "<answer>...</answer>", "the label only"
    pattern: str = ""
    open: str = ""
    close: str = ""
    choices: tuple[str, ...] = ()

    def extract(self, text: str | None) -> str | None:
        """The answer the grader would read, or None when `text` does not match the format."""
        if text is None:
            return None
        if self.pattern:
            found = list(re.finditer(self.pattern, text, re.S))
            if not found:
                return None
            last = found[-1]
            text = last.group(1) if last.re.groups else last.group(0)
        answer = text.strip()
        if self.choices and answer not in self.choices:
            return None
        return answer


@runtime_checkable
class Domain(Protocol):
    name: str
    brief: str  # for proposers: what env offers, answer format, what good harnesses do
    answer_format: AnswerFormat | None  # what the grader reads; None when it is not a text answer (chess's moves)
    hints: "Hints"  # domain knowledge for proposers (whale.harness.mechanism.Hints; `Hints()` for none)

    def load_splits(self) -> dict[str, list[Problem]]:
        """All four splits (SPLITS), disjoint by content, deterministic from the config seed."""
        ...

    def make_env(self, problem: Problem) -> EpisodeEnv: ...

    def grade(self, problem: Problem, answer: str | None) -> float:
        """Binary reward from what was submitted. Must be picklable/pure: runs in a process."""
        ...

    def grader(self) -> Callable[[Problem, str | None], float]:
        """The grading function the rollout runner sends to its grader processes: picklable (a
        module-level function or a `functools.partial` of one), `grade`'s reward for (problem,
        answer). A domain whose `grade` is such a function returns it."""
        ...

    def base_harness(self) -> str:
        """Source code of h0, the deliberately weak base harness."""
        ...
