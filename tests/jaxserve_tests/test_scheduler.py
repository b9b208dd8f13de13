"""Scheduling, prefix caching and preemption, driven through the engine with a mock runner.

The mock's tokens are computable by hand and it checks the KV pages' contents at
every step, so these tests assert exact outputs and exact page accounting.
"""

import random

import pytest
from mock_runner import MockRunner, expected_tokens, mock_model

from jaxserve.config import engine_config
from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import SamplingParams

VOCAB = 1000
MODEL = mock_model(vocab_size=VOCAB)


# Every test here runs with synchronous and with asynchronous scheduling (the
# `scheduling` fixture below); other modules that build engines here get the default.
ENGINE_DEFAULTS: dict = {}


@pytest.fixture(autouse=True, params=["sync", "async"])
def scheduling(request, monkeypatch):
    monkeypatch.setitem(ENGINE_DEFAULTS, "async_scheduling", request.param == "async")
    return request.param


def make_engine(*, num_pages=64, page_size=4, max_num_seqs=8, budget=32, **kw) -> LLMEngine:
    kw = {**ENGINE_DEFAULTS, **kw}
    config = engine_config(
        "mock",
        MODEL,
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        min_token_bucket=min(16, budget),
        block_size=page_size,
        num_kv_pages=num_pages,
        warmup=False,
        **kw,
    )
    engine = LLMEngine(config, runner=MockRunner(config, num_pages))
    original = engine.scheduler.schedule

    def checked_schedule():
        plan = original()
        assert plan.num_tokens <= budget and len(plan.scheduled) <= max_num_seqs
        return plan

    engine.scheduler.schedule = checked_schedule
    return engine


def params(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine, requests, *, check_every_step=True):
    """requests: {id: (prompt, SamplingParams, kwargs)}; returns {id: RequestOutput}."""
    for rid, (prompt, sp, kw) in requests.items():
        engine.add_request(GenerateRequest(rid, prompt, sp, **kw))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check_every_step:  # each page's references are its live owners (forks too)
            engine.scheduler.check_invariant()
    assert_idle(engine)
    return done


def assert_idle(engine):
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def assert_exact(done, requests):
    for rid, (prompt, sp, _) in requests.items():
        for c in done[rid].outputs:
            assert c.token_ids == expected_tokens(prompt, sp.max_tokens, VOCAB), rid
            assert c.finish_reason == "length"


def random_requests(rs, n, *, shared=None, max_prompt=40, max_new=12):
    reqs = {}
    for i in range(n):
        prompt = [rs.randrange(1, VOCAB) for _ in range(rs.randint(1, max_prompt))]
        if shared is not None and rs.random() < 0.5:
            prompt = shared[: rs.randint(1, len(shared))] + prompt
        reqs[f"r{i}"] = (prompt, params(rs.randint(1, max_new)), {})
    return reqs


@pytest.mark.parametrize("budget", [1, 4, 16])
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_are_exact_for_every_chunk_size(budget, caching):
    rs = random.Random(budget)
    shared = [rs.randrange(1, VOCAB) for _ in range(30)]
    reqs = random_requests(rs, 12, shared=shared)
    engine = make_engine(budget=budget, max_num_seqs=min(budget, 8), enable_prefix_caching=caching)
    assert_exact(run(engine, reqs), reqs)


def test_decodes_keep_flowing_during_a_long_prefill():
    engine = make_engine(budget=8)
    engine.add_request(GenerateRequest("short", [1, 2, 3], params(20)))
    engine.step()  # prefill "short"
    engine.add_request(GenerateRequest("long", list(range(1, 60)), params(2)))
    for _ in range(5):
        plan_before = len(engine.requests["short"].seqs[0].output_ids)
        engine.step()
        assert len(engine.requests["short"].seqs[0].output_ids) == plan_before + 1


