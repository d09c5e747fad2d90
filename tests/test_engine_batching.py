"""HFEngine's continuous batching and prefix sharing on the tiny model: exact samples, shared KV, safe weights."""

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from whale.engine import scheduler
from whale.engine.base import GenerationRequest, SamplingParams
from whale.engine.hf import HFEngine

USER = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "system", "content": "You answer questions about capitals. " * 3},
        {"role": "user", "content": "What is the capital of Kenya? The capital of France is Paris."}]
OTHER = [{"role": "user", "content": "def run(env, llm): return 2 + 3 " * 6}]
SAMPLE = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=16)


def make(tiny_model_dir, **kw):
    kw.setdefault("max_batch_size", 4)
    return HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=256, **kw)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make(tiny_model_dir)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """No prefix cache: every prompt computed from scratch, one request at a time (the reference)."""
    eng = make(tiny_model_dir, prefix_cache_bytes=0, max_batch_size=1)
    yield eng
    eng.close()


def ids(engine, sampling=SAMPLE, **kw):
    return [g.completion_ids for g in engine.generate([GenerationRequest(**kw)], sampling)[0]]


def wait_for(condition, timeout=60.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_sample_does_not_depend_on_when_it_joined(engine, plain):
    alone = ids(plain, messages=USER, seed=11, max_tokens=24)
    steps = engine.stats["decode_steps"]
    busy = [engine.submit(GenerationRequest(m, seed=s, max_tokens=60), SAMPLE)
            for s, m in enumerate([OTHER, LONG, OTHER])]
    wait_for(lambda: engine.stats["decode_steps"] >= steps + 5)  # the batch is mid-flight
    late = engine.submit(GenerationRequest(USER, seed=11, max_tokens=24), SAMPLE)
    assert [g.completion_ids for g in late.result()] == alone
    assert not all(f.done() for f in busy)  # it joined and left while the others were still decoding
    for f in busy:
        f.result()
    # more samples than rows (4): they queue, join as rows free, and still sample the same
    many = engine.generate([GenerationRequest(OTHER, seed=i, max_tokens=8 + i) for i in range(7)]
                           + [GenerationRequest(USER, seed=11, max_tokens=24)], SAMPLE)
    assert many[-1][0].completion_ids == alone[0]


def test_k_samples_prefill_their_prompt_once(tiny_model_dir, plain):
    eng = make(tiny_model_dir, prefix_cache_bytes=0)  # sharing between rows in flight needs no cache
    try:
        before = dict(eng.stats)
        got = ids(eng, messages=LONG, seed=20, n=4)
        prompt = len(eng._prompt_ids(LONG))
        assert eng.stats["prefill_tokens_requested"] - before["prefill_tokens_requested"] == 4 * prompt
        assert eng.stats["prefill_tokens_computed"] - before["prefill_tokens_computed"] == prompt + 3
        assert got == [ids(plain, messages=LONG, seed=20 + i)[0] for i in range(4)]
    finally:
        eng.close()


def test_next_call_reuses_the_previous_call(tiny_model_dir, plain):
    eng = make(tiny_model_dir)
    try:
        first = eng.generate([GenerationRequest(LONG, seed=1, max_tokens=12)], SAMPLE)[0][0]
        follow = LONG + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Sure?"}]
        prompt = eng._prompt_ids(follow)
        seen = first.prompt_ids + first.completion_ids[:-1]  # the last sampled token was never fed
        shared = next((i for i, (a, b) in enumerate(zip(prompt, seen)) if a != b), min(len(prompt), len(seen)))
        assert shared > len(first.prompt_ids)  # the follow-up extends prompt + part of the completion
        computed = eng.stats["prefill_tokens_computed"]
        got = ids(eng, messages=follow, seed=2)
        assert eng.stats["prefill_tokens_computed"] - computed == len(prompt) - shared
        assert got == ids(plain, messages=follow, seed=2)
    finally:
        eng.close()


def test_prefix_cache_is_bounded_and_least_recently_used_goes_first(tiny_model_dir):
    eng = make(tiny_model_dir)
    per_token = None
    try:
        eng.generate([GenerationRequest(LONG, seed=0, max_tokens=4)], SAMPLE)
        entry = next(iter(eng.scheduler.prefix.entries.values()))
        per_token = entry.nbytes // len(entry.ids)
    finally:
        eng.close()
    budget = per_token * 3 * 40  # room for about three short sequences
    eng = make(tiny_model_dir, prefix_cache_bytes=budget)
    try:
        for i in range(8):
            msgs = [{"role": "user", "content": f"Question {i}: what is the capital of France? " * 2}]
            eng.generate([GenerationRequest(msgs, seed=i, max_tokens=4)], SAMPLE)
            assert eng.scheduler.prefix.bytes <= budget
        cache = eng.scheduler.prefix
        assert 1 <= len(cache) <= 3
        newest = eng.tokenizer.decode(list(cache.entries.values())[-1].ids)
        assert "Question 7" in newest and "Question 0" not in "".join(
            eng.tokenizer.decode(e.ids) for e in cache.entries.values())
    finally:
        eng.close()


def _scale_weights(model, factor):
    """In place through `.data`, which autograd's version counters do not see: only an explicit
    load_weights / serve_model can tell the engine."""
    for p in model.parameters():
        p.data.mul_(factor)


@pytest.mark.parametrize("change", ["load_weights", "optimizer_step", "serve_model"])
def test_weight_change_invalidates_shared_kv(tiny_model_dir, plain, change):
    """A KV computed under the old weights must never be reused: the prompt is computed afresh."""
    eng = make(tiny_model_dir)
    try:
        ids(eng, messages=LONG, seed=1, max_tokens=8)  # the prompt is now in the prefix cache
        assert len(eng.scheduler.prefix) == 1
        if change == "load_weights":
            _scale_weights(eng.model, 1.3)
            eng.load_weights(None, "v1")
        elif change == "optimizer_step":  # trained in place, nobody told the engine
            opt = torch.optim.SGD(eng.model.parameters(), lr=0.5)
            out = eng.model(torch.tensor([eng._prompt_ids(LONG)]))
            out.logits.float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
        else:
            from transformers import AutoModelForCausalLM

            other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
            _scale_weights(other, 0.7)
            eng.serve_model(other)
        computed = eng.stats["prefill_tokens_computed"]
        got = ids(eng, messages=LONG, seed=1, max_tokens=8)
        assert eng.stats["prefill_tokens_computed"] - computed == len(eng._prompt_ids(LONG))
        reference = make(tiny_model_dir, prefix_cache_bytes=0)
        try:
            reference.serve_model(eng.model)
            assert got == ids(reference, messages=LONG, seed=1, max_tokens=8)
        finally:
            reference.close()
    finally:
        eng.close()


def test_load_weights_waits_for_sequences_in_flight(engine):
    steps = engine.stats["decode_steps"]
    running = engine.submit(GenerationRequest(OTHER, seed=3, max_tokens=80), SAMPLE)
    wait_for(lambda: engine.stats["decode_steps"] > steps)
    engine.load_weights(None, "v-next")
    assert running.done()  # it finished first, under the weights it started with
    assert running.result()[0].weights_version == "base" and len(running.result()[0].completion_ids) > 1
    assert engine.generate([GenerationRequest(USER, seed=0, max_tokens=2)], SAMPLE)[0][0].weights_version == "v-next"
    engine.load_weights(None, "base")


def test_choices_of_many_requests_share_one_forward(tiny_model_dir, plain):
    eng = make(tiny_model_dir, prefix_cache_bytes=0)
    try:
        choices = ["Paris", "Nairobi", "e2e4", "boxed answer"]
        reqs = [GenerationRequest([{"role": "user", "content": f"Question {i}: the capital?"}], choices=choices,
                                  seed=i, n=2) for i in range(6)]
        warm = SamplingParams(temperature=3.0)
        forwards = eng.stats["prefill_forwards"]
        got = eng.generate(reqs, warm)
        assert eng.stats["prefill_forwards"] - forwards == 1
        want = [plain.generate([r], warm)[0] for r in reqs]
        assert [[g.text for g in gens] for gens in got] == [[g.text for g in gens] for gens in want]
        assert all(g.completion_ids == eng.tokenizer.encode(g.text, add_special_tokens=False)
                   for gens in got for g in gens)
    finally:
        eng.close()


def test_submit_from_many_threads(engine, plain):
    reqs = [GenerationRequest([{"role": "user", "content": f"Count to {i}."}], seed=i, max_tokens=6 + i % 5)
            for i in range(12)]
    want = [ids(plain, messages=r.messages, seed=r.seed, max_tokens=r.max_tokens) for r in reqs]
    got: list = [None] * len(reqs)

    def worker(k):
        for i in range(k, len(reqs), 3):
            got[i] = [g.completion_ids for g in engine.submit(reqs[i], SAMPLE).result()]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_engine_failure_fails_the_calls_in_flight_not_the_engine(tiny_model_dir, monkeypatch):
    eng = make(tiny_model_dir)
    try:
        real = eng.scheduler.forwards.model_forward
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("out of memory")
            return real(*args, **kwargs)

        monkeypatch.setattr(eng.scheduler.forwards, "model_forward", flaky)
        [g] = eng.generate([GenerationRequest(USER, seed=0, max_tokens=5)], SAMPLE)[0]
        assert g.finish_reason == "error" and "out of memory" in g.text
        after = eng.generate([GenerationRequest(USER, seed=0, max_tokens=5)], SAMPLE)[0][0]
        assert after.finish_reason == "length" and len(after.completion_ids) == 5
    finally:
        eng.close()


def test_cancelled_and_closed(tiny_model_dir):
    eng = make(tiny_model_dir)
    gate = threading.Event()
    real = eng.scheduler._step

    def held(*args):
        gate.wait(30)
        return real(*args)

    eng.scheduler._step = held
    first = eng.submit(GenerationRequest(USER, seed=0, max_tokens=3), SAMPLE)
    wait_for(lambda: eng.scheduler.busy)
    dropped = eng.submit(GenerationRequest(USER, seed=1, max_tokens=3), SAMPLE)
    assert dropped.cancel()
    gate.set()
    assert first.result()[0].finish_reason == "length"
    assert dropped.cancelled()
    eng.close()
    [g] = eng.submit(GenerationRequest(USER, seed=0), SAMPLE).result()
    assert g.finish_reason == "error" and "closed" in g.text


def test_unsupported_attention_is_a_clear_error(tiny_model_dir, tmp_path):
    import json
    import shutil

    folder = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="full-attention decoder models"):
        make(folder)


