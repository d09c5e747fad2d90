"""The KV slab (engine/kv.py): it grows a layer at a time, never holding two slabs, and keeps its
storage across clears on CPU with the shapes and samples of a fresh slab."""

import weakref

import torch

from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine
from whale.engine.kv import KVSlab
from tests.test_engine_batching import wait_for

GROWTH = [(3, 40), (5, 40), (9, 70), (9, 130), (14, 130)]  # (rows, cols) a batch asks for, in order
SAMPLE = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=20)
PROMPTS = [[{"role": "user", "content": f"Name a city in country number {i}."}] for i in range(5)]
DIRT = [[{"role": "user", "content": "def run(env, llm): return 2 + 3 " * (4 + i)}] for i in range(5)]


def whole(slab: KVSlab) -> torch.Tensor:
    """The slab as one tensor [layers, 2, rows, heads, cols, dim] (a copy)."""
    return torch.stack(slab.layers)


def value(layer: int, step: int, cols: int) -> torch.Tensor:
    """What `grow` writes in a row's columns: distinct per layer, step and column (exact in float32)."""
    return 10_000.0 * layer + 1_000.0 * (step + 1) + torch.arange(cols)


def grow(slab: KVSlab) -> list[tuple]:
    """Run GROWTH on `slab`, writing a row's worth of distinct values at each step; the shapes it took."""
    slab.layer(0, torch.zeros(1, 2, 1, 8))  # the first keys fix (heads, dim, dtype)
    shapes = []
    for step, (rows, cols) in enumerate(GROWTH):
        slab.reserve(rows, cols)
        for index, kv in enumerate(slab.layers):
            kv[:, rows - 1, :, :cols] = value(index, step, cols).unsqueeze(-1)
        shapes.append(tuple(whole(slab).shape))
    return shapes


def test_cleared_slab_reuses_its_storage_with_the_shapes_of_a_fresh_one():
    fresh, kept = KVSlab(2, torch.device("cpu"), keep_storage=False), KVSlab(2, torch.device("cpu"))
    assert kept.keep_storage  # the default on CPU
    reference = grow(fresh)
    assert grow(kept) == reference
    before = whole(kept)
    assert torch.equal(before[:, :, 13], whole(fresh)[:, :, 13])  # what each growth copied is the same
    last = {rows: step for step, (rows, _) in enumerate(GROWTH)}
    for step, (rows, cols) in enumerate(GROWTH):  # each row's last write survives the growths after it
        if last[rows] == step:
            assert torch.equal(before[1, 0, rows - 1, 0, :cols, 0], value(1, step, cols))
    buffers = {id(b) for b in kept.buffers}
    grown = kept.fresh_bytes
    assert fresh.fresh_bytes == grown  # as much new memory as a fresh slab, growing from empty
    assert len(buffers) == 2  # one per layer
    kept.clear()
    assert kept.layers is None and kept.rows == kept.cols == 0 and len(kept.buffers) == 2
    assert grow(kept) == reference  # the same shapes from empty, after the clear
    assert {id(b) for b in kept.buffers} == buffers  # and no new memory
    assert kept.fresh_bytes == grown and kept.fresh_seconds > 0  # counted as none either
    # the values a batch wrote are there; stale ones from the last batch are finite, never NaN
    assert torch.equal(whole(kept)[:, :, 13, :, :130], before[:, :, 13, :, :130])
    assert all(torch.isfinite(b).all() for b in kept.buffers)
    fresh.clear()
    assert fresh.buffers == [] and fresh.layers is None
    kept.release()
    assert kept.buffers == [] and kept.storage_bytes == 0


def test_a_growth_holds_the_slab_and_one_layer_never_two_slabs():
    """Growing re-lays each layer inside its buffer, or moves it to a larger one a layer at a time:
    the storage held stays within the slab plus one layer (a one-tensor slab held two slabs)."""
    n_layers = 6
    slab = KVSlab(n_layers, torch.device("cpu"))
    grow(slab)
    layer_bytes = slab.nbytes // n_layers
    assert slab.storage_bytes <= slab.nbytes + layer_bytes
    peak = []
    real_zeros = slab._zeros
    replaced = [weakref.ref(b) for b in slab.buffers]  # freed once copied, unless something holds them

    def zeros(numel, dtype):  # the storage held at every new allocation, the new one included
        out = real_zeros(numel, dtype)
        held = slab.buffers + [out] + [b for b in (r() for r in replaced)
                                       if b is not None and all(b is not k for k in slab.buffers)]
        peak.append(sum(b.numel() * b.element_size() for b in held))
        return out

    slab._zeros = zeros
    slab.reserve(40, 300)  # larger than anything before: new memory, the live data copied over
    assert peak and max(peak) <= slab.nbytes + slab.nbytes // n_layers
    assert torch.equal(slab.layers[3][0, 13, 0, :130, 0], value(3, len(GROWTH) - 1, 130))
    assert len(slab.buffers) == n_layers
    slab.clear()
    slab.reserve(8, 600)  # other shapes within the buffers' room: re-laid in place, no new memory
    fresh = slab.fresh_bytes
    slab.layers[2][1, 7, 1, 599, 3] = 7.0
    slab.reserve(12, 600)
    assert slab.fresh_bytes == fresh and float(slab.layers[2][1, 7, 1, 599, 3]) == 7.0
    assert tuple(slab.layers[2].shape) == (2, 12, 2, 640, 8)


