"""Beam search in the engine, on the mock runner: beams as ordinary sequences of the
batch, forked copy-on-write, exact against a direct run of the same beam search.

The mock's candidates (`mock_candidates`) depend on the whole history read back
through the page table, and the mock checks every page's contents each step, so a
beam that read a sibling's page, or a copy-on-write page not copied, fails here.
(Parity with transformers on real models: tests/models_tests/test_beam_parity.py.)
"""

import random

import pytest
from mock_runner import MockRunner, mock_candidates, mock_model

from jaxserve.beam_search import BeamGroup
from jaxserve.config import engine_config
from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import BeamSearchParams, ParamError, SamplingParams

VOCAB = 1000
EOS = 7


def model(eos=EOS):
    return mock_model(vocab_size=VOCAB, max_position_embeddings=2048, eos_token_id=eos)


def make_engine(*, num_pages=128, page_size=4, max_num_seqs=16, budget=32, **kw):
    config = engine_config(
        "mock",
        model(),
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        min_token_bucket=min(16, budget),
        block_size=page_size,
        num_kv_pages=num_pages,
        warmup=False,
        **kw,
    )
    return LLMEngine(config, runner=MockRunner(config, num_pages))


def reference(prompt, params: BeamSearchParams, eos=(EOS,)):
    """The same beam search run directly on the mock's candidates: (tokens, score)."""
    tokens = {0: []}
    group = BeamGroup(params, eos, root=0)
    handles = iter(range(1, 10**6))
    while not group.done:
        for b in group.running:
            group.offer(b.handle, *mock_candidates(prompt + tokens[b.handle], VOCAB))
        for beam in group.step():
            beam.handle = next(handles)
            tokens[beam.handle] = beam.token_ids
    return [(h.token_ids, h.score) for h in group.finished]


def run(engine, requests, *, each_step=None):
    """{id: (prompt, BeamSearchParams)} -> {id: RequestOutput}, checking the pages'
    owners after every step."""
    for rid, (prompt, beam) in requests.items():
        params = SamplingParams(n=beam.beam_width)  # every hypothesis
        engine.add_request(GenerateRequest(rid, prompt, params, beam=beam))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            # A beam search has one output: its result.
            assert out.finished or out.request_id not in requests
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariant()
        if each_step is not None:
            each_step(engine)
    assert not engine.requests and engine.pool.num_free == engine.pool.capacity
    return done


def assert_matches_reference(done, requests):
    for rid, (prompt, beam) in requests.items():
        ours = [(c.token_ids, c.cumulative_logprob) for c in done[rid].outputs]
        theirs = reference(prompt, beam)
        assert [t for t, _ in ours] == [t for t, _ in theirs], rid
        for c, (tokens, score) in zip(done[rid].outputs, theirs, strict=True):
            length = len(tokens) ** beam.length_penalty
            assert c.cumulative_logprob / length == pytest.approx(score), rid


def random_requests(rs, n, *, max_prompt=30):
    requests = {}
    for i in range(n):
        prompt = [rs.randrange(10, VOCAB) for _ in range(rs.randint(1, max_prompt))]
        beam = BeamSearchParams(
            beam_width=rs.choice([1, 2, 3, 4, 8]),
            max_tokens=rs.randint(1, 12),
            length_penalty=rs.choice([1.0, 0.0, 2.0, -0.5]),
            early_stopping=rs.choice([False, True, "never"]),
            ignore_eos=rs.random() < 0.2,
        )
        requests[f"b{i}"] = (prompt, beam)
    return requests


@pytest.mark.parametrize("budget", [16, 64])
@pytest.mark.parametrize("caching", [True, False])
def test_beam_searches_in_one_batch_match_a_direct_run(budget, caching):
    """Several beam searches and their forks side by side, prompts chunked at the
    smaller budget; every result as the direct run's."""
    requests = random_requests(random.Random(0), 10)
    engine = make_engine(budget=budget, enable_prefix_caching=caching)
    done = run(engine, requests)
    assert_matches_reference(done, requests)
    assert engine.runner.copies_made > 0  # beams forked inside partial pages
    assert any(c.finish_reason == "stop" for o in done.values() for c in o.outputs)


def test_beam_tokens_count_as_generated():
    """Each running beam's token of a step counts in generation_tokens (the stats and
    Prometheus): the beams weren't counted at all before."""
    engine = make_engine()
    beam = BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True)
    run(engine, {"b": ([11, 12, 13, 14, 15], beam)})
    assert 4 * 5 <= engine.stats().generation_tokens <= 4 * 6


def test_preemption_and_prefix_hits_change_nothing():
    requests = random_requests(random.Random(1), 8)
    engine = make_engine(num_pages=40, budget=16, debug_preemption_rate=0.3)
    done = run(engine, requests)
    assert engine.scheduler.num_preemptions >= 3
    assert_matches_reference(done, requests)
    # The same again: the prompts' pages (and the beams' shared ones) hit the cache.
    hits = engine.scheduler.prefix_hits
    assert_matches_reference(run(engine, requests), requests)
    assert engine.scheduler.prefix_hits > hits