def test_queued_submit_for_generate_only_engines():
    from whale.engine.null import NullEngine

    engine = NullEngine(seed=3)
    reqs = [GenerationRequest(USER, seed=i, n=2) for i in range(5)] + [GenerationRequest(USER, choices=["a", "b"])]
    futures = [engine.submit(r, SAMPLE) for r in reqs]
    assert all(isinstance(f, Future) for f in futures)
    assert [f.result() for f in futures] == engine.generate(reqs, SAMPLE)

    class Broken(NullEngine):
        def generate(self, requests, sampling):
            raise RuntimeError("GPU fell over")

    [g] = Broken().submit(reqs[0], SAMPLE).result()
    assert g.finish_reason == "error" and "GPU fell over" in g.text


def test_queued_submit_batches_what_arrives_while_busy():
    from whale.engine.base import Generation, QueuedSubmit

    gate = threading.Event()

    class Slow(QueuedSubmit):
        def __init__(self):
            self.batches = []

        def generate(self, requests, sampling):
            gate.wait(30)
            self.batches.append(len(requests))
            return [[Generation(text="x", finish_reason="stop")] for _ in requests]

    engine = Slow()
    first = engine.submit(GenerationRequest(USER), SAMPLE)
    rest = [engine.submit(GenerationRequest(USER), SAMPLE) for _ in range(5)]
    gate.set()
    assert all(f.result()[0].text == "x" for f in [first, *rest])
    assert sum(engine.batches) == 6 and len(engine.batches) <= 3


