"""The run's state: what state.json holds, typed (docs/design.md, "The run directory").

`RunState` has one field per key of state.json, in the order the file lists them; the run
(run.py) reads and changes it by attribute and saves it after every unit of work
(`RunDir.save_state`). Fields whose shape WHALE fixes are checked when the file is read, so a
damaged or foreign state.json is refused with the key that is wrong (`RunState.parse`), not met
later as a KeyError. The saved states of other components (the problem stream, weight patience,
a harness phase's search) stay plain dicts: their owners check them on `load_state_dict`.

The JSON is the one the run wrote when the state was a dict: run directories from then resume,
and a state.json read and written again has the same keys and values (keys an older run had not
yet written appear at their defaults).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from whale.errors import DamagedFile
from whale.schedule import Progress

Phase = Literal["weight", "harness", "done"]


class PendingEval(BaseModel):
    """An evaluation that closes a unit of work and has not finished yet: saved with the unit that
    asks for it, run right after, cleared (`RunState.pending_eval = None`) once its splits are done.
    `phase`/`cycle` are the phase it closes, for its metrics rows; hand-written markers may leave
    them out."""

    model_config = ConfigDict(extra="forbid")

    tag: str  # "initial", "w<step>" (a weight phase's end or an every_steps evaluation), "c<cycle>-h", "final"
    phase: Phase | None = None
    cycle: int | None = None
    last: bool = False  # it closes the run: every eval split, not only eval.intermediate_splits


class ValBest(BaseModel):
    """The evaluation with the highest val mean@k so far, and the (harness, weights) it measured;
    replaced when a later val evaluation beats it. Its weights stay on disk for model selection."""

    model_config = ConfigDict(extra="forbid")

    mean_at_k: float
    unit: str  # the evaluation unit, `eval-<tag>-val`
    tag: str
    harness_id: str
    weights_version: str


class RunState(BaseModel):
    """Everything a resumed run needs besides the files beside state.json (archive, weights, rows,
    ledger). Changed only between units of work and saved at the end of each (see run.py)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    data_fingerprints: dict[str, str] = {}
    """Per split, `<problems>:<hash>` of the problems when the run started; a resume refuses other data."""
    model_fingerprint: dict[str, str] = {}
    """sha256 of the local base model's weight files when the run started ({} for a hub id or an
    API backend); `whale matrix` refuses to mix runs of different base models."""
    phase: Phase
    """The phase to run next, or "done". Set at a phase boundary, together with `pending_eval`."""
    cycle: int = 0
    """Harness phases finished; incremented when one ends (it names the units `c<cycle>-...`)."""
    harness_id: str = "h0"
    """The current harness (an archive id): h0, the user's `harness.initial`, or the last accepted one."""
    weights_version: str = "base"
    """The current weights: "base" or `w<step>`, the checkpoint a weight step saved (kept on disk)."""
    evals_done: list[str] = []
    """Evaluation units finished (`eval-<tag>-<split>`); a resumed evaluation skips them."""
    pending_eval: PendingEval | None = None
    """The evaluation to run before anything else (the initial one, or the one closing the last unit)."""
    progress: Progress = Field(default_factory=Progress)
    """The counters the schedule decides on; changed by every weight step and harness iteration."""
    stream: dict[str, Any] = {}
    """The weight problem stream's `state_dict` (batches drawn), saved with every unit."""
    patience: dict[str, Any] = {}
    """Weight patience's `state_dict` (the accept rates it watches), saved with every unit."""
    last_eval_pairs: dict[str, tuple[str, str]] = {}
    """Per split, the (harness, weights) its last evaluation measured: an evaluation of the same pair
    is skipped (it would repeat that result on the same seeds)."""
    val_best: ValBest | None = None
    """The best val evaluation so far; None until val is evaluated."""
    last_eval_pair: tuple[str, str] | None = None
    """The (harness, weights) the latest evaluation of any split measured (for readers of state.json)."""
    phase_end_weights: list[str] = []
    """The weights each weight phase ended on (no "base"): kept on disk for `whale matrix`'s columns."""
    search: dict[str, Any] | None = None
    """The harness phase in progress: `HarnessSearch.state_dict()` after each iteration; None between
    harness phases (so the next one starts afresh)."""
    finished: bool = False
    """The run ended: its last evaluation and the val-best measurement are done (phase "done" is not
    enough: the closing evaluation runs after it)."""
    ledger: dict[str, Any] = {}
    """`Ledger.snapshot()` at the save (ledger.jsonl is the record; this is for readers and old runs)."""
    elapsed_s: float = 0.0
    """Wall seconds the run has taken, over all its processes, at the save."""
    updated: str | None = None
    """Local time of the save (`%Y-%m-%dT%H:%M:%S`)."""

    @classmethod
    def parse(cls, text: str | bytes, where: str) -> "RunState":
        """The state in `text` (state.json's content); a DamagedFile error naming `where` and what is
        wrong if it is not JSON or not a state WHALE writes."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise damaged(where, f"not JSON: {e}") from None
        if not isinstance(data, dict):
            raise damaged(where, f"a JSON {type(data).__name__}, not an object")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            wrong = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'the file'}: {err['msg']}"
                              + ("" if err["type"] == "missing" else f" (got {err['input']!r:.60})")
                              for err in e.errors()[:3])
            raise damaged(where, f"not a run state: {wrong}") from None

    def to_json(self) -> str:
        """state.json's text: every field, as `json.dumps` wrote the dict state (indent 1)."""
        return json.dumps(self.model_dump(mode="json"), indent=1)


def damaged(where: str, why: str) -> DamagedFile:
    return DamagedFile(f"{where} is damaged ({why}); WHALE writes it atomically, so another program or a copy "
                       f"broke it: put back the file from a copy of the run directory, or start a new run (--out)")
