"""Weight phase: training rows, the in-place trainer, one RSFT step, the stream and patience."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from whale.config import WeightConfig
from whale.domains.base import Problem
from whale.rollout.trajectory import LLMCall, Trajectory
from whale.weights import (RSFT, ProblemStream, Trainer, TrainingRow, WeightPatience, load_rows,
                           rows_from_trajectories, rows_from_trajectory, save_rows)
from whale.weights.trainer import lora_target_modules


# ---------------------------------------------------------------------------- helpers
def load_tiny(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def call(prompt, completion, finish="stop"):
    """A recorded call the rows code trains (used=True: which calls are used is tests/test_usage.py's topic)."""
    return LLMCall(messages=[], completion="", finish_reason=finish, prompt_ids=list(prompt),
                   completion_ids=list(completion), used=True)


def traj(calls, reward=1.0, pid="p0", sample=0):
    return Trajectory(problem_id=pid, sample=sample, harness_id="h0", calls=calls, reward=reward)


def random_rows(n, length, vocab, n_traj=None, seed=0):
    g = random.Random(seed)
    n_traj = n_traj or n
    rows = []
    for i in range(n):
        ln = length + g.randint(-length // 3, length // 3)
        cut = ln // 2 + g.randint(-3, 3)
        rows.append(TrainingRow([g.randrange(3, vocab) for _ in range(ln)], [0] * cut + [1] * (ln - cut),
                                f"t{i % n_traj}"))
    return rows


def lora_and_base(model):
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    return lora, base


def chat_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


# ---------------------------------------------------------------------------- rows
def test_single_call_row_masks_prompt_and_keeps_completion_as_sampled():
    rows = rows_from_trajectory(traj([call([5, 6, 7], [8, 9, 2])]))
    assert len(rows) == 1
    assert rows[0].input_ids == [5, 6, 7, 8, 9, 2]
    assert rows[0].loss_mask == [0, 0, 0, 1, 1, 1]
    assert rows[0].trajectory_key == "h0/p0/0"


def test_extending_calls_merge_into_one_row_with_two_loss_spans():
    first = call([1, 2, 3], [4, 5])
    second = call([1, 2, 3, 4, 5, 10, 11], [12, 13, 14])  # prompt = previous ids + tool output
    rows = rows_from_trajectory(traj([first, second]))
    assert len(rows) == 1
    assert rows[0].input_ids == [1, 2, 3, 4, 5, 10, 11, 12, 13, 14]
    assert rows[0].loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]


def test_non_extending_calls_are_separate_rows_and_bad_calls_are_skipped():
    calls = [
        call([1, 2, 3], [4, 5]),
        call([1, 2, 3], [6, 7]),  # a second sample of the same prompt: does not extend [1..5]
        call([9, 9], [8], finish="error"),  # engine error
        call([], [], finish="stop"),  # engine without ids
        call([1, 2, 3, 6, 7, 20], [21]),  # extends the SECOND sequence
    ]
    rows = rows_from_trajectory(traj(calls))
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 20, 21]]
    assert rows[1].loss_mask == [0, 0, 0, 1, 1, 0, 1]


def test_length_finish_row_gets_no_eos(tiny_model_dir):
    _, tok = load_tiny(tiny_model_dir)
    prompt = chat_ids(tok, [{"role": "user", "content": "capital of France?"}])
    completion = tok.encode("The capital", add_special_tokens=False)
    rows = rows_from_trajectory(traj([call(prompt, completion, finish="length")]))
    assert rows[0].input_ids == prompt + completion
    assert rows[0].input_ids[-1] != tok.eos_token_id
    assert tok.eos_token_id not in rows[0].input_ids[len(prompt):]


def test_truncation_drops_rows_whose_loss_starts_beyond_max_length():
    long_prompt = call(list(range(3, 13)), [20, 21])  # loss starts at position 10
    short = call([3, 4], [5, 6, 7, 8])
    rows = rows_from_trajectories([traj([long_prompt], pid="a"), traj([short], pid="b")], max_length=5)
    assert len(rows) == 1
    assert rows[0].input_ids == [3, 4, 5, 6, 7] and rows[0].loss_mask == [0, 0, 1, 1, 1]