def run(engine, prompts):
    requests = [GenerationRequest(m, seed=100 + i, n=2) for i, m in enumerate(prompts)]
    return [[g.completion_ids for g in gens] for gens in engine.generate(requests, SAMPLE)]


def test_kept_storage_changes_no_sample(tiny_model_dir):
    """Stale values in reused storage sit in masked columns: the same calls sample the same ids as
    on an engine that starts every batch on zeroed memory."""
    kept = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=256, max_batch_size=4)
    zeroed = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=256, max_batch_size=4)
    zeroed.scheduler.slab.keep_storage = False
    try:
        first = run(kept, PROMPTS)
        run(kept, DIRT)  # longer prompts: the storage now holds their keys and values
        assert kept.scheduler.slab.buffers
        fresh_bytes = kept.stats["slab_fresh_bytes"]
        assert run(kept, PROMPTS) == first == run(zeroed, PROMPTS)
        assert kept.stats["slab_fresh_bytes"] == fresh_bytes > 0  # the shorter batch needed no new storage
        wait_for(lambda: zeroed.scheduler.slab.buffers == [])  # idle: a slab without kept storage frees it
    finally:
        kept.close()
        zeroed.close()
    assert kept.scheduler.slab.buffers == []  # closing frees the kept storage


def test_a_bounded_slab_grows_only_to_what_is_asked_and_keeps_at_most_its_bound():
    col_bytes = 2 * 2 * 2 * 8 * 4  # layers x (keys, values) x heads x dim x float32
    bound = 10 * 64 * col_bytes
    shapes = {}
    for name, slab in (("bounded", KVSlab(2, torch.device("cpu"), max_bytes=bound)),
                       ("unbounded", KVSlab(2, torch.device("cpu")))):
        slab.layer(0, torch.zeros(1, 2, 1, 8))
        slab.reserve(8, 40)
        slab.layers[1][:, 7, :, :40] = 1.0
        slab.reserve(9, 40)  # by half: 12 rows, past the bound
        shapes[name] = tuple(whole(slab).shape)
        if name == "bounded":
            assert slab.nbytes <= bound and float(slab.layers[1][1, 7, 1, 39, 7]) == 1.0  # copied over
            assert slab.storage_bytes <= bound + bound // 2  # the slab and one layer's scratch
            slab.clear()
            assert 0 < slab.storage_bytes <= bound + bound // 2  # between batches: buffers that fit the bound
            slab.reserve(30, 200)  # a single ask past the bound still gets its room
            assert whole(slab).shape[2] == 30 and whole(slab).shape[4] == 256
            slab.clear()
            assert slab.storage_bytes == 0  # buffers past the bound are not kept
    assert shapes == {"bounded": (2, 2, 9, 2, 64, 8), "unbounded": (2, 2, 12, 2, 64, 8)}


def test_spare_rows_of_a_narrower_batch_give_way_to_columns_within_the_bound():
    """Many short rows, then a few long ones: the rows not in use go, so the slab stays within its
    bound (it used to keep the spare rows and grow the columns under them: 48 rows of short prompts
    then 19 long ones held 2.5x the demo's bound in float32)."""
    col_bytes = 2 * 2 * 2 * 8 * 4  # layers x (keys, values) x heads x dim x float32
    bound = 12 * 128 * col_bytes
    slab = KVSlab(2, torch.device("cpu"), max_bytes=bound)
    slab.layer(0, torch.zeros(1, 2, 1, 8))
    slab.reserve(12, 100)  # 12 rows x 128 columns: the bound
    slab.layers[1][:, 2, :, :100] = 1.0  # row 2 stays in use, rows 3-11 have left
    slab.reserve(3, 500)  # 3 rows of 512 columns fit the bound; 12 rows of 512 would be 4x it
    assert whole(slab).shape[2] == 3 and whole(slab).shape[4] == 512
    assert slab.nbytes <= bound and slab.storage_bytes <= bound + bound // 2
    assert float(slab.layers[1][1, 2, 1, 99, 7]) == 1.0  # the row in use was copied over
