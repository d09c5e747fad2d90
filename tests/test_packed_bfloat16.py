"""engine/packed.py in bfloat16: oneDNN-packed Linear weights give the plain `F.linear` bits, a
weight whose pack would not is kept on the plain path, and the engine samples the same ids."""

import pytest
import torch

from whale.engine import packed
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine

pytestmark = pytest.mark.skipif(not packed.available(torch.bfloat16), reason="this torch's oneDNN does no bf16")

SHAPES = [(1536, 576), (576, 1536), (192, 576), (576, 576)]  # SmolLM2-135M's Linear shapes but lm_head


def _weight(out_features, in_features, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_a_pack_gives_the_plain_bits_at_every_decode_width(out_features, in_features):
    """The pack is checked at a few row counts when made; this checks every count the engine uses."""
    weight = _weight(out_features, in_features, out_features + in_features)
    pack = packed.pack_bfloat16_weight(weight)
    if pack is None:
        pytest.skip("oneDNN's packed bf16 products differ from F.linear's on this CPU: the weight stays plain")
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, packed.MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        assert torch.equal(packed.bfloat16_packed_matmul(x, pack), torch.nn.functional.linear(x, weight)), rows
    x3 = torch.randn(2, 9, in_features, generator=gen).to(torch.bfloat16)[:, 3:7]  # [batch, seq, in], a strided view
    assert torch.equal(packed.bfloat16_packed_matmul(x3, pack), torch.nn.functional.linear(x3, weight))


def test_a_weight_whose_pack_changes_bits_runs_plain(monkeypatch):
    lin = torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    real = packed.bfloat16_packed_matmul
    monkeypatch.setattr(packed, "bfloat16_packed_matmul", lambda x, pack, n=None: real(x, pack) * 1.01)
    packs = packed.PackedLinears(torch.bfloat16, min_weight_numel=0)
    x = torch.randn(4, 576).to(torch.bfloat16)
    with torch.no_grad(), packs.installed(torch.nn.Sequential(lin)):
        got = lin(x)
        lin(x)
    assert torch.equal(got, torch.nn.functional.linear(x, lin.weight))
    assert (packs.packed_weights, packs.plain_weights, packs.nbytes) == (0, 1, 0)  # checked once, remembered


def test_wider_forwards_use_the_pack_only_at_widths_checked_to_give_the_plain_bits(monkeypatch):
    """Prefill widths (past MAX_ROWS) take the pack once a check at that width, weight shape and
    thread count gave the plain bits; a width where it would not keeps the plain path."""
    lin = torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    packs = packed.PackedLinears(torch.bfloat16, min_weight_numel=0)
    wide, wider = packed.MAX_ROWS + 37, packed.MAX_ROWS + 200
    real = packed.bfloat16_packed_matmul
    calls = []

    def counted(x, pack, n=None):  # the product at `wider` rows is off by a factor: not the plain bits
        calls.append(x.numel() // x.shape[-1])
        return real(x, pack) * (1.01 if calls[-1] == wider else 1)

    monkeypatch.setattr(packed, "bfloat16_packed_matmul", counted)  # in the pack's own check
    packs._kind = packs._kind._replace(matmul=counted)  # in the forwards and the wide checks
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad(), packs.installed(torch.nn.Sequential(lin)):
        for rows in (wide, wide, wider, wider, packed.WIDE_MAX_ROWS + 1):
            x = torch.randn(1, rows, 576, generator=gen).to(torch.bfloat16)
            assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight)), rows
    assert packs.wide_widths == (1, 1)  # `wide` checked and packed, `wider` checked and kept plain
    # the pack's own check (decode widths); each wide width's first forward is its check (the plain
    # product served), then `wide` is served packed and `wider` plain
    assert calls == list(packed.BITS_CHECK_ROWS) + [wide, wide, wider]


def test_packed_forwards_equal_plain_ones_and_repack_after_a_change():
    model = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False))
    model = model.to(torch.bfloat16)
    packs = packed.PackedLinears(torch.bfloat16)
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
    float_packs = packed.PackedLinears(torch.float32)
    with torch.no_grad(), float_packs.installed(model):
        assert torch.equal(model(x), want_after)  # another dtype's packs leave bf16 layers plain
    assert float_packs.packed_weights == 0


def test_engine_samples_the_same_ids_with_and_without_bf16_packs(tiny_model_dir):
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=16)
    user = [{"role": "user", "content": "What is the capital of France?"}]
    other = [{"role": "user", "content": "def run(env, llm): return 2 + 3 " * 6}]
    reqs = [GenerationRequest(other, seed=i, max_tokens=6 + 3 * i) for i in range(6)] + [
        GenerationRequest(user, seed=11, max_tokens=24, n=3),
        GenerationRequest(user, choices=["Paris", "Nairobi", "e2e4"], seed=7, n=2)]
    got = {}
    for on in (False, True):
        eng = HFEngine(str(tiny_model_dir), dtype="bfloat16", device="cpu", max_model_len=256, max_batch_size=4,
                       packed_gemm=on)
        try:
            if on:
                eng.packed_linears.min_weight_numel = 0
            got[on] = [[g.completion_ids for g in gens] for gens in eng.generate(reqs, sampling)]
            if on:
                n_linears = sum(1 for m in eng.model.modules() if type(m) is torch.nn.Linear)
                assert eng.packed_linears.packed_weights + eng.packed_linears.plain_weights == n_linears
        finally:
            eng.close()
    assert got[True] == got[False]