def test_rows_roundtrip_through_jsonl(tmp_path):
    rows = random_rows(5, 20, 100)
    path = tmp_path / "rows" / "step_0.jsonl"
    save_rows(path, rows)
    assert load_rows(path) == rows
    assert not list(path.parent.glob("*.tmp"))


# ---------------------------------------------------------------------------- trainer
def test_loss_is_nll_of_completion_tokens_only(tiny_model_dir):
    model, tok = load_tiny(tiny_model_dir)
    trainer = Trainer(model, tok, WeightConfig())
    rows = random_rows(3, 24, len(tok), seed=1)
    manual_sum, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r.input_ids])
            logp = torch.log_softmax(trainer.model(input_ids=ids).logits[0].float(), -1)
            for t in range(1, len(r.input_ids)):
                if r.loss_mask[t]:
                    manual_sum -= float(logp[t - 1, r.input_ids[t]])
                    count += 1
    assert count == sum(sum(r.loss_mask) for r in rows)
    assert trainer.mean_nll(rows) == pytest.approx(manual_sum / count, rel=1e-5)
    # the last prompt token's own label never counts: making it a different token leaves the loss
    # unchanged when it is the final token of a row (nothing later depends on it)
    r = rows[0]
    cut = r.loss_mask.index(1)
    prompt_only = TrainingRow(r.input_ids[:cut], [0] * cut, "x")
    assert trainer.mean_nll(rows + [prompt_only]) == pytest.approx(manual_sum / count, rel=1e-5)


def test_chunked_cross_entropy_matches_full_logits(tiny_model_dir):
    model, tok = load_tiny(tiny_model_dir)
    trainer = Trainer(model, tok, WeightConfig(micro_batch_tokens=128), chunk_tokens=7)
    assert trainer.chunked
    rows = random_rows(6, 30, len(tok), seed=2)
    assert trainer.mean_nll(rows, chunked=True) == pytest.approx(trainer.mean_nll(rows, chunked=False), rel=1e-6)
    grads = []
    for chunked in (True, False):
        ids, attn, mask = trainer._collate(rows)
        trainer._nll_sum(ids, attn, mask, chunked=chunked).backward()
        grads.append([p.grad.clone() for p in trainer.params])
        trainer.optimizer.zero_grad(set_to_none=True)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_logits_are_divided_by_the_training_temperature(tiny_model_dir):
    model, tok = load_tiny(tiny_model_dir)
    trainer = Trainer(model, tok, WeightConfig(), temperature=2.0)
    row = random_rows(1, 20, len(tok), seed=5)[0]
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([row.input_ids])).logits[0].float() / 2.0
    logp = torch.log_softmax(logits, -1)
    picked = [-float(logp[t - 1, row.input_ids[t]]) for t in range(1, len(row.input_ids)) if row.loss_mask[t]]
    for chunked in (True, False):
        assert trainer.mean_nll([row], chunked=chunked) == pytest.approx(sum(picked) / len(picked), rel=1e-5)


def test_gradient_checkpointing_gives_the_same_gradient(tiny_model_dir):
    rows = random_rows(3, 24, 300, seed=6)
    grads = []
    for gc in (False, True):
        model, tok = load_tiny(tiny_model_dir)
        trainer = Trainer(model, tok, WeightConfig(gradient_checkpointing=gc))
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == gc
        trainer.model.train()
        ids, attn, mask = trainer._collate(rows)
        trainer._nll_sum(ids, attn, mask).backward()
        grads.append([p.grad.clone() for p in trainer.params])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_gradient_is_token_mean_over_the_minibatch_not_per_microbatch(tiny_model_dir):
    model, tok = load_tiny(tiny_model_dir)
    cfg = WeightConfig(micro_batch_tokens=40, max_grad_norm=1e9, mini_batch_trajectories=64)
    trainer = Trainer(model, tok, cfg)
    rows = random_rows(5, 24, len(tok), seed=3)
    rows[0] = TrainingRow(rows[0].input_ids, [0] * (len(rows[0].input_ids) - 2) + [1, 1], "t0")  # 2 loss tokens
    ids, attn, mask = trainer._collate(rows)
    n = int(mask[:, 1:].sum())
    (trainer._nll_sum(ids, attn, mask, chunked=False) / n).backward()
    expected = [p.grad.clone() for p in trainer.params]
    trainer.optimizer.zero_grad(set_to_none=True)
    seen = []
    trainer.optimizer.register_step_pre_hook(lambda opt, a, k: seen.append([p.grad.clone() for p in trainer.params]))
    stats = trainer.train_step(rows)
    assert stats["optimizer_steps"] == 1 and stats["trained_tokens"] == n
    for a, b in zip(seen[0], expected):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)