def test_idle_engine_thread_ends_and_restarts(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(scheduler, "IDLE_EXIT_S", 0.05)
    eng = make(tiny_model_dir)
    try:
        first = ids(eng, messages=USER, seed=4, max_tokens=3)
        wait_for(lambda: eng.scheduler.thread is None, timeout=10)  # nothing holds the engine now
        assert eng.scheduler.slab.layers is None
        assert ids(eng, messages=USER, seed=4, max_tokens=3) == first
    finally:
        eng.close()


def test_slab_decode_attention_matches_sdpa(engine):
    """The engine's own decode attention (CPU: sdpa's kernel over the live columns, grouped-query
    heads in the kernel) gives the logits transformers' sdpa gives."""
    from whale.engine.attention import decode_allowed, decode_attention
    from whale.engine.kv import KVSlab

    model = engine.model
    slab = KVSlab(model.config.num_hidden_layers, engine.device)
    rows, width = 3, 40
    lens = torch.tensor([39, 12, 25])
    ids = torch.randint(5, 300, (rows, width))
    with torch.no_grad():
        cols = torch.arange(width).expand(rows, width)
        causal = (torch.arange(width) <= torch.arange(width).unsqueeze(-1)).expand(rows, 1, width, width)
        slab.reserve(rows, 2 * width)  # columns no live row uses yet
        model(input_ids=ids, attention_mask=causal, position_ids=cols, cache=slab.view(
            0, rows, torch.arange(rows).unsqueeze(-1).expand(rows, width), cols, width), use_cache=True)
        step = ids[torch.arange(rows), lens].unsqueeze(-1)
        live = int(lens.max()) + 1
        mask = decode_allowed(lens, live)
        out = {}
        for on in (True, False):
            with decode_attention(model, enabled=on) as used:
                assert used == on
                view = slab.view(0, rows, torch.arange(rows).unsqueeze(-1), lens.unsqueeze(-1), live)
                out[on] = model(input_ids=step, attention_mask=mask, position_ids=lens.unsqueeze(-1), cache=view,
                                use_cache=True).logits
        assert model.config._attn_implementation == "sdpa"  # switched back
    assert torch.allclose(out[True], out[False], atol=1e-5)


def _prefill_attention_cases(dtype):
    """(query, strided slab key/value views, bool mask) at a few prefill shapes, 9 query heads on 3."""
    gen = torch.Generator().manual_seed(0)
    for rows, width, cols in ((1, 1, 9), (3, 17, 40), (5, 64, 130), (2, 130, 200)):
        q = torch.randn(rows, 9, width, 64, generator=gen).to(dtype)
        slab = torch.randn(2, rows + 2, 3, cols + 30, 64, generator=gen).to(dtype)
        k, v = slab[0, 1 : rows + 1, :, :cols], slab[1, 1 : rows + 1, :, :cols]
        allowed = torch.rand(rows, 1, width, cols, generator=gen) > 0.3
        allowed[..., 0] = True
        yield q, k, v, allowed


class _GroupedAttention:
    num_key_value_groups, is_causal = 3, True


def test_float32_prefill_attention_is_sdpas():
    """Off the bf16 math path (float32 here) the engine's prefill attention is transformers' sdpa
    wrapper itself: the same bits, on strided slab views under 4D masks, bool and additive, and
    without a mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from whale.engine import attention

    dtype = torch.float32
    for q, k, v, allowed in _prefill_attention_cases(dtype):
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        for mask in (allowed, additive, None):
            ours, _ = attention.slab_prefill_attention(_GroupedAttention(), q, k, v, mask, scaling=0.125)
            theirs, _ = sdpa_attention_forward(_GroupedAttention(), q, k, v, mask, scaling=0.125)
            assert ours.shape == (q.shape[0], q.shape[2], 9, 64)
            assert torch.equal(ours, theirs)


def test_bf16_prefill_attention_on_the_math_path_is_attention():
    """bf16 prefill attention as matmul-softmax-matmul: within bf16 rounding of float32 attention
    (query head h on KV head h // 3), bool and additive masks alike; float32 keeps sdpa's bits; a
    query that sees no column is left to sdpa (the math path would give NaN)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from whale.engine import attention

    for q, k, v, allowed in _prefill_attention_cases(torch.bfloat16):
        rows, _, width, _ = q.shape
        if width == 1:
            continue  # one query token: the wrapper's own path
        additive = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill_(~allowed, torch.finfo(torch.bfloat16).min)
        kf, vf = (t.float().repeat_interleave(3, dim=1) for t in (k, v))
        scores = (q.float() @ kf.transpose(-1, -2) * 0.125).masked_fill(~allowed, float("-inf"))
        want = (torch.softmax(scores, -1) @ vf).transpose(1, 2)
        assert attention.math_prefill_serves(q, k, allowed)
        for mask in (allowed, additive):
            ours, _ = attention.slab_prefill_attention(_GroupedAttention(), q, k, v, mask, scaling=0.125)
            assert ours.shape == (rows, width, 9, 64) and ours.dtype == torch.bfloat16
            torch.testing.assert_close(ours.float(), want, atol=2e-2, rtol=2e-2)
        blind = allowed.clone()
        blind[0, 0, 0] = False  # one query sees nothing
        assert not attention.math_prefill_serves(q, k, blind)
        ours, _ = attention.slab_prefill_attention(_GroupedAttention(), q, k, v, blind, scaling=0.125)
        theirs, _ = sdpa_attention_forward(_GroupedAttention(), q, k, v, blind, scaling=0.125)
        assert torch.equal(ours, theirs)
    for q, k, v, allowed in _prefill_attention_cases(torch.float32):
        assert not attention.math_prefill_serves(q, k, allowed)


def test_prefill_attention_switch_keeps_the_logits(engine):
    """A prefill forward of the engine's model under `prefill_attention` has the plain sdpa logits."""
    from whale.engine.attention import prefill_attention
    from whale.engine.kv import KVSlab

    model = engine.model
    rows, width = 3, 30
    ids = torch.randint(5, 300, (rows, width))
    cols = torch.arange(width).expand(rows, width)
    causal = (torch.arange(width) <= torch.arange(width).unsqueeze(-1)).expand(rows, 1, width, width)
    out = {}
    with torch.no_grad():
        for on in (True, False):
            slab = KVSlab(model.config.num_hidden_layers, engine.device)
            slab.reserve(rows, 2 * width)  # columns no live row uses yet
            view = slab.view(0, rows, torch.arange(rows).unsqueeze(-1).expand(rows, width), cols, width)
            with prefill_attention(model, enabled=on) as used:
                assert used == on
                out[on] = model(input_ids=ids, attention_mask=causal, position_ids=cols, cache=view,
                                use_cache=True).logits
        assert model.config._attn_implementation == "sdpa"  # switched back
    assert torch.equal(out[True], out[False])


def test_k_samples_of_one_position_are_scored_once(tiny_model_dir, plain):
    eng = make(tiny_model_dir, prefix_cache_bytes=0)
    try:
        choices = ["Paris", "Nairobi", "e2e4", "boxed answer"]
        reqs = [GenerationRequest(LONG, choices=choices, seed=s) for s in range(4)]
        before = dict(eng.stats)
        got = eng.generate(reqs, SamplingParams(temperature=3.0))
        tree = sum(len(eng.tokenizer.encode(c, add_special_tokens=False)) for c in choices)
        assert eng.stats["choice_tokens"] - before["choice_tokens"] == tree  # one row, not four
        want = [plain.generate([r], SamplingParams(temperature=3.0))[0] for r in reqs]
        assert [g[0].text for g in got] == [g[0].text for g in want]
    finally:
        eng.close()


def _join(tiny_model_dir, newcomers: list[list[dict]]) -> tuple[dict, list, HFEngine]:
    """`newcomers` submitted together while one row decodes: (stats of their join, their samples, engine)."""
    system = LONG[:1]
    eng = make(tiny_model_dir, prefix_cache_bytes=0)
    live = eng.submit(GenerationRequest(system + [{"role": "user", "content": "Tell me about Kenya."}], seed=1,
                                        max_tokens=120), SamplingParams(temperature=1.0, top_k=0, max_tokens=120))
    wait_for(lambda: eng.stats["decode_steps"] > 2)
    before = dict(eng.stats)
    got = eng.generate([GenerationRequest(m, seed=7 + i) for i, m in enumerate(newcomers)], SAMPLE)
    assert not live.done(), "the live row must still decode when the newcomers join"
    live.result()
    return {k: eng.stats[k] - before[k] for k in ("prefill_forwards",)}, got, eng


def test_prompts_alike_by_a_few_tokens_do_not_wait_a_round(tiny_model_dir, plain):
    """Two prompts sharing a long prefix with a live row and only a few more tokens with each other
    are computed together: waiting a round to share those few would cost a forward."""
    newcomers = [LONG[:1] + [{"role": "user", "content": f"What is the capital of {c}?"}] for c in ("Peru", "Chad")]
    counts, got, eng = _join(tiny_model_dir, newcomers)
    eng.close()
    assert counts == {"prefill_forwards": 1}
    assert [g[0].completion_ids for g in got] == [ids(plain, messages=m, seed=7 + i)[0] for i, m in enumerate(newcomers)]


def test_kv_bound_limits_the_rows_in_flight_and_keeps_the_samples(tiny_model_dir, plain):
    prompts = [[{"role": "user", "content": f"Name a city in country number {i}."}] for i in range(6)]
    reference = [ids(plain, messages=m, seed=i, max_tokens=12) for i, m in enumerate(prompts)]
    probe = make(tiny_model_dir, max_batch_size=8)
    try:
        width = max(scheduler._slab_cols(len(probe._prompt_ids(m)) + 12) for m in prompts)
        bound = 2 * width * probe.kv_token_bytes  # two of these rows at a time
    finally:
        probe.close()
    eng = make(tiny_model_dir, max_batch_size=8, prefix_cache_bytes=0, kv_cache_bytes=bound)
    try:
        out = eng.generate([GenerationRequest(m, seed=i, max_tokens=12) for i, m in enumerate(prompts)], SAMPLE)
        assert [[g.completion_ids for g in gens] for gens in out] == reference
        assert eng.stats["max_live_rows"] == 2
        wait_for(lambda: eng.scheduler.slab.storage_bytes <= bound)  # idle: the clear keeps what fits
    finally:
        eng.close()
