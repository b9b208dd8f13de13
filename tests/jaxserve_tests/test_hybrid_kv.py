"""The hybrid KV cache's host side: layer groups, their pages and the budget split.

Driven through the engine with the mock runner (`mock_runner.MockRunner` with
`group_pages`: each group's pages hold their own copy of the tokens, and every row
checks, group by group, the positions that group's attention reads), so outputs
are exact and every page's references are checked against its holders each step.
"""

import dataclasses

import pytest
from mock_runner import MockRunner, expected_tokens, mock_model

from jaxserve.config import ModelConfig, engine_config
from jaxserve.config import kv_groups as kvg
from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.kv.groups import KVGroups
from jaxserve.kv.page_pool import NULL_PAGE, PagePool
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import SequenceState

VOCAB = 1000
PAGE = 4
WINDOW = 8
BASE = mock_model(vocab_size=VOCAB, num_hidden_layers=3)
SHAPES = {
    "gemma2": (WINDOW, None, WINDOW),  # every other layer local
    "gemma3": (WINDOW, WINDOW, None),  # local layers, then a global one
    "mistral": (WINDOW, WINDOW, WINDOW),  # every layer local: one windowed group
    "two_windows": (WINDOW, 12, None),
}


def model(shape: str) -> ModelConfig:
    return dataclasses.replace(BASE, sliding_windows=SHAPES[shape])


@pytest.fixture(params=["sync", "async"])
def async_scheduling(request):
    return request.param == "async"


def make_engine(shape, *, num_pages=64, group_pages=None, budget=16, max_num_seqs=4, **kw):
    config = engine_config(
        "mock",
        model(shape),
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        min_token_bucket=min(16, budget),
        block_size=PAGE,
        num_kv_pages=num_pages,
        warmup=False,
        **kw,
    )
    pages = group_pages or config.kv_group_pages()
    return LLMEngine(config, runner=MockRunner(config, num_pages, pages))


def params(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine, prompts, max_tokens, *, on_step=None, **kw):
    """Runs the prompts to the end, checking every page's holders after each step;
    returns each one's tokens, and the most pages any windowed group had in use."""
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), p, params(max_tokens, **kw)))
    kv = engine.scheduler.kv
    done, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        kv.check_invariant(engine.scheduler.running)
        peak = max([peak] + [kv.pools[g].capacity - kv.pools[g].num_free for g in kv.windowed])
        if on_step is not None:
            on_step(engine)
    kv.check_invariant()
    for pool in kv.pools:
        assert pool.num_free == pool.capacity  # everything back (cached or free)
    return [done[str(i)] for i in range(len(prompts))], peak


def prompts(n, length, seed=0):
    return [[(seed + 7 * i + 3 * j) % 97 + 3 for j in range(length + 5 * i)] for i in range(n)]


# ------------------------------------------------------------------ layer groups


def test_layer_groups_put_full_attention_first_and_merge_windows_that_never_slide():
    groups = kvg.layer_groups((4096, None, 4096, None), max_model_len=8192)
    assert groups == (kvg.KVGroup(None, (1, 3)), kvg.KVGroup(4096, (0, 2)))
    assert kvg.group_of_layer(groups) == (1, 0, 1, 0)
    gemma3 = kvg.layer_groups((1024,) * 5 + (None,) + (1024,) * 5 + (None,), 32768)
    assert [(g.window, len(g.layers)) for g in gemma3] == [(None, 2), (1024, 10)]
    # A window as long as the context frees nothing: one group, as a dense model.
    assert kvg.layer_groups((4096, None), max_model_len=4096) == (kvg.KVGroup(None, (0, 1)),)
    assert kvg.layer_groups((8, 8), 256) == (kvg.KVGroup(8, (0, 1)),)  # Mistral


def test_dense_models_keep_one_group_and_their_pool_size():
    config = engine_config("mock", BASE, max_model_len=256, kv_cache_memory_bytes=1 << 20)
    assert config.kv_groups == (kvg.KVGroup(None, (0, 1, 2)),) and not config.hybrid_kv
    assert config.kv_group_pages() == (config.num_kv_pages(),)
    off = engine_config("mock", model("gemma3"), disable_hybrid_kv_cache_manager=True)
    assert off.kv_groups == (kvg.KVGroup(None, (0, 1, 2)),) and not off.hybrid_kv