def test_one_optimizer_step_per_minibatch_of_trajectories(tiny_model_dir):
    model, tok = load_tiny(tiny_model_dir)
    trainer = Trainer(model, tok, WeightConfig(mini_batch_trajectories=2))
    rows = random_rows(10, 16, len(tok), n_traj=5)  # 5 trajectories, 2 rows each
    batches = trainer.minibatches(rows)
    assert [len({r.trajectory_key for r in b}) for b in batches] == [2, 2, 1]
    assert trainer.train_step(rows)["optimizer_steps"] == 3
    assert trainer.step == 3


def test_lora_step_moves_adapter_and_keeps_base_weights(tiny_model_dir):
    model, tok = load_tiny(tiny_model_dir)
    trainer = Trainer(model, tok, WeightConfig(lr=1e-2))
    engine = FakeEngine()
    trainer.attach(engine)
    assert engine.model is trainer.model
    lora0, base0 = lora_and_base(trainer.model)
    assert lora0 and all(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)
    stats = trainer.train_step(random_rows(4, 20, len(tok)))
    assert stats["trained_tokens"] > 0 and stats["loss"] > 0
    lora1, base1 = lora_and_base(trainer.model)
    assert all(torch.equal(base0[n], base1[n]) for n in base0)
    assert any(not torch.equal(lora0[n], lora1[n]) for n in lora0)
    assert not trainer.model.training


def test_full_finetune_changes_base_weights(tiny_model_dir):
    model, tok = load_tiny(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, tok, WeightConfig(finetune="full", lr=1e-3))
    assert trainer.model is model
    trainer.train_step(random_rows(4, 20, len(tok)))
    after = dict(model.named_parameters())
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.embed_tokens.weight" in changed


def test_optimizer_state_survives_save_and_load(tiny_model_dir, tmp_path):
    rows = random_rows(6, 20, 300, n_traj=3, seed=4)
    cfg = WeightConfig(mini_batch_trajectories=2, warmup_steps=5)
    model, tok = load_tiny(tiny_model_dir)
    a = Trainer(model, tok, cfg, seed=1)
    a.train_step(rows)
    path = a.save(tmp_path / "w1", "w1")
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= {p.name for p in path.iterdir()}
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and not config.get("modules_to_save")

    model2, _ = load_tiny(tiny_model_dir)
    b = Trainer(model2, tok, cfg, seed=999)
    assert b.load(path) == "w1"
    assert b.step == a.step == 2
    assert b.scheduler.last_epoch == a.scheduler.last_epoch
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)
        sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"]) == 2
    # training continues identically (same shuffling RNG, same lr schedule)
    sa, sb = a.train_step(rows), b.train_step(rows)
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-6) and sa["lr"] == sb["lr"]
    for pa, pb in zip(a.params, b.params):
        assert torch.allclose(pa, pb, atol=1e-7)


