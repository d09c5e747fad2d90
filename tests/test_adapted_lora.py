"""engine/adapted.py: a plain LoRA layer runs as [x | x A^T] [W | s B]^T in the engine's CPU
forwards, as accurate as peft's forward or more, rebuilt after its weights change, and every other
layer or forward keeps peft's own forward."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from whale.engine import adapted, packed
from whale.engine.adapted import AdaptedLinears
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine
from whale.engine.packed import PackedLinears

PACKS = [None] + ([torch.bfloat16] if packed.available() else [])


def _adapted_model(seed=0, **lora):
    """Two bf16 Linears (576 -> 1536 -> 576, SmolLM2's MLP shapes) under a LoRA adapter whose B is
    not zero, its update a few percent of the output (as after some training)."""
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False))
    base = base.to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["0", "1"], **lora)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0, 0.02 if "lora_A" in name else 0.004)
    return model


def _layers(model):
    return [m for m in model.modules() if type(m) is adapted.lora_linear_type()]


def _float64(layer, x):
    """The layer's exact output, base(x) + s B A x, in float64."""
    name = layer.active_adapters[0]
    w, a, b = (t.weight.double() for t in (layer.base_layer, layer.lora_A[name], layer.lora_B[name]))
    x = x.double()
    return x @ w.T + layer.scaling[name] * (x @ a.T) @ b.T


@pytest.mark.parametrize("pack_dtype", PACKS)
@pytest.mark.parametrize("rows", [3, 300])
def test_a_lora_layer_is_one_joined_gemm_as_accurate_as_peft(pack_dtype, rows):
    model = _adapted_model()
    layer = _layers(model)[0]
    adapted_linears = AdaptedLinears(torch.bfloat16, PackedLinears() if pack_dtype else None)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with torch.no_grad():
        peft_out = layer(x)
        with adapted_linears.installed(model):
            assert all("forward" in m.__dict__ for m in _layers(model))
            out = layer(x)
        assert not any("forward" in m.__dict__ for m in _layers(model))  # as before afterwards
        assert torch.equal(layer(x), peft_out)
    assert adapted_linears.builds == 2  # both layers joined, once
    exact = _float64(layer, x)
    ulp = 2.0 ** -8 * exact.pow(2).mean(-1, keepdim=True).sqrt()  # an output's typical bf16 ulp
    ours, theirs = ((o.double() - exact).abs() / ulp for o in (out, peft_out))
    assert not torch.equal(out, peft_out)  # not peft's bits: the update is added before rounding
    assert ours.max() < 8 and ours.mean() <= theirs.mean()


@pytest.mark.skipif(not packed.available(), reason="this CPU's oneDNN has no bf16 packs")
def test_a_packed_joined_layer_keeps_no_plain_copy():
    """Where [W | s B] is packed, the pack serves every width and the plain copy is freed: the
    adapter costs its pack and the rank-r copies, not a second plain copy of W."""
    model = _adapted_model()
    adapted_linears = AdaptedLinears(torch.bfloat16, PackedLinears())
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad(), adapted_linears.installed(model):
        wide = _layers(model)[0](x)  # a prefill width, past packed.MAX_ROWS
    plain_w = sum(m.base_layer.weight.nbytes for m in _layers(model))
    assert 0 < adapted_linears.nbytes < plain_w / 10  # the rank-r copies only
    assert adapted_linears.packs.nbytes >= plain_w  # the packs of [W | s B] hold the weights
    exact = _float64(_layers(model)[0], x)
    ulp = 2.0 ** -8 * exact.pow(2).mean(-1, keepdim=True).sqrt()
    assert ((wide.double() - exact).abs() / ulp).max() < 8


def test_the_joined_weight_follows_an_optimizer_step():
    model = _adapted_model()
    layer = _layers(model)[0]
    adapted_linears = AdaptedLinears(torch.bfloat16, None)
    x = torch.randn(4, 576).to(torch.bfloat16)
    with torch.no_grad():
        with adapted_linears.installed(model):
            before = layer(x)
        layer.lora_B["default"].weight.mul_(3)  # in place, as the trainer's optimizer does
        with adapted_linears.installed(model):
            after = layer(x)
    assert adapted_linears.builds == 3  # two layers, then the changed one again
    ulp = 2.0 ** -8 * _float64(layer, x).pow(2).mean(-1, keepdim=True).sqrt()
    assert not torch.equal(before, after) and ((after.double() - _float64(layer, x)).abs() / ulp).max() < 8


def test_other_layers_and_forwards_keep_peft_forward():
    x = torch.randn(4, 576).to(torch.bfloat16)
    adapted_linears = AdaptedLinears(torch.bfloat16, None)
    model = _adapted_model()
    with torch.no_grad():
        with model.disable_adapter(), adapted_linears.installed(model):
            assert not any("forward" in m.__dict__ for m in _layers(model))
        with adapted_linears.installed(model):  # gradients on (training): peft's forward, its bits
            with torch.enable_grad():
                got = _layers(model)[0](x)
        assert torch.equal(got, _layers(model)[0](x))
    dora = _adapted_model(use_dora=True)
    dropout = _adapted_model(lora_dropout=0.1).train()
    for other in (dora, dropout):
        with torch.no_grad(), adapted_linears.installed(other):
            assert not any("forward" in m.__dict__ for m in _layers(other))
    with torch.no_grad():
        with adapted_linears.installed(model):
            assert adapted_linears.builds == 2


def test_the_engine_generates_on_joined_weights_and_rebuilds_after_a_new_adapter(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    def save(out, seed):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        get_peft_model(base, LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
                                        init_lora_weights=False)).save_pretrained(out)
        return str(out)

    eng = HFEngine(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    user = [{"role": "user", "content": "What is the capital of France?"}]
    request = GenerationRequest(user, seed=3, max_tokens=12)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    try:
        base = eng.generate([request], greedy)[0][0]
        eng.load_weights(save(tmp_path / "a1", 1), "v1")
        first = eng.generate([request], greedy)[0][0]
        builds = eng.adapted_linears.builds
        assert builds == 3 * len(eng.model.base_model.model.model.layers)  # q, v, down of every layer
        eng.load_weights(save(tmp_path / "a2", 2), "v2")  # copied into the same tensors: rebuilt
        second = eng.generate([request], greedy)[0][0]
        assert eng.adapted_linears.builds == 2 * builds
        assert len({tuple(g.completion_ids) for g in (base, first, second)}) == 3
    finally:
        eng.close()


def test_the_walks_find_what_modules_finds():
    model = _adapted_model()
    shared = torch.nn.Linear(4, 4)
    model.base_model.model.add_module("again", torch.nn.Sequential(shared, shared))  # one module reached twice
    everything = list(model.modules())
    walked = packed.walk_modules(model)
    assert len(walked) == len(everything) and {id(m) for m in walked} == {id(m) for m in everything}
    lora_type = adapted.lora_linear_type()
    assert adapted._lora_layers(model, lora_type) and (
        {id(m) for m in adapted._lora_layers(model, lora_type)} == {id(m) for m in everything if type(m) is lora_type})


def test_float32_layers_add_the_update_without_a_joined_copy():
    model = _adapted_model().float()
    layer = _layers(model)[0]
    adapted_linears = AdaptedLinears(torch.float32, None)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        peft_out = layer(x)
        with adapted_linears.installed(model):
            out = layer(x)
    exact = _float64(layer, x)
    assert ((out.double() - exact).abs().max() / exact.abs().max()) < 1e-5
    assert (out - peft_out).abs().max() < 1e-4
    base_bytes = layer.base_layer.weight.nbytes
    assert adapted_linears.nbytes < base_bytes / 10  # s B only, not a second W
