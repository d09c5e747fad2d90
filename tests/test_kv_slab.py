"""The KV slab keeps its storage across clears on CPU (engine/kv.py): same shapes, same samples."""

import torch

from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine
from whale.engine.kv import KVSlab

GROWTH = [(3, 40), (5, 40), (9, 70), (9, 130), (14, 130)]  # (rows, cols) a batch asks for, in order
SAMPLE = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=20)
PROMPTS = [[{"role": "user", "content": f"Name a city in country number {i}."}] for i in range(5)]
DIRT = [[{"role": "user", "content": "def run(env, llm): return 2 + 3 " * (4 + i)}] for i in range(5)]


def grow(slab: KVSlab) -> list[tuple]:
    """Run GROWTH on `slab`, writing a row's worth of values at each step; the shapes it took."""
    slab.layer(0, torch.zeros(1, 2, 1, 8))  # the first keys fix (heads, dim, dtype)
    shapes = []
    for step, (rows, cols) in enumerate(GROWTH):
        slab.reserve(rows, cols)
        slab.data[:, :, rows - 1, :, :cols] = step + 1.0
        shapes.append(tuple(slab.data.shape))
    return shapes


def test_cleared_slab_reuses_its_storage_with_the_shapes_of_a_fresh_one():
    fresh, kept = KVSlab(2, torch.device("cpu"), keep_storage=False), KVSlab(2, torch.device("cpu"))
    assert kept.keep_storage  # the default on CPU
    reference = grow(fresh)
    assert grow(kept) == reference
    before = kept.data.clone()
    assert torch.equal(before, fresh.data)  # what each growth copied is the same
    buffers = {id(b) for b in kept.buffers}
    grown = kept.fresh_bytes  # every growth zeroed new storage: the sum of the buffers made, dropped ones too
    assert grown > kept.storage_bytes and fresh.fresh_bytes == grown  # as many as a fresh slab, growing from empty
    assert len(buffers) == 2 and kept.storage_bytes >= kept.nbytes
    kept.clear()
    assert kept.data is None and kept.rows == kept.cols == 0 and len(kept.buffers) == 2
    assert grow(kept) == reference  # the same shapes from empty, after the clear
    assert {id(b) for b in kept.buffers} == buffers  # and no new memory
    assert kept.fresh_bytes == grown and kept.fresh_seconds > 0  # counted as none either
    # the values a batch wrote are there; stale ones from the last batch are finite, never NaN
    assert torch.equal(kept.data[:, :, 13, :, :130], before[:, :, 13, :, :130])
    assert torch.isfinite(kept.data).all()
    fresh.clear()
    assert fresh.buffers == [] and fresh.data is None
    kept.release()
    assert kept.buffers == [] and kept.storage_bytes == 0


def test_a_bigger_slab_replaces_the_smaller_free_buffer_and_two_at_most_are_kept():
    slab = KVSlab(2, torch.device("cpu"))
    grow(slab)
    slab.reserve(40, 300)  # larger than anything before: new memory, the live data copied over
    assert len(slab.buffers) == 2
    assert float(slab.data[0, 0, 13, 0, 0, 0]) == len(GROWTH)
    assert slab.storage_bytes < 3 * slab.nbytes


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
        assert zeroed.scheduler.slab.buffers == []
    finally:
        kept.close()
        zeroed.close()
    assert kept.scheduler.slab.buffers == []  # closing frees the kept storage


def test_new_storage_stops_once_both_buffers_reach_the_largest_slab():
    """Batches whose last growth asks a little more or less than before (as free-running batches
    do, run to run) reuse the kept buffers: a new one is made as large as the largest kept."""
    slab = KVSlab(2, torch.device("cpu"))
    made = []
    for final_rows in (40, 38, 39, 37, 40):
        slab.clear()
        grow(slab)
        slab.reserve(final_rows, 300)
        made.append(slab.fresh_bytes)
    assert made[1] > made[0]  # the second batch needed the second buffer at the largest size
    assert made[-1] == made[1]  # and none after it, though each batch's last growth differed
    assert len(slab.buffers) == 2


def test_a_bounded_slab_grows_only_to_what_is_asked_and_keeps_at_most_its_bound():
    col_bytes = 2 * 2 * 2 * 8 * 4  # layers x (keys, values) x heads x dim x float32
    bound = 10 * 64 * col_bytes
    shapes = {}
    for name, slab in (("bounded", KVSlab(2, torch.device("cpu"), max_bytes=bound)),
                       ("unbounded", KVSlab(2, torch.device("cpu")))):
        slab.layer(0, torch.zeros(1, 2, 1, 8))
        slab.reserve(8, 40)
        slab.data[:, :, 7, :, :40] = 1.0
        slab.reserve(9, 40)  # by half: 12 rows, past the bound
        shapes[name] = tuple(slab.data.shape)
        if name == "bounded":
            assert slab.nbytes <= bound and float(slab.data[1, 1, 7, 1, 39, 7]) == 1.0  # copied over
            assert slab.storage_bytes > bound  # while in use: the slab and the buffer it grew from
            slab.clear()
            assert 0 < slab.storage_bytes <= bound  # between batches: only what fits the bound
            slab.reserve(30, 200)  # a single ask past the bound still gets its room
            assert slab.data.shape[2] == 30 and slab.data.shape[4] == 256
    assert shapes == {"bounded": (2, 2, 9, 2, 64, 8), "unbounded": (2, 2, 12, 2, 64, 8)}