@pytest.mark.parametrize("caching", [True, False])
def test_searches_that_outgrow_the_pool_together_take_turns(caching):
    """Three searches that each fit the pool alone but not together: a beam preempted
    for pages leaves its group-mates waiting on pages they hold, and every group may
    end up so. The newest search then makes way whole, and each gets its turn (this
    once looped forever on empty steps); a preempted beam comes back onto its group's
    prompt pages (forked without the prefix cache)."""
    rs = random.Random(4)
    beam = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    requests = {f"g{i}": ([rs.randrange(10, VOCAB) for _ in range(30)], beam) for i in range(3)}
    engine = make_engine(num_pages=25, budget=64, enable_prefix_caching=caching)
    steps = 0

    def bounded(engine):
        nonlocal steps
        steps += 1
        assert steps < 500, "the searches made no progress"

    done = run(engine, requests, each_step=bounded)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_reference(done, requests)


def test_a_search_that_cannot_fit_the_pool_is_refused():
    engine = make_engine(num_pages=19)
    beam = BeamSearchParams(beam_width=4, max_tokens=10)
    with pytest.raises(ParamError, match="may hold 19 KV pages; the whole pool has 18") as e:
        engine.add_request(GenerateRequest("x", list(range(10, 40)), SamplingParams(), beam=beam))
    assert e.value.field == "beam_width"


def test_beams_mix_with_sampled_requests_and_n_samples():
    engine = make_engine(budget=16)
    prompt = list(range(20, 45))
    engine.add_request(GenerateRequest("s", prompt, SamplingParams(n=3, max_tokens=6)))
    beam = BeamSearchParams(beam_width=4, max_tokens=6)
    done = run(engine, {"b": (prompt, beam)})
    assert len(done["s"].outputs) == 3 and all(len(c.token_ids) == 6 for c in done["s"].outputs)
    assert_matches_reference(done, {"b": (prompt, beam)})
    # n < beam_width: the best n of the search's hypotheses.
    engine.add_request(GenerateRequest("two", prompt, SamplingParams(n=2), beam=beam))
    (out,) = [o for o in run(engine, {}).values()]
    assert [c.token_ids for c in out.outputs] == [t for t, _ in reference(prompt, beam)[:2]]