def test_full_finetune_checkpoint_roundtrip(tiny_model_dir, tmp_path):
    cfg = WeightConfig(finetune="full", lr=1e-3)
    model, tok = load_tiny(tiny_model_dir)
    a = Trainer(model, tok, cfg)
    a.train_step(random_rows(3, 16, len(tok)))
    path = a.save(tmp_path / "full", "w0")
    assert (path / "config.json").exists() and list(path.glob("*.safetensors"))
    model2, _ = load_tiny(tiny_model_dir)
    b = Trainer(model2, tok, cfg)
    b.load(path)
    for (n, pa), pb in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(pa, pb), n


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def bf16_adamw_steps(model, rows, lr, steps):
    """The old full fine-tuning: AdamW directly on the bf16 parameters (the control arm below)."""
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        n_loss = sum(sum(r.loss_mask[1:]) for r in rows)
        for r in rows:
            ids, mask = torch.tensor([r.input_ids]), torch.tensor([r.loss_mask], dtype=torch.bool)
            logits = model(input_ids=ids).logits[:, :-1][mask[:, 1:]].float()
            (torch.nn.functional.cross_entropy(logits, ids[:, 1:][mask[:, 1:]], reduction="sum") / n_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_full_finetune_in_bf16_moves_fp32_masters_at_the_papers_lr(tiny_model_dir):
    _, tok = load_tiny(tiny_model_dir)
    rows = random_rows(4, 20, len(tok))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    w0 = dict(model.named_parameters())[Q_PROJ].detach().clone()
    trainer = Trainer(model, tok, WeightConfig(finetune="full", lr=1e-7))
    engine = FakeEngine()
    trainer.attach(engine)
    assert trainer.masters[Q_PROJ].dtype == torch.float32 and len(trainer.masters) == len(trainer.params)
    trainer.train_step(rows)
    served = dict(engine.model.named_parameters())[Q_PROJ]
    assert served.dtype == torch.bfloat16
    assert (trainer.masters[Q_PROJ] != w0.float()).float().mean() == 1.0  # every master element moved
    assert torch.equal(served, trainer.masters[Q_PROJ].to(torch.bfloat16))  # the engine serves the rounded masters
    for _ in range(29):
        trainer.train_step(rows)
    moved = (served != w0).float().mean().item()

    # Control: the old code (AdamW on the bf16 weights). Updates of ~1e-7 round to nothing except on
    # the few weights smaller than ~3e-5, so after 1 or 30 steps the same 0.2% of elements moved;
    # with masters 4.4% of the served weights moved after 30 steps (15.6% after 100), measured.
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    bf16_adamw_steps(old, rows, 1e-7, 1)
    old_moved_1 = (dict(old.named_parameters())[Q_PROJ] != w0).float().mean().item()
    bf16_adamw_steps(old, rows, 1e-7, 29)
    old_moved_30 = (dict(old.named_parameters())[Q_PROJ] != w0).float().mean().item()
    assert old_moved_1 < 0.01 and old_moved_30 < 2 * old_moved_1 + 1e-9  # stuck
    assert moved > 10 * old_moved_30 and moved > 0.02


def test_bf16_full_finetune_resumes_from_saved_masters_and_optimizer_state(tiny_model_dir, tmp_path):
    _, tok = load_tiny(tiny_model_dir)
    rows = random_rows(4, 20, len(tok), n_traj=2, seed=3)
    cfg = WeightConfig(finetune="full", lr=1e-6, mini_batch_trajectories=1)
    a = Trainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16), tok, cfg)
    a.train_step(rows)
    path = a.save(tmp_path / "w0", "w0")
    assert (path / "fp32_master" / "master_weights.safetensors").exists()
    assert not list(path.glob("master*"))  # not a top-level *.safetensors a server would load as weights
    b = Trainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16), tok, cfg, seed=5)
    b.load(path)
    for name, master in a.masters.items():
        assert torch.equal(master, b.masters[name]), name
        assert not torch.equal(master, master.to(torch.bfloat16).float())  # more than the rounded weights
    for ma, mb in zip(a.optimized, b.optimized):
        sa, sb = a.optimizer.state[ma], b.optimizer.state[mb]
        assert sa["exp_avg"].dtype == torch.float32 and torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    a.train_step(rows), b.train_step(rows)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb) and torch.equal(a.masters[name], b.masters[name]), name


