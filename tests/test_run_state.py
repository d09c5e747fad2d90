"""The typed run state (whale/run_state.py): state.json as the dict-era run wrote it loads and is
written back unchanged; a state.json of another shape is refused, naming the key that is wrong."""

import json

import pytest

from whale.errors import DamagedFile
from whale.run_state import PendingEval, RunState
from whale.store import RunDir, read_state

# state.json of a finished WHALE run, as the run wrote it when its state was a dict (every key it wrote)
DICT_ERA = """{
 "data_fingerprints": {"weight": "208:35fd679b1a973889", "harness": "64:00d45d9a93cc70e1", "val": "32:943618661e56398d",
  "test": "128:a6f850711bfd4a73"},
 "model_fingerprint": {"model.safetensors": "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"},
 "phase": "done",
 "cycle": 2,
 "harness_id": "h1",
 "weights_version": "w11",
 "evals_done": ["eval-initial-val", "eval-initial-test", "eval-w4-val", "eval-c0-h-val", "eval-w12-val", "eval-w12-test"],
 "pending_eval": null,
 "progress": {"weight_steps": 12, "phase_steps": 0, "harness_phases": 2, "harness_iterations": 6,
  "budget_rollouts": 1536, "patience_stop": false, "phase_start_rollouts": 1152, "phase_accept_rates": [0.5, 0.625],
  "gains": [{"kind": "weight", "gain": 0.125, "rollouts": 384}]},
 "stream": {"batches_drawn": 12, "seed": 1, "batch_size": 8, "fingerprint": 3263308927},
 "patience": {"window": 3, "burn_in": 3, "patience": 3, "rewards": [0.28125, 0.4375], "best": 0.4166666666666667,
  "best_step": 4},
 "last_eval_pairs": {"val": ["h1", "w11"], "test": ["h1", "w11"]},
 "val_best": {"mean_at_k": 0.6328, "unit": "eval-w12-val", "tag": "w12", "harness_id": "h1", "weights_version": "w11"},
 "last_eval_pair": ["h1", "w11"],
 "phase_end_weights": ["w3", "w7", "w11"],
 "search": null,
 "finished": true,
 "ledger": {"budget_rollouts": 1536, "rollouts": {"eval": 1664, "weight": 384, "harness": 768}, "llm_calls": 7560,
  "tokens": 874349, "prompt_tokens": 784707, "completion_tokens": 89642, "proposer_seconds": 0.0, "proposer_tokens": 0},
 "elapsed_s": 1575.37,
 "updated": "2026-12-03T07:14:08"
}"""


def test_a_dict_era_state_loads_and_round_trips_to_the_same_json(tmp_path):
    (tmp_path / "state.json").write_text(DICT_ERA)
    state = read_state(tmp_path)
    assert (state.phase, state.cycle, state.harness_id, state.weights_version) == ("done", 2, "h1", "w11")
    assert state.val_best.weights_version == "w11" and state.progress.weight_steps == 12
    assert state.last_eval_pairs["val"] == ("h1", "w11") and state.finished is True
    assert json.loads(state.to_json()) == json.loads(DICT_ERA)
    assert list(json.loads(state.to_json())) == list(json.loads(DICT_ERA))  # the keys in the order the run wrote them


def test_a_state_saved_mid_run_resumes_its_pending_evaluation(tmp_path):
    """A state from before the run's end: no `finished`, `search` or `phase_end_weights` yet, and a
    hand-written pending marker without phase and cycle."""
    old = {k: v for k, v in json.loads(DICT_ERA).items() if k not in ("finished", "search", "phase_end_weights")}
    old.update(phase="weight", pending_eval={"tag": "w4", "last": True})
    (tmp_path / "state.json").write_text(json.dumps(old))
    state = read_state(tmp_path)
    assert state.pending_eval == PendingEval(tag="w4", last=True) and not state.finished
    written = json.loads(state.to_json())
    assert {k: written[k] for k in old if k != "pending_eval"} == {k: v for k, v in old.items() if k != "pending_eval"}
    assert (written["finished"], written["search"], written["phase_end_weights"]) == (False, None, [])


def test_save_state_writes_what_read_state_reads(tmp_path):
    run = RunDir(tmp_path)
    state = RunState(phase="weight", pending_eval=PendingEval(tag="initial", phase="weight", cycle=0))
    state.evals_done.append("eval-initial-val")
    run.save_state(state)
    again = read_state(tmp_path)
    assert again == state and again.ledger["budget_rollouts"] == 0 and again.updated


@pytest.mark.parametrize("change, wrong", [
    ({"phase": "train"}, "phase: Input should be 'weight', 'harness' or 'done' (got 'train')"),
    ({"cycle": "two"}, "cycle: Input should be a valid integer"),
    ({"val_best": {"mean_at_k": 0.5}}, "val_best.unit: Field required"),
    ({"pending_eval": {"phase": "weight"}}, "pending_eval.tag: Field required"),
    ({"progress": {"weight_stepz": 3}}, "progress.weight_stepz"),
    ({"budget": 12}, "budget: Extra inputs are not permitted"),
])
def test_a_state_of_another_shape_is_refused_naming_the_key(tmp_path, change, wrong):
    (tmp_path / "state.json").write_text(json.dumps({**json.loads(DICT_ERA), **change}))
    with pytest.raises(DamagedFile) as e:
        read_state(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'state.json'} is damaged (not a run state: ") and wrong in str(e.value)


def test_a_state_without_a_phase_is_refused(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"cycle": 0}))
    with pytest.raises(DamagedFile, match=r"not a run state: phase: Field required"):
        read_state(tmp_path)


def test_an_assignment_of_the_wrong_type_is_refused():
    state = RunState(phase="weight")
    with pytest.raises(ValueError, match="phase"):
        state.phase = "weights"