def test_a_step_just_past_a_token_bucket_defers_prompt_tokens_to_fit_the_one_below():
    """3 decodes + a 30-token prompt are 33 tokens: padded to the 64 bucket, 31 padding
    rows would cost more than deferring one prompt token; the step runs 32."""
    engine = make_engine(budget=64, max_num_seqs=8)  # token buckets 16, 32, 64
    plans = []
    original = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(original()) or plans[-1]
    reqs = {f"d{i}": ([i + 1] * 3, params(6), {}) for i in range(3)}
    for rid, (prompt, sp, _) in reqs.items():
        engine.add_request(GenerateRequest(rid, prompt, sp))
    engine.step()  # the three short prompts
    reqs["long"] = (list(range(100, 130)), params(4), {})
    engine.add_request(GenerateRequest("long", *reqs["long"][:2]))
    engine.step()
    step = plans[-1].scheduled
    assert [s.num_tokens for s in step] == [1, 1, 1, 29]  # decodes whole, the prompt cut
    assert not step[-1].samples
    done = run(engine, {})  # to the end: exact tokens, every page back
    assert done["long"].outputs[0].token_ids == expected_tokens(reqs["long"][0], 4, VOCAB)


def test_steps_fill_at_least_three_quarters_of_their_token_bucket():
    """Over a random workload, every step that has a prompt chunk to shorten fills at
    least 3/4 of the bucket it is padded to, and the outputs stay exact."""
    rs = random.Random(7)
    reqs = random_requests(rs, 40, max_prompt=90, max_new=10)
    engine = make_engine(budget=128, max_num_seqs=8, num_pages=256)  # buckets 16 .. 128
    buckets = engine.runner.shapes.token_buckets
    original = engine.scheduler.schedule

    def checked():
        plan = original()
        total = plan.num_tokens
        bucket = next(b for b in buckets if b >= total)
        shortenable = sum(s.num_tokens - 1 for s in plan.scheduled if not s.draft)
        if total > buckets[0] and shortenable >= total - max(b for b in buckets if b < total):
            assert total >= 0.75 * bucket, [s.num_tokens for s in plan.scheduled]
        return plan

    engine.scheduler.schedule = checked
    assert_exact(run(engine, reqs), reqs)


def test_prefix_cache_hits_are_reported_and_capped():
    engine = make_engine(page_size=4)
    prompt = list(range(1, 14))  # 3 full pages + 1 token
    first = run(engine, {"a": (prompt, params(3), {})})["a"]
    assert first.num_cached_tokens == 0
    again = run(engine, {"b": (prompt, params(3), {})})["b"]
    assert again.num_cached_tokens == 12
    exact_pages = run(engine, {"c": (prompt[:12], params(3), {})})["c"]
    assert exact_pages.num_cached_tokens == 8  # the last prompt token is always computed
    diverged = prompt[:6] + [999] * 7
    assert run(engine, {"d": (diverged, params(3), {})})["d"].num_cached_tokens == 4
    salted = run(engine, {"e": (prompt, params(3), {"cache_salt": "other"})})["e"]
    assert salted.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_prefix_cache_metrics_count_each_prompt_once():
    """A head-of-line request that waits for pages is looked up on every step; the
    metrics count its prompt once (they counted every lookup)."""
    engine = make_engine(num_pages=16, page_size=4, budget=32)  # 15 usable pages
    shared = list(range(1, 13))
    run(engine, {"warm": (shared + [50], params(1), {})})  # caches 3 pages of `shared`
    base = engine.stats()
    requests = {
        # 11 pages: all the never-used ones, so the 3 cached pages are not evicted.
        "big": (list(range(100, 140)), params(4), {}),
        "waits": (shared + list(range(60, 68)), params(2), {}),  # 5 pages: waits for "big"
    }
    waiting_steps = 0
    for rid, (prompt, sp, kw) in requests.items():
        engine.add_request(GenerateRequest(rid, prompt, sp, **kw))
    while engine.has_unfinished():
        engine.step()
        waiting_steps += bool(engine.scheduler.waiting)
    assert waiting_steps >= 3  # "waits" really was looked up again and again
    s = engine.stats()
    assert s.prefix_cache_queries - base.prefix_cache_queries == (40 - 1) + (20 - 1)
    assert s.prefix_cache_hits - base.prefix_cache_hits == 12  # the 3 cached pages, once
    assert_idle(engine)


