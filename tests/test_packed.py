"""engine/packed.py: oneDNN-packed bf16 Linear weights give the plain `F.linear` bits, a weight
whose pack would not is kept on the plain path, packs follow weight changes and a memory budget,
and the engine samples the same ids."""

import pytest
import torch

from whale.engine import packed
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch's oneDNN does no bf16")

SHAPES = [(1536, 576), (576, 1536), (192, 576), (576, 576)]  # SmolLM2-135M's Linear shapes but lm_head


def _weight(out_features, in_features, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_a_pack_gives_the_plain_bits_at_every_decode_width(out_features, in_features):
    """The pack is checked at a few row counts when made; this checks every count the engine uses."""
    weight = _weight(out_features, in_features, out_features + in_features)
    pack = packed.pack_weight(weight)
    if pack is None:
        pytest.skip("oneDNN's packed bf16 products differ from F.linear's on this CPU: the weight stays plain")
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, packed.MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        assert torch.equal(packed.packed_matmul(x, pack), torch.nn.functional.linear(x, weight)), rows
    x3 = torch.randn(2, 9, in_features, generator=gen).to(torch.bfloat16)[:, 3:7]  # [batch, seq, in], a strided view
    assert torch.equal(packed.packed_matmul(x3, pack), torch.nn.functional.linear(x3, weight))


def test_a_weight_whose_pack_changes_bits_runs_plain(monkeypatch):
    lin = torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    real = packed.packed_matmul
    monkeypatch.setattr(packed, "packed_matmul", lambda x, pack: real(x, pack) * 1.01)
    packs = packed.PackedLinears(min_weight_numel=0)
    x = torch.randn(4, 576).to(torch.bfloat16)
    with torch.no_grad(), packs.installed(torch.nn.Sequential(lin)):
        got = lin(x)
        lin(x)
    assert torch.equal(got, torch.nn.functional.linear(x, lin.weight))
    assert (packs.packed_weights, packs.plain_weights, packs.nbytes) == (0, 1, 0)  # checked once, remembered


def test_packed_forwards_equal_plain_ones_and_repack_after_a_change():
    model = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False))
    model = model.to(torch.bfloat16)
    packs = packed.PackedLinears()
    x = torch.randn(2, 7, 576).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        with packs.installed(model):
            got = model(x)
            model[0].weight.mul_(2)  # an optimizer step, a merged adapter
            after = model(x)
        want_after = model(x)
    assert torch.equal(got, want) and torch.equal(after, want_after)
    assert packs.packed_weights + packs.plain_weights == 3  # two, and the changed one again


def test_installed_routes_linears_and_restores_them():
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 32, bias=True),
                                torch.nn.Linear(32, 16, bias=False)).to(torch.bfloat16)
    packs = packed.PackedLinears(min_weight_numel=0)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        with packs.installed(model):
            assert all("forward" in m.__dict__ for m in model)
            got = model(x)
        assert not any("forward" in m.__dict__ for m in model)
    assert torch.equal(got, want)
    assert packs.packed_weights + packs.plain_weights == 2  # the bias-free layers; the biased one runs nn.Linear's
    with torch.no_grad(), packs.installed(model):
        model(x)
    assert packs.packed_weights + packs.plain_weights == 2  # packed once, reused


def test_plain_path_where_packing_does_not_apply():
    lin = torch.nn.Linear(64, 128, bias=False).to(torch.bfloat16)
    packs = packed.PackedLinears(min_weight_numel=0)
    with packs.installed(torch.nn.Sequential(lin)):
        y = lin(torch.randn(4, 64).to(torch.bfloat16))  # gradients on: the trainer's forward
        assert y.grad_fn is not None
        with torch.no_grad():
            lin(torch.randn(packed.MAX_ROWS + 1, 64).to(torch.bfloat16))  # wider than MAX_ROWS: plain
            lin.float()(torch.randn(4, 64))  # float32: plain
    assert packs.packed_weights + packs.plain_weights == 0


def test_packs_stop_at_their_memory_budget():
    """Past `max_bytes` a layer keeps the plain GEMM (a model larger than the budget still runs)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)]).to(torch.bfloat16)
    packs = packed.PackedLinears(min_weight_numel=0, max_bytes=2 * 64 * 64 * 2 + 1024)  # room for two
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        with packs.installed(model):
            got = model(x)
    assert torch.equal(got, want)
    assert 1 <= packs.packed_weights <= 2
    assert packs.nbytes <= packs.max_bytes


def test_a_forward_replaced_by_someone_else_is_left_alone():
    lin = torch.nn.Linear(64, 64, bias=False)
    theirs = lambda x: x + 1  # noqa: E731 - e.g. an accelerate hook installed on the instance
    lin.forward = theirs
    packs = packed.PackedLinears(min_weight_numel=0)
    with torch.no_grad(), packs.installed(torch.nn.Sequential(lin)):
        assert torch.equal(lin(torch.zeros(2, 64)), torch.ones(2, 64))
    assert lin.forward is theirs and packs.packed_weights == 0


def test_engine_samples_the_same_ids_with_and_without_bf16_packs(tiny_model_dir):
    """On the tiny model every Linear is packed (the default skips matrices this small)."""
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=16)
    user = [{"role": "user", "content": "What is the capital of France?"}]
    other = [{"role": "user", "content": "def run(env, llm): return 2 + 3 " * 6}]
    reqs = [GenerationRequest(other, seed=i, max_tokens=6 + 3 * i) for i in range(6)] + [
        GenerationRequest(user, seed=11, max_tokens=24, n=3),
        GenerationRequest(user, choices=["Paris", "Nairobi", "e2e4"], seed=7, n=2)]
    got = {}
    for on in (False, True):
        eng = HFEngine(str(tiny_model_dir), dtype="bfloat16", device="cpu", max_model_len=256, max_batch_size=4)
        try:
            if on:
                eng.packed_linears.min_weight_numel = 0
            else:
                eng.packed_linears = None
            got[on] = [[g.completion_ids for g in gens] for gens in eng.generate(reqs, sampling)]
            if on:
                n_linears = sum(1 for m in eng.model.modules() if type(m) is torch.nn.Linear)
                assert eng.packed_linears.packed_weights + eng.packed_linears.plain_weights == n_linears
        finally:
            eng.close()
    assert got[True] == got[False]


def test_engine_packs_bfloat16_on_cpu_only(tiny_model_dir):
    for dtype, packs in (("float16", False), ("bfloat16", True), ("float32", False)):
        eng = HFEngine(str(tiny_model_dir), dtype=dtype, device="cpu", max_model_len=64)
        try:
            assert (eng.packed_linears is not None) == packs, dtype
        finally:
            eng.close()