def test_lora_on_a_bf16_model_trains_fp32_adapters_without_masters(tiny_model_dir):
    _, tok = load_tiny(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    trainer = Trainer(model, tok, WeightConfig(lr=1e-7))
    lora0, base0 = lora_and_base(trainer.model)
    assert {p.dtype for p in trainer.params} == {torch.float32}  # peft's autocast_adapter_dtype
    assert trainer.masters == {}
    trainer.train_step(random_rows(4, 20, len(tok)))
    lora1, base1 = lora_and_base(trainer.model)
    assert all(torch.equal(base0[n], base1[n]) and base1[n].dtype == torch.bfloat16 for n in base0)
    steps = {n: (lora1[n] - lora0[n]).abs().max().item() for n in lora0}
    # lora_B starts at zero (so lora_A gets no gradient yet): it moves by Adam's first step, ~lr
    assert all(0 < steps[n] < 2e-7 for n in steps if "lora_B" in n)


def test_lora_targets_language_model_only_on_multimodal_model():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, pad_token_id=0, eos_token_id=1)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=290, video_token_id=291,
                        vision_start_token_id=292, vision_end_token_id=293)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg)
    model.model.visual.blocks[0].mlp.add_module("up_proj", torch.nn.Linear(32, 32))  # same name as an LM layer
    suffixes, excluded = lora_target_modules(model, "all-linear")
    assert "lm_head" not in suffixes and "up_proj" in suffixes
    assert excluded == ["model.visual.blocks.0.mlp.up_proj"]
    trainer = Trainer(model, SimpleNamespace(pad_token_id=0, eos_token_id=1), WeightConfig())
    lora_names = [n for n, _ in trainer.model.named_parameters() if "lora_" in n]
    assert lora_names and not [n for n in lora_names if "visual" in n or "lm_head" in n]
    assert trainer.chunked
    rows = random_rows(2, 20, 280)
    assert trainer.mean_nll(rows, chunked=True) == pytest.approx(trainer.mean_nll(rows, chunked=False), rel=1e-5)


# ---------------------------------------------------------------------------- RSFT step
class FakeRunner:
    """Returns one trajectory per (problem, sample) whose single call answers with given ids."""

    def __init__(self, tok, reward):
        self.tok, self.reward, self.calls = tok, reward, []

    def run(self, source, problems, samples=1, *, harness_id="h0", seed=0, purpose="eval", progress=None):
        self.calls.append((source, [p.id for p in problems], samples, purpose, seed))
        out = []
        for p in problems:
            prompt = chat_ids(self.tok, [{"role": "user", "content": p.question}])
            answer = self.tok.encode(f"The answer is {p.answer}", add_special_tokens=False) + [self.tok.eos_token_id]
            for s in range(samples):
                out.append(Trajectory(problem_id=p.id, sample=s, harness_id=harness_id, reward=self.reward,
                                      calls=[call(prompt, answer)]))
        return out


class FakeEngine:
    weight_sync = "in_place"

    def __init__(self):
        self.model, self.weights_version, self.loads, self.frees = None, "base", [], 0

    def serve_model(self, model):
        self.model = model

    def free_caches(self):
        self.frees += 1

    def load_weights(self, path, version):
        self.loads.append((path, version))
        self.weights_version = version


def problems(n=6):
    return [Problem(id=f"q{i}", question=f"What is {i} + 3?", answer=str(i + 3)) for i in range(n)]


def make_rsft(tiny_model_dir, tmp_path, reward, runner=None):
    model, tok = load_tiny(tiny_model_dir)
    cfg = WeightConfig(problems_per_step=2, samples_per_problem=2, lr=1e-2)
    trainer = Trainer(model, tok, cfg)
    engine = FakeEngine()
    trainer.attach(engine)
    runner = runner or FakeRunner(tok, reward)
    stream = ProblemStream(problems(), cfg.problems_per_step, seed=0)
    return RSFT(runner, trainer, engine, cfg, stream, "def run(env, llm): pass", "h0", tmp_path / "rows"), runner


def test_rsft_step_trains_on_accepted_and_pushes_a_version(tiny_model_dir, tmp_path):
    rsft, runner = make_rsft(tiny_model_dir, tmp_path, reward=1.0)
    lora0, _ = lora_and_base(rsft.trainer.model)
    res = rsft.step(0, seed=7)
    assert runner.calls[0][2:] == (2, "weight", 7)
    assert (res.rollouts, res.accepted, res.accept_rate, res.rows) == (4, 4, 1.0, 4)
    assert res.weights_version == "w0" and rsft.engine.loads == [(None, "w0")] and res.reason == "trained"
    assert res.trained_tokens > 0 and res.loss is not None and len(res.trajectories) == 4
    assert len(load_rows(rsft.rows_path(0))) == 4
    lora1, _ = lora_and_base(rsft.trainer.model)
    assert any(not torch.equal(lora0[n], lora1[n]) for n in lora0)
    rsft.set_harness("def run(env, llm): env.submit('x')", "h1")
    rsft.step(1, seed=8)
    assert runner.calls[1][0].endswith("env.submit('x')") and rsft.engine.weights_version == "w1"


