"""engine/packed.py: Linear layers on MKL-packed weights (float32, CPU): right values, each row's
bits independent of its batch-mates, repacked when weights change, plain where it does not apply."""

import pytest
import torch

from whale.engine import packed
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no MKL packed sgemm")

SHAPES = [(1536, 576), (576, 1536), (192, 576), (384, 32)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_packed_matmul_is_x_times_weight_transposed(out_features, in_features):
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    pack = packed.pack_weight(weight)
    for rows in (1, 2, 3, 4, 7, 15, 16, 17, 33, 64, 200):
        x = torch.randn(rows, in_features, generator=gen)
        torch.testing.assert_close(packed.packed_matmul(x, pack, out_features), x @ weight.T, rtol=1e-5, atol=1e-4)
    x3 = torch.randn(3, 5, in_features, generator=gen)  # [batch, seq, in] as the model passes it
    torch.testing.assert_close(packed.packed_matmul(x3, pack, out_features), x3 @ weight.T, rtol=1e-5, atol=1e-4)
    assert packed.packed_matmul(x[:0], pack, out_features).shape == (0, out_features)


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_a_rows_bits_do_not_depend_on_its_batch_mates(out_features, in_features):
    """The property the engine's per-row seeds want: row i of an m-row product has the same bits
    for every m (plain sgemm switches kernels under 16 rows, whose bits differ)."""
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    pack = packed.pack_weight(weight)
    x = torch.randn(packed.MAX_ROWS, in_features, generator=gen)
    full = packed.packed_matmul(x, pack, out_features)
    for rows in range(1, packed.MAX_ROWS + 1):
        assert torch.equal(packed.packed_matmul(x[:rows], pack, out_features), full[:rows]), rows
        assert torch.equal(packed.packed_matmul(x[rows - 1 : rows], pack, out_features), full[rows - 1 : rows]), rows


def test_installed_routes_linears_and_restores_them():
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 32, bias=True),
                                torch.nn.Linear(32, 16, bias=False))
    packs = packed.PackedLinears(min_weight_numel=0)
    x = torch.randn(5, 64)
    with torch.no_grad():
        want = model(x)
        with packs.installed(model):
            assert all("forward" in m.__dict__ for m in model)
            got = model(x)
        assert not any("forward" in m.__dict__ for m in model)
    torch.testing.assert_close(got, want)
    assert packs.packed_weights == 2  # the bias-free layers; the biased one runs nn.Linear's own forward
    with torch.no_grad(), packs.installed(model):
        model(x)
    assert packs.packed_weights == 2  # packed once, reused


def test_a_weight_changed_in_place_or_swapped_is_packed_again():
    lin = torch.nn.Linear(64, 128, bias=False)
    packs = packed.PackedLinears(min_weight_numel=0)
    x = torch.randn(4, 64)
    with torch.no_grad(), packs.installed(torch.nn.Sequential(lin)):
        before = lin(x)
        lin.weight.mul_(2)  # an optimizer step, a merged adapter
        torch.testing.assert_close(lin(x), 2 * before)
        lin.weight = torch.nn.Parameter(torch.zeros(128, 64))  # load_weights swapping tensors
        assert torch.count_nonzero(lin(x)) == 0
    assert packs.packed_weights == 3


def test_plain_path_where_packing_does_not_apply():
    lin = torch.nn.Linear(64, 128, bias=False)
    packs = packed.PackedLinears(min_weight_numel=0)
    with packs.installed(torch.nn.Sequential(lin)):
        y = lin(torch.randn(4, 64))  # gradients on: the trainer's forward
        assert y.grad_fn is not None
        with torch.no_grad():
            lin(torch.randn(packed.MAX_ROWS + 1, 64))  # wider than MAX_ROWS: plain sgemm
            lin.to(torch.bfloat16)(torch.randn(4, 64, dtype=torch.bfloat16))
    assert packs.packed_weights == 0


def test_engine_samples_the_same_with_and_without_packed_weights(tiny_model_dir):
    """On the tiny model every Linear is packed (the default skips matrices this small): the same
    tokens as plain sgemm, with the packs made once per weight."""
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=16)
    user = [{"role": "user", "content": "What is the capital of France?"}]
    other = [{"role": "user", "content": "def run(env, llm): return 2 + 3 " * 6}]
    reqs = [GenerationRequest(other, seed=i, max_tokens=6 + 3 * i) for i in range(6)] + [
        GenerationRequest(user, seed=11, max_tokens=24, n=3),
        GenerationRequest(user, choices=["Paris", "Nairobi", "e2e4"], seed=7, n=2)]
    got = {}
    for on in (False, True):
        eng = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=256, max_batch_size=4,
                       packed_gemm=on)
        try:
            if on:
                assert eng.packed_linears is not None
                eng.packed_linears.min_weight_numel = 0
            got[on] = [[g.completion_ids for g in gens] for gens in eng.generate(reqs, sampling)]
            if on:
                n_linears = sum(1 for m in eng.model.modules() if type(m) is torch.nn.Linear)
                assert eng.packed_linears.packed_weights == n_linears
        finally:
            eng.close()
    assert got[True] == got[False]


def test_engine_packs_float32_and_bfloat16_on_cpu_only(tiny_model_dir):
    for dtype, packs in (("float16", False), ("bfloat16", packed.available(torch.bfloat16)), ("float32", True)):
        eng = HFEngine(str(tiny_model_dir), dtype=dtype, device="cpu", max_model_len=64)
        try:
            assert (eng.packed_linears is not None) == packs, dtype
        finally:
            eng.close()
        eng = HFEngine(str(tiny_model_dir), dtype=dtype, device="cpu", max_model_len=64, packed_gemm=False)
        try:
            assert eng.packed_linears is None
        finally:
            eng.close()


def test_packs_stop_at_their_memory_budget():
    """Past `max_bytes` a layer keeps plain sgemm (a model larger than the budget still runs)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    packs = packed.PackedLinears(min_weight_numel=0, max_bytes=2 * 64 * 64 * 4 + 4096)  # room for about two
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = model(x)
        with packs.installed(model):
            got = model(x)
    torch.testing.assert_close(got, want)
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