def gemma3_pages(context: int, hybrid: bool, budget: int = 64 << 30):
    """Gemma-3-27B-shaped pools (62 layers: 52 local of window 1024, 10 global)."""
    windows = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62))
    gemma3 = dataclasses.replace(
        BASE,
        num_layers=62,
        sliding_windows=windows,
        num_kv_heads=16,
        num_heads=32,
        head_dim=128,
        max_position_embeddings=context,
    )
    config = engine_config(
        "mock",
        gemma3,
        max_model_len=context,
        dtype="bfloat16",
        max_num_seqs=1024,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=budget,
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    return config, config.kv_group_pages()


def test_the_budget_split_holds_several_times_more_long_sequences():
    for context, at_least in ((8192, 3.0), (32768, 4.5)):
        config, (dense,) = gemma3_pages(context, hybrid=False)
        hybrid_config, pages = gemma3_pages(context, hybrid=True)
        per_seq = config.pages_per_seq
        before = (dense - 1) // per_seq
        sizes = dict(page_size=16, pages_per_seq=per_seq, chunk=2048)
        held = [
            kvg.sequences_held(g, n, **sizes)
            for g, n in zip(hybrid_config.kv_groups, pages, strict=True)
        ]
        assert min(held) >= at_least * before, (context, before, held)
        # The same bytes: 62 layers' pages before, 10 + 52 layers' after.
        assert 10 * pages[0] + 52 * pages[1] <= 62 * dense + 62


def test_an_explicit_page_count_is_every_groups_and_a_window_must_hold_a_sequence():
    config = engine_config(
        "mock",
        model("gemma2"),
        num_kv_pages=40,
        block_size=PAGE,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    assert config.kv_group_pages() == (40, 40)
    tight = engine_config(
        "mock", model("gemma2"), num_kv_pages=6, block_size=PAGE, max_num_batched_tokens=64
    )
    with pytest.raises(ValueError, match="sliding window 8 5 pages; one sequence needs up to"):
        tight.kv_group_pages()


def test_hybrid_with_the_kv_tier_is_refused_naming_both():
    with pytest.raises(ValueError, match="kv_offload_bytes=4096.*disable_hybrid_kv_cache_manager"):
        engine_config("mock", model("gemma3"), kv_offload_bytes=4096)
    engine_config(  # one group: the tier as before
        "mock", model("gemma3"), kv_offload_bytes=4096, disable_hybrid_kv_cache_manager=True
    )


# ------------------------------------------------------------------ through the engine


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_outputs_are_exact_and_windowed_groups_hold_a_window(shape, async_scheduling):
    engine = make_engine(shape, async_scheduling=async_scheduling)
    ps = prompts(3, 30)
    outputs, peak = run(engine, ps, 40)
    for p, out in zip(ps, outputs, strict=True):
        assert out == expected_tokens(p, 40, VOCAB)
    # 3 sequences of up to 80 tokens (20 pages each) ran together; a windowed group
    # held at most a window and a chunk of each, never their whole length.
    window_peak = kvg.peak_pages(WINDOW, PAGE, engine.config.pages_per_seq, chunk=16)
    assert 0 < peak <= 3 * window_peak < 3 * 20


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_n_samples_past_the_window_compute_their_own_prompt(shape):
    """An n > 1 request's samples after the first do not fork its pages where a layer
    group slides: the first sample's pages before the window are gone (the null page
    stands in). Every layer windowed is one pool: forking there failed ("page 0 forked
    but not in use")."""
    engine = make_engine(shape)
    ps = prompts(2, 30)
    for i, p in enumerate(ps):
        engine.add_request(GenerateRequest(str(i), p, params(6, n=3)))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        engine.scheduler.kv.check_invariant(engine.scheduler.running)
    for i, p in enumerate(ps):
        assert done[str(i)] == [expected_tokens(p, 6, VOCAB)] * 3


def test_pages_before_the_window_go_back_while_the_sequence_runs():
    engine = make_engine("gemma3", budget=16)
    kv = engine.scheduler.kv
    seen = []

    def on_step(engine):
        for seq in engine.scheduler.running:
            full_used = kv.pools[0].capacity - kv.pools[0].num_free
            window_used = kv.pools[1].capacity - kv.pools[1].num_free
            table = seq.group_pages[0]
            seen.append((seq.num_computed, full_used, window_used, table.count(NULL_PAGE)))

    run(engine, prompts(1, 60), 30, on_step=on_step)
    late = [s for s in seen if s[0] >= 80]
    assert late, seen
    for computed, full_used, window_used, nulls in late:
        assert full_used == -(-computed // PAGE) or full_used == -(-computed // PAGE) + 1
        # The window's pages, and the page being filled: nothing older.
        assert window_used <= kvg.window_pages(WINDOW, PAGE, 64) + 1
        assert nulls >= computed // PAGE - 4


def test_preemption_and_shared_prefixes_keep_outputs_exact(async_scheduling):
    engine = make_engine(
        "gemma2",
        num_pages=40,
        budget=16,
        max_num_seqs=4,
        debug_preemption_rate=0.1,
        async_scheduling=async_scheduling,
    )
    shared = prompts(1, 37, seed=5)[0]
    ps = [shared + [11 + i] * (3 + i) for i in range(5)] + prompts(2, 20, seed=9)
    outputs, _ = run(engine, ps, 24)
    for p, out in zip(ps, outputs, strict=True):
        assert out == expected_tokens(p, 24, VOCAB)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.prefix_hits > 0


def test_a_sequence_waits_for_the_windowed_group_though_the_full_one_has_room():
    ps = prompts(3, 40)
    trace = {}
    for windowed in (64, 9):  # room for all three; for one prefill and little more
        engine = make_engine("gemma3", group_pages=(64, windowed), budget=16, max_num_seqs=4)
        kv, sched, steps = engine.scheduler.kv, engine.scheduler, []

        def on_step(engine, kv=kv, sched=sched, steps=steps):
            steps.append((len(sched.waiting), kv.pools[0].num_free, kv.pools[1].num_free))

        outputs, peak = run(engine, ps, 8, on_step=on_step)
        assert outputs == [expected_tokens(p, 8, VOCAB) for p in ps]
        assert peak <= windowed - 1
        trace[windowed] = steps
    assert len(trace[9]) > len(trace[64])
    # Waiting with a whole request's pages free in the full group: the window's bound.
    assert any(w and full >= 20 and win < 5 for w, full, win in trace[9])
    assert not any(w and full >= 20 and win < 5 for w, full, win in trace[64])


def test_speculative_drafts_rolled_back_in_every_group():
    engine = make_engine(
        "gemma2",
        budget=32,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    ps = [[5, 6, 7, 8] * 10, prompts(1, 25)[0]]
    outputs, _ = run(engine, ps, 30)
    assert outputs == [expected_tokens(p, 30, VOCAB) for p in ps]


def test_a_prefix_hit_takes_only_the_window_in_a_windowed_group():
    engine = make_engine("gemma3", budget=64)
    prompt = prompts(1, 47, seed=3)[0]
    run(engine, [prompt], 2)
    kv, hits = engine.scheduler.kv, []
    lookup = kv.lookup

    def recorded(seq, limit):
        hits.append((lookup(seq, limit), list(seq.pages), list(seq.group_pages[0])))
        return hits[-1][0]

    kv.lookup = recorded
    prompt2 = prompt + [9, 9]  # 12 full pages; the 12th differs from the first run's
    (out,), _ = run(engine, [prompt2], 3)
    assert out == expected_tokens(prompt2, 3, VOCAB)
    h, full, window = hits[0]
    assert h == 11 and engine.scheduler.prefix_hits == 44  # (the first run hit none)
    assert len(full) == len(window) == 11 and NULL_PAGE not in full
    # A query at 44 sees 37..44: pages 9 and 10 of the hit (and the new ones), no more.
    assert window[:9] == [NULL_PAGE] * 9 and NULL_PAGE not in window[9:]


# ------------------------------------------------------------------ KVGroups alone


def _seq(tokens, salt=None) -> SequenceState:
    return SequenceState("r", 0, list(tokens), params(1), 1, 0, salt=salt)


def test_a_windowed_hit_needs_the_window_not_the_start():
    """Cached: the full group has pages 0..10 of a prompt, the windowed group only
    6..10 (0..5 evicted). A hit of 11 pages needs windowed pages 9 and 10 (a query at
    position 44 sees 37..): found. A hit of 6 pages would need 4 and 5, and each
    shorter one its own evicted pages: the longest hit every group serves is 0."""
    page = 4
    pools = [PagePool(32), PagePool(32)]
    kv = KVGroups(pools, [None, 8], page)
    tokens = list(range(3, 47))  # 44 tokens: 11 pages, 10 cacheable before the last token
    first = _seq(tokens)
    kv.grow(first, 44)
    first.num_computed = 44
    from jaxserve.scheduler import Scheduler  # its cache_pages registers every group

    config = engine_config("mock", model("gemma3")).scheduler
    sched = Scheduler(config, pools[0], page_size=page, kv=kv)
    sched.cache_pages(first)
    kv.check_invariant([first])
    assert first.group_pages[0][:9] == [NULL_PAGE] * 9  # given back once cached
    # Evict windowed pages 0..5 (as other sequences' allocations would).
    victims = {first.page_digests[j] for j in range(6)}
    kv.release(first)
    while any(pools[1].page_of_digest(d) is not None for d in victims):
        pools[1].free(pools[1].allocate(1))
    second = _seq(tokens + [1])
    assert kv.lookup(second, 44) == 11 == len(second.page_uids)
    assert second.group_pages[0][:9] == [NULL_PAGE] * 9
    assert NULL_PAGE not in second.group_pages[0][9:] + second.pages
    kv.check_invariant([second])
    kv.release(second)
    third = _seq(tokens[:25])
    assert kv.lookup(third, 24) == 0 and third.pages == third.group_pages[0] == []
    kv.check_invariant([third])
    assert pools[0].num_free == pools[0].capacity  # the full group's 6 hit pages let go


# ------------------------------------------------------------------ step inputs


def test_each_group_gets_its_table_and_slots_and_each_layer_its_group():
    from jaxserve.runner.input_batch import SeqWork, build_batch
    from jaxserve.runner.step import StepInput
    from pallas_kernels import GroupedMetadata, layer_metadata

    # 10 tokens computed, 3 more now: pages of 4; the windowed table let page 0 go.
    work = [SeqWork([7, 8, 9], 10, [5, 6, 7, 8], group_pages=[[0, 3, 4, 9]])]
    b = build_batch(work, page_size=4, pages_per_seq=6, token_bucket=4, seq_bucket=2, num_groups=2)
    assert b.page_indices[0].tolist() == [5, 6, 7, 8, 0, 0]
    assert b.group_page_indices.shape == (1, 2, 6)
    assert b.group_page_indices[0, 0].tolist() == [0, 3, 4, 9, 0, 0]
    assert b.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 8 * 4 + 0, 0]
    assert b.group_slot_mapping[0].tolist() == [4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0, 0]
    step = StepInput.from_host(b, layer_group=(1, 0, 1))
    md = step.attention
    assert isinstance(md, GroupedMetadata)
    assert layer_metadata(md, 1) is md.groups[0] and layer_metadata(md, 2) is md.groups[1]
    assert md.groups[1].kv_lens is b.kv_lens  # the same lengths and offsets for every group
    with pytest.raises(ValueError, match="a batch of 2 layer groups for layers in groups"):
        StepInput.from_host(b, layer_group=(0, 0, 0))
    # One group: the metadata the programs always had (no second table, same pytree).
    dense = build_batch(work[:0], page_size=4, pages_per_seq=6, token_bucket=4, seq_bucket=2)
    assert dense.group_page_indices.shape[0] == 0
    assert not isinstance(StepInput.from_host(dense).attention, GroupedMetadata)


def test_the_flag_is_vllms_and_checked():
    from jaxserve.config import ENGINE_ARGS

    assert "disable_hybrid_kv_cache_manager" in ENGINE_ARGS  # (the CLI's: test_cli.py)
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager must be a bool"):
        engine_config("mock", BASE, disable_hybrid_kv_cache_manager="yes")


def test_the_start_up_log_gives_each_groups_capacity():
    from jaxserve.runner.kv_plan import KVPlan

    config = engine_config(
        "mock",
        model("gemma3"),
        block_size=PAGE,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=1 << 20,
    )
    plan = KVPlan.make(config, config.kv_group_pages())
    full, local = plan.group_pages
    text = plan.describe(config)
    assert (
        f"group 0 (full attention, 1 layers): {full - 1} pages = {(full - 1) * PAGE} tokens" in text
    )
    assert f"group 1 (window 8, 2 layers): {local - 1} pages" in text
    # Capped by max_num_seqs, as one group's pool is; and what a group holds is logged.
    assert plan.max_concurrency(config) == 4.0 and "4.00 sequences of max_model_len" in text
    dense = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, disable_hybrid=True)
    )
    one = KVPlan.make(dense, dense.kv_group_pages())
    assert (
        not one.hybrid and one.layer_group == () and one.layer_pages == [dense.num_kv_pages()] * 3
    )