def test_no_accepted_step_leaves_weights_and_version_untouched(tiny_model_dir, tmp_path):
    rsft, _ = make_rsft(tiny_model_dir, tmp_path, reward=0.0)
    before = {n: p.detach().clone() for n, p in rsft.trainer.model.named_parameters()}
    res = rsft.step(0, seed=1)
    assert res.reason == "no accepted trajectories" and res.weights_version is None
    assert res.accepted == 0 and res.accept_rate == 0.0 and res.rollouts == 4
    assert rsft.engine.loads == [] and rsft.engine.weights_version == "base" and rsft.trainer.step == 0
    assert all(torch.equal(before[n], p) for n, p in rsft.trainer.model.named_parameters())


def test_step_resumed_after_kill_trains_on_saved_rows_without_rollouts(tiny_model_dir, tmp_path):
    first, _ = make_rsft(tiny_model_dir, tmp_path, reward=1.0)
    first.trainer.train_step = lambda rows: (_ for _ in ()).throw(KeyboardInterrupt())  # killed mid-training
    with pytest.raises(KeyboardInterrupt):
        first.step(0, seed=3)
    saved = load_rows(first.rows_path(0))

    class NoRollouts:
        def run(self, *a, **k):
            raise AssertionError("rollouts were redone")

    second, _ = make_rsft(tiny_model_dir, tmp_path, reward=1.0, runner=NoRollouts())
    res = second.step(0, seed=3)
    assert res.resumed and res.weights_version == "w0" and res.rows == len(saved) == 4
    assert res.rollouts == 4 and res.accepted == 4 and res.trajectories == []


# ---------------------------------------------------------------------------- stream and patience
def test_problem_stream_resume_yields_the_same_sequence():
    ps = problems(7)
    a = ProblemStream(ps, 3, seed=5)
    assert a.steps_per_epoch == 2
    seq = [[p.id for p in next(a)] for _ in range(6)]
    assert a.epoch == 3.0
    assert len(set(seq[0] + seq[1])) == 6  # no problem twice within an epoch
    assert seq[:2] != seq[2:4]  # a fresh shuffle per epoch
    b = ProblemStream(ps, 3, seed=5)
    for _ in range(3):
        next(b)
    c = ProblemStream(ps, 3, seed=5)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert [[p.id for p in next(c)] for _ in range(3)] == seq[3:]
    with pytest.raises(ValueError):
        ProblemStream(ps[:6], 3, seed=5).load_state_dict(b.state_dict())
    with pytest.raises(ValueError):
        ProblemStream(ps[:2], 3)


def test_patience_stops_after_rise_then_plateau():
    p = WeightPatience(window=3, burn_in=4, patience=3)
    signal = [0.1, 0.2, 0.3, 0.4, 0.5] + [0.5] * 10
    stopped_at = None
    for i, r in enumerate(signal, 1):
        p.update(r)
        if p.should_stop():
            stopped_at = i
            break
    # window mean peaks at step 7 (0.5, 0.5, 0.5); three steps without a new best -> stop at 10
    assert stopped_at == 10


def test_patience_does_not_stop_a_noisy_rise():
    rng = random.Random(0)
    p = WeightPatience(window=3, burn_in=3, patience=3)
    for i in range(40):
        p.update(0.02 * i + rng.uniform(-0.08, 0.08))
        assert not p.should_stop(), f"stopped at step {i + 1}"


def test_patience_respects_burn_in_and_state_roundtrip():
    p = WeightPatience(window=1, burn_in=6, patience=2)
    for r in [0.9, 0.1, 0.1, 0.1, 0.1]:
        p.update(r)
        assert not p.should_stop()
    p.update(0.1)
    assert p.should_stop()  # step 6 >= burn-in, best (step 1) is 5 steps old
    q = WeightPatience(window=1, burn_in=0, patience=1)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.should_stop() and q.burn_in == 6
    with pytest.raises(ValueError):
        WeightPatience(window=0, burn_in=0, patience=1)