def test_preemption_when_pages_run_out_recomputes_exactly():
    rs = random.Random(0)
    reqs = random_requests(rs, 10, max_prompt=20, max_new=30)
    engine = make_engine(num_pages=24, page_size=4, max_num_seqs=8, budget=32)
    done = run(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    assert_exact(done, reqs)


@pytest.mark.parametrize("caching", [True, False])
def test_forced_random_preemption_changes_nothing(caching):
    rs = random.Random(1)
    reqs = random_requests(rs, 16, shared=[5] * 20)
    engine = make_engine(debug_preemption_rate=0.5, enable_prefix_caching=caching)
    done = run(engine, reqs)
    assert engine.scheduler.num_preemptions >= 3
    assert_exact(done, reqs)


@pytest.mark.parametrize("caching", [True, False])
def test_forked_samples_under_preemption_stay_exact(caching):
    """n > 1 samples on shared pages, preempted at random and when pages run out: each
    recomputes alone, and every page's references stay its owners'."""
    rs = random.Random(3)
    reqs = {}
    for i in range(12):
        prompt = [rs.randrange(1, VOCAB) for _ in range(rs.randint(2, 30))]
        reqs[f"r{i}"] = (prompt, params(rs.randint(1, 10), n=rs.choice([2, 3, 4])), {})
    engine = make_engine(
        num_pages=40, debug_preemption_rate=0.5, enable_prefix_caching=caching, budget=16
    )
    done = run(engine, reqs)
    assert engine.scheduler.num_preemptions >= 3 and engine.runner.copies_made > 0
    assert_exact(done, reqs)


def test_preempts_the_lowest_priority_newest():
    engine = make_engine(num_pages=9, page_size=4, max_num_seqs=4, budget=64)
    engine.add_request(GenerateRequest("old", [1] * 8, params(20), priority=0))
    engine.add_request(GenerateRequest("vip", [2] * 8, params(20), priority=-1))
    engine.add_request(GenerateRequest("new", [3] * 8, params(20), priority=0))
    victims = []
    while engine.has_unfinished():
        before = {s.request_id: s.num_preemptions for s in engine.scheduler.running}
        engine.step()
        for rid in before:
            seq = engine.requests[rid].seqs[0] if rid in engine.requests else None
            if seq is not None and seq.num_preemptions > before[rid]:
                victims.append(rid)
    assert victims and victims[0] == "new"
    assert "vip" not in victims
    assert_idle(engine)


def test_priority_orders_admission():
    engine = make_engine(max_num_seqs=1)
    for rid, prio in [("c", 5), ("a", -1), ("b", 0)]:
        engine.add_request(GenerateRequest(rid, [1, 2], params(1), priority=prio))
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["a", "b", "c"]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("prompt_len", [17, 18])
def test_n_samples_fork_the_prompt_pages(caching, prompt_len):
    """One prefill, then n owners: the siblings share the first sample's pages of every
    prompt token but the last (copy-on-write), with or without the prefix cache; each
    computes the last prompt token itself, and copies the partial page it writes."""
    page, n, new = 4, 3, 5
    shared_full = (prompt_len - 1) // page
    engine = make_engine(page_size=page, enable_prefix_caching=caching)
    prompt = list(range(1, prompt_len + 1))
    engine.add_request(GenerateRequest("x", prompt, params(new, n=n)))
    together, computed, done = 0, 0, None
    original = engine.scheduler.schedule

    def counting():
        nonlocal computed
        plan = original()
        computed += sum(s.num_tokens for s in plan.scheduled if s.start < prompt_len)
        return plan

    engine.scheduler.schedule = counting
    while engine.has_unfinished():
        for out in engine.step():
            done = out if out.finished else done
        engine.scheduler.check_invariant()
        running = engine.scheduler.running
        if len(running) == n:  # the first sample's full prompt pages, held by all n
            first = set(running[0].pages)
            for seq in running[1:]:
                assert set(seq.pages) & first == set(running[0].pages[:shared_full])
            together += 1
    assert_idle(engine)
    assert [c.index for c in done.outputs] == list(range(n))
    for c in done.outputs:
        assert c.token_ids == expected_tokens(prompt, new, VOCAB)
    # The prompt is computed once, and its last token once more per sibling.
    assert computed == prompt_len + (n - 1)
    assert together > 0
    partial = (prompt_len - 1) % page != 0  # the siblings copy the page they write
    assert engine.runner.copies_made == (n - 1) * partial
    assert engine.scheduler.prefix_hits == 0


def test_abort_frees_pages_and_is_idempotent():
    engine = make_engine()
    engine.add_request(GenerateRequest("a", list(range(1, 30)), params(50)))
    engine.add_request(GenerateRequest("b", [1, 2, 3], params(3)))
    engine.step()
    engine.step()
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.abort("b") is False  # after finish: harmless
    assert set(done) == {"b"}
    assert_idle(engine)


@pytest.mark.parametrize(
    "prompt,sp,match",
    [
        ([], params(1), "must not be empty"),
        ([VOCAB], params(1), "outside the vocabulary"),
        ([1] * 256, params(1), "max_model_len is 256"),
        ([1] * 250, params(10), "exceeds max_model_len"),
        ([1] * 200, params(50), "whole pool has 15"),
        ([1], SamplingParams(logit_bias={VOCAB + 5: 1.0}), "logit_bias names token"),
    ],
)
def test_admission_errors_leave_other_requests_untouched(prompt, sp, match):
    engine = make_engine(num_pages=16)
    engine.add_request(GenerateRequest("good", [1, 2, 3], params(4)))
    with pytest.raises(ValueError, match=match):
        engine.add_request(GenerateRequest("bad", prompt, sp))
    done = run(engine, {})
    assert done["good"].outputs[0].token_ids == expected_tokens([1, 2, 3], 4, VOCAB)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(GenerateRequest("dup", [1], params(1)))
        engine.add_request(GenerateRequest("dup", [1], params(1)))


@pytest.mark.slow
def test_soak_2000_requests_returns_every_page():
    rs = random.Random(2024)
    engine = make_engine(
        num_pages=48, page_size=4, max_num_seqs=8, budget=24, debug_preemption_rate=0.05
    )
    shared = [[rs.randrange(1, VOCAB) for _ in range(rs.randint(4, 24))] for _ in range(5)]
    pending, expected, done, aborted = 2000, {}, {}, set()
    i = 0
    while pending or engine.has_unfinished():
        for _ in range(rs.randint(0, 3)):
            if not pending:
                break
            prompt = [rs.randrange(1, VOCAB) for _ in range(rs.randint(1, 20))]
            if rs.random() < 0.5:
                prompt = rs.choice(shared) + prompt
            sp = params(rs.randint(1, 16), n=rs.choice([1, 1, 1, 2, 3]))
            salt = rs.choice([None, None, "t1"])
            engine.add_request(GenerateRequest(f"s{i}", prompt, sp, cache_salt=salt))
            expected[f"s{i}"] = (prompt, sp)
            i += 1
            pending -= 1
        if engine.requests and rs.random() < 0.05:
            victim = rs.choice(sorted(engine.requests))
            assert engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariant()
    assert len(done) + len(aborted) == 2000
    for rid, out in done.items():
        prompt, sp = expected[rid]
        assert len(out.outputs) == sp.n
        for c in out.outputs:
            assert c.token_ids == expected_tokens(prompt, sp.max_tokens, VOCAB)
    assert_idle(engine)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_hits > 0