@pytest.mark.parametrize("k", [4, 8])
def test_k_beams_hold_one_copy_of_a_long_prompt(k):
    """k beams over a 1,000-token prompt hold its pages once, plus k short tails (each
    beam's copy of the page it writes, and its new ones), never k prompts' worth."""
    page, prompt_len, new = 16, 1000, 12
    prompt = [10 + i % 900 for i in range(prompt_len)]
    engine = make_engine(page_size=page, budget=256, num_pages=400)
    prompt_pages = -(-prompt_len // page)
    tail = -(-new // page) + 1  # a beam's own pages past the shared ones, at most
    held = []

    def count(engine):
        beams = [s for s in engine.scheduler.running if s.request_id == "b"]
        if len(beams) == k:
            distinct = {p for s in beams for p in s.pages}
            held.append(len(distinct))
            # Every beam holds the prompt's full pages, the same ones.
            full = prompt_len // page
            assert all(s.pages[:full] == beams[0].pages[:full] for s in beams)

    run(engine, {"b": (prompt, BeamSearchParams(beam_width=k, max_tokens=new))}, each_step=count)
    assert held and max(held) <= prompt_pages + k * tail
    assert max(held) < 2 * prompt_pages  # (k copies would be k * 63 pages)
    # The engine's peak counts each page once, as the pool gives them out (it summed
    # the beams' tables: 4 beams over 952 tokens reported 244 pages for ~70 held).
    stats = engine.stats()
    assert max(held) <= stats.peak_kv_pages <= prompt_pages + k * tail, stats.peak_kv_pages
    assert 0.0 <= stats.kv_waste_at_peak < 0.5


def test_the_kv_tier_and_page_export_with_shared_pages():
    """Pages several beams hold keep their names: the prompt's, exported mid-search
    (disaggregated prefill), load on another engine, whose search is the same; a
    small pool evicts the beams' cached pages into its host tier and loads them back."""
    rs = random.Random(5)
    prompt = [rs.randrange(10, VOCAB) for _ in range(30)]
    beam = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    exported = []

    def export(engine):
        if not exported and len(engine.scheduler.running) == 4:
            exported.extend(engine.export_prefix(prompt))

    engine = make_engine(kv_offload_bytes=1 << 20)
    assert_matches_reference(
        run(engine, {"a": (prompt, beam)}, each_step=export), {"a": (prompt, beam)}
    )
    assert len(exported) == len(prompt) // 4  # every full page of the prompt
    other = make_engine(kv_offload_bytes=1 << 20)
    assert other.import_pages(exported) == len(exported)
    done = run(other, {"b": (prompt, beam)})
    assert done["b"].num_cached_tokens == len(exported) * 4
    assert_matches_reference(done, {"b": (prompt, beam)})
    # A pool that holds one search at a time: each evicts the other's pages to the tier.
    small = make_engine(num_pages=22, kv_offload_bytes=1 << 20)
    prompts = [[rs.randrange(10, VOCAB) for _ in range(30)] for _ in range(2)]
    for _ in range(2):
        for i, p in enumerate(prompts):
            assert_matches_reference(run(small, {f"p{i}": (p, beam)}), {f"p{i}": (p, beam)})
            small.kv_connector.flush()
    assert small.tier.stats.loads > 0


def test_a_wide_search_waits_for_running_slots():
    """A beam search holds its beam width of max_num_seqs while it runs: a second one
    waits, and no step schedules more than max_num_seqs sequences."""
    engine = make_engine(max_num_seqs=8)
    beam = BeamSearchParams(beam_width=6, max_tokens=5)
    requests = {"a": (list(range(10, 20)), beam), "b": (list(range(30, 41)), beam)}

    def at_most(engine):
        assert len(engine.scheduler.running) <= 8

    assert_matches_reference(run(engine, requests, each_step=at_most), requests)


def test_abort_mid_search_frees_every_page():
    engine = make_engine()
    beam = BeamSearchParams(beam_width=4, max_tokens=50, ignore_eos=True)
    engine.add_request(GenerateRequest("b", list(range(10, 30)), SamplingParams(), beam=beam))
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 4
    assert engine.abort("b")
    engine.scheduler.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity and not engine.has_unfinished()


@pytest.mark.parametrize(
    "kw, beam, field, match",
    [
        ({}, dict(beam_width=7), "beam_width", "at most 6 here"),  # 2 EOS ids: 3 x 7 > 20
        ({}, dict(beam_width=9, ignore_eos=True), "beam_width", "max_num_seqs=8"),
        ({"stop_token_ids": [5]}, {}, "stop_token_ids", "cannot be used with beam"),
        ({"top_p": 0.5}, {}, "top_p", "cannot be used with beam"),
        ({"n": 3}, dict(beam_width=2), "n", "n \\(3\\) must be <= beam_width \\(2\\)"),
        ({}, dict(max_tokens=3000), "max_tokens", "exceeds max_model_len"),
    ],
)
def test_refusals_name_the_field(kw, beam, field, match):
    config = engine_config(
        "mock",
        model(eos=[EOS, 8]),
        max_model_len=2048,
        max_num_seqs=8,
        block_size=4,
        num_kv_pages=64,
        warmup=False,
    )
    engine = LLMEngine(config, runner=MockRunner(config, 64))
    params = SamplingParams(**{"detokenize": False, **kw})
    request = GenerateRequest(
        "x", [1, 2, 3], params, beam=BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **beam})
    )
    with pytest.raises(ParamError, match=match) as e:
        engine.add_request(request)
    assert e.value.field == field and not engine.requests


def test_speculation_is_refused():
    config = engine_config(
        "mock",
        model(),
        max_model_len=256,
        block_size=4,
        num_kv_pages=64,
        warmup=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    engine = LLMEngine(config, runner=MockRunner(config, 64))
    beam = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ParamError, match="speculative decoding") as e:
        engine.add_request(GenerateRequest("x", [1, 2, 3], SamplingParams(), beam=beam))
    assert e.value.field == "beam"


def test_the_copy_program_copies_whole_pages_in_every_array():
    """`kv_io.copy_pages`: each pair's source page into its destination, in every layer's
    arrays (an int8 cache's scales too), in chunks of the largest bucket."""
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runner import kv_io
    from pallas_kernels.quantization import QuantizedKV

    pages = jnp.arange(8 * 4 * 2 * 3, dtype=jnp.float32).reshape(8, 4, 2, 3)
    scales = jnp.arange(8 * 4 * 2, dtype=jnp.float32).reshape(8, 4, 2)
    caches = [pages, QuantizedKV(pages.astype(jnp.int8), scales)]
    want = [np.array(pages), (np.array(pages).astype(np.int8), np.array(scales))]
    pairs = np.array([[1, 5], [2, 6], [3, 7]], np.int32)  # 3 pairs: chunks of 2 and 1
    out = kv_io.copy_pages(caches, pairs, kv_io.JITTED_COPY, (1, 2))
    for src, dst in pairs:
        want[0][dst] = want[0][src]
        want[1][0][dst], want[1][1][dst] = want[1][0][src], want[1][1][src]
    np.testing.assert_array_equal(out[0], want[0])
    np.testing.assert_array_equal(out[1].pages, want[1][0])
    np.testing.assert_array_equal(out[1].scales, want[1][1])
    assert kv_io.copy_pages(out, np.zeros((0, 2), np.int32), None, (1, 2)) is out
