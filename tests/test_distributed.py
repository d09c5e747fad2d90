"""The weight phase on a group of training ranks (whale/weights/distributed.py), 2 gloo ranks on CPU.

The claim: N ranks train the same weights as one process, because each rank divides its token-loss
sum by the mini-batch's loss-token count over all ranks. The reference is the in-process `Trainer`
on the same rows; the control is a group whose ranks divide by their own counts, which must NOT
match (so the comparison can tell the two apart). Then the faults: a rank killed mid-step.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_run import tiny_config
from test_weights import load_tiny, random_rows

from whale.store import KILL_ENV
from whale.weights import Trainer
from whale.weights.distributed import RankDied, ShardedTrainer, TrainGroup, worker_main

# 3 weight steps of 9 rows in 6 trajectories: mini-batches of 4 + 2 trajectories, so ranks get
# unequal rows and micro-batches (64 tokens: one or two rows each), and lr 1e-2 moves every weight.
STEPS = [random_rows(9, 20, 300, n_traj=6, seed=s) for s in range(3)]
SETTINGS = {"compute.train_ranks": 2, "weight.mini_batch_trajectories": 4, "weight.micro_batch_tokens": 64,
            "weight.lr": 1e-2}
SAME = 5e-5  # measured 2026-12-06: 4.6e-6 (full) and 8.0e-6 (LoRA) after 3 steps (float32 sums in other orders)


def weights_file(finetune: str) -> str:
    return "adapter_model.safetensors" if finetune == "lora" else "model.safetensors"


def max_difference(a_dir, b_dir, finetune: str) -> float:
    a, b = load_file(a_dir / weights_file(finetune)), load_file(b_dir / weights_file(finetune))
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module", params=["full", "lora"])
def reference(request, tiny_model_dir, tmp_path_factory):
    """The in-process trainer's losses and checkpoint after STEPS."""
    finetune = request.param
    cfg = tiny_config(tiny_model_dir, **SETTINGS, **{"weight.finetune": finetune})
    model, tok = load_tiny(tiny_model_dir)
    trainer = Trainer(model, tok, cfg.weight, seed=cfg.seed, temperature=1.0)
    stats = [trainer.train_step(rows) for rows in STEPS]
    assert max(s["grad_norm"] for s in stats) > cfg.weight.max_grad_norm  # clipping is part of what is compared
    out = trainer.save(tmp_path_factory.mktemp(f"one-{finetune}") / "w", "w2")
    return cfg, [(s["loss"], s["grad_norm"]) for s in stats], out


def per_rank_denominator_worker(*args):
    """worker_main with the bug the design avoids: each rank divides by its own loss-token count."""
    ShardedTrainer._all_sum = lambda self, value: value
    worker_main(*args)


def train(cfg, out, **group_args):
    group = TrainGroup(cfg, **group_args)
    try:
        stats = [group.train_step(rows) for rows in STEPS]
        return [(s["loss"], s["grad_norm"]) for s in stats], group.save(out, "w2"), group
    finally:
        group.close()


def test_two_ranks_train_the_weights_of_one_process(reference, tmp_path):
    cfg, ref_losses, ref_dir = reference
    losses, out, _ = train(cfg, tmp_path / "w")
    assert [x for pair in losses for x in pair] == pytest.approx([x for pair in ref_losses for x in pair], abs=1e-5)
    assert max_difference(ref_dir, out, cfg.weight.finetune) < SAME
    assert (out / "trainer_state.pt").exists()


def test_per_rank_denominators_give_other_weights(reference, tmp_path):
    cfg, _, ref_dir = reference
    if cfg.weight.finetune == "lora":
        pytest.skip("one control is enough: the full fine-tune's")
    _, out, _ = train(cfg, tmp_path / "w", worker=per_rank_denominator_worker)
    assert max_difference(ref_dir, out, "full") > 20 * SAME


def test_a_rank_killed_mid_step_restarts_the_group_from_the_last_checkpoint(reference, tmp_path, monkeypatch):
    cfg, ref_losses, ref_dir = reference
    if cfg.weight.finetune == "lora":
        pytest.skip("the group's fault handling does not depend on the fine-tuning kind")
    # rank 1 of the group's first generation SIGKILLs itself as the second weight step starts
    # (optimizer step 2: the first step's rows make two mini-batches)
    monkeypatch.setenv(KILL_ENV, "train@rank1#0/step2")
    group = TrainGroup(cfg)
    try:
        group.train_step(STEPS[0])
        group.save(tmp_path / "w0", "w0")
        losses = [(s["loss"], s["grad_norm"]) for s in map(group.train_step, STEPS[1:])]
        assert group.generation == 1  # restarted once, from w0
        out = group.save(tmp_path / "w2", "w2")
    finally:
        group.close()
    assert [x for pair in losses for x in pair] == pytest.approx([x for pair in ref_losses[1:] for x in pair],
                                                                 abs=1e-5)
    assert max_difference(ref_dir, out, "full") < SAME


def test_a_rank_that_keeps_dying_is_one_clear_error(reference, monkeypatch):
    cfg, _, _ = reference
    if cfg.weight.finetune == "lora":
        pytest.skip("the group's fault handling does not depend on the fine-tuning kind")
    monkeypatch.setenv(KILL_ENV, "train@rank0#0/step0")
    group = TrainGroup(cfg, restarts=0)
    try:
        with pytest.raises(RankDied, match=r"training rank 0 .* died .*during 'train'.*whale run --resume"):
            group.train_step(STEPS[0])
        assert not any(p.is_alive() for p in group._procs)
    finally:
        group.close()
