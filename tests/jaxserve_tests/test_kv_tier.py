"""KV pages that move: the transfer format, the host/disk tier, and the engine with it.

The mock runner's pages hold the tokens written to them and it checks, every
step, that a sequence's pages hold its history: a page loaded from the tier
into the wrong place, or a wrong page, fails the step.
"""

import random

import numpy as np
import pytest
from mock_runner import MockRunner, expected_tokens
from test_scheduler import VOCAB, assert_exact, make_engine, params, random_requests, run

from jaxserve import SamplingParams
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import (
    ROOT_DIGEST,
    ArraySpec,
    KVLayout,
    KVTransferError,
    Page,
    check_chain,
    decode_page,
    encode_page,
    page_digest,
)

LAYOUT = KVLayout(
    "model-a", 4, (ArraySpec("kv", "float32", (2, 4, 2, 3)), ArraySpec("scale", "float16", (4,)))
)


def make_page(tokens=(1, 2, 3, 4), parent=ROOT_DIGEST, salt=None, seed=0):
    rs = np.random.RandomState(seed)
    arrays = {
        "kv": rs.randn(2, 4, 2, 3).astype(np.float32),
        "scale": rs.rand(4).astype(np.float16),
    }
    return Page(page_digest(parent, tokens, salt), parent, tuple(tokens), arrays)


# ------------------------------------------------------------------ the format


def test_a_page_round_trips_with_every_named_array():
    page = make_page()
    back = decode_page(LAYOUT, encode_page(LAYOUT, page), page.digest)
    assert back.digest == page.digest and back.tokens == page.tokens
    for name in ("kv", "scale"):
        np.testing.assert_array_equal(back.arrays[name], page.arrays[name])
    check_chain(back)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int8"])
def test_low_precision_pages_with_scales_round_trip(dtype):
    layout = KVLayout(
        "m", 4, (ArraySpec("kv", dtype, (2, 4, 2, 3)), ArraySpec("scale", "float32", (2, 4)))
    )
    arrays = {
        "kv": np.arange(48).reshape(2, 4, 2, 3).astype(dtype),
        "scale": np.ones((2, 4), np.float32),
    }
    page = Page(page_digest(ROOT_DIGEST, [1, 2, 3, 4]), ROOT_DIGEST, (1, 2, 3, 4), arrays)
    back = decode_page(layout, encode_page(layout, page))
    assert back.arrays["kv"].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(
        back.arrays["kv"].astype(np.float32), arrays["kv"].astype(np.float32)
    )


def test_digests_chain_over_the_prefix_and_the_salt():
    a = page_digest(ROOT_DIGEST, [1, 2, 3, 4])
    assert a == page_digest(ROOT_DIGEST, [1, 2, 3, 4])
    assert a != page_digest(ROOT_DIGEST, [1, 2, 3, 5])
    assert a != page_digest(ROOT_DIGEST, [1, 2, 3, 4], "tenant")
    assert page_digest(a, [5] * 4) != page_digest(page_digest(ROOT_DIGEST, [9] * 4), [5] * 4)


@pytest.mark.parametrize("at", [0, 7, 40, 200, -3])
def test_a_corrupt_page_is_refused(at):
    data = bytearray(encode_page(LAYOUT, make_page()))
    data[at] ^= 0x40
    with pytest.raises(KVTransferError, match="checksum|magic"):
        decode_page(LAYOUT, bytes(data))


def test_a_truncated_page_is_refused():
    data = encode_page(LAYOUT, make_page())
    for n in (0, 5, len(data) // 2, len(data) - 1):
        with pytest.raises(KVTransferError):
            decode_page(LAYOUT, data[:n])


@pytest.mark.parametrize(
    "other",
    [
        KVLayout("model-b", 4, LAYOUT.arrays),  # another model
        KVLayout("model-a", 4, LAYOUT.arrays[:1]),  # no scales
        KVLayout("model-a", 4, (ArraySpec("kv", "bfloat16", (2, 4, 2, 3)), LAYOUT.arrays[1])),
    ],
)
def test_a_page_of_another_model_or_layout_is_refused(other):
    with pytest.raises(KVTransferError, match="another model or layout"):
        decode_page(other, encode_page(LAYOUT, make_page()))


def test_a_page_under_the_wrong_name_or_salt_is_refused():
    page = make_page()
    data = encode_page(LAYOUT, page)
    with pytest.raises(KVTransferError, match="asked for"):
        decode_page(LAYOUT, data, page_digest(ROOT_DIGEST, [9, 9, 9, 9]))
    with pytest.raises(KVTransferError, match="another salt"):
        check_chain(decode_page(LAYOUT, data), salt="tenant-b")


# -------------------------------------------------------------------- the tier


def test_host_tier_is_lru_bounded_in_bytes():
    pages = [make_page((i,) * 4, seed=i) for i in range(5)]
    size = len(encode_page(LAYOUT, pages[0]))
    tier = KVTier(LAYOUT, host_bytes=3 * size)
    for p in pages:
        tier.put(p.digest, encode_page(LAYOUT, p))
    assert tier.host_used <= 3 * size
    assert [tier.contains(p.digest) for p in pages] == [False, False, True, True, True]
    assert len(tier.load([pages[2].digest])) == 1
    tier.put(pages[0].digest, encode_page(LAYOUT, pages[0]))  # evicts 3, not the fresh 2
    assert tier.contains(pages[2].digest) and not tier.contains(pages[3].digest)


def chain(n, salt=None):
    pages, parent = [], ROOT_DIGEST
    for i in range(n):
        p = make_page((i, i + 1, i + 2, i + 3), parent, salt, seed=i)
        pages.append(p)
        parent = p.digest
    return pages


def test_disk_tier_survives_a_restart_and_refuses_corrupt_files(tmp_path):
    pages = chain(3)
    tier = KVTier(LAYOUT, host_bytes=0, disk_dir=str(tmp_path))
    for p in pages:
        tier.put(p.digest, encode_page(LAYOUT, p))
    again = KVTier(LAYOUT, host_bytes=1 << 20, disk_dir=str(tmp_path))
    got = again.load([p.digest for p in pages])
    assert [p.digest for p in got] == [p.digest for p in pages]
    assert again.stats.disk_hits == 3
    # Another model never sees these files; a corrupt file is refused and removed.
    assert not KVTier(KVLayout("model-b", 4, LAYOUT.arrays), 0, str(tmp_path)).contains(
        pages[0].digest
    )
    third = KVTier(LAYOUT, host_bytes=0, disk_dir=str(tmp_path))
    path = third.disk._path(pages[1].digest)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[100] ^= 1
        f.seek(0)
        f.write(bytes(data))
    assert len(third.load([p.digest for p in pages])) == 1  # stops at the corrupt page
    assert third.stats.errors == 1 and not third.contains(pages[1].digest)


def test_a_failing_disk_is_counted_and_harmless(tmp_path, monkeypatch):
    tier = KVTier(LAYOUT, host_bytes=0, disk_dir=str(tmp_path))

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier.disk, "_write_file", full)
    p = make_page()
    tier.put(p.digest, encode_page(LAYOUT, p))
    assert tier.stats.errors == 1 and tier.load([p.digest]) == []


def test_salted_pages_only_load_under_their_salt():
    tier = KVTier(LAYOUT, host_bytes=1 << 20)
    a = chain(2, salt="a")
    for p in a:
        tier.put(p.digest, encode_page(LAYOUT, p))
    assert len(tier.load([p.digest for p in a], salt="a")) == 2
    assert tier.load([p.digest for p in a], salt="b") == []  # the chain check refuses


# ------------------------------------------- the engine with the tier (mock model)


def tier_engine(tmp_path=None, **kw):
    kw.setdefault("kv_offload_bytes", 1 << 20)
    if tmp_path is not None:
        kw["kv_offload_dir"] = str(tmp_path)
    return make_engine(num_pages=kw.pop("num_pages", 12), **kw)


def evicting_round(engine, prompts, rid):
    """Runs each prompt alone (each evicts the one before from the small device pool)."""
    done = {}
    for i, prompt in enumerate(prompts):
        reqs = {f"{rid}{i}": (prompt, params(3), {})}
        done.update(run(engine, reqs))
        assert_exact(done, reqs)
        engine.kv_connector.flush()
    return done


def test_an_evicted_prefix_comes_back_from_the_tier_exactly():
    rs = random.Random(0)
    prompts = [[rs.randrange(1, VOCAB) for _ in range(30)] for _ in range(4)]
    engine = tier_engine()  # 11 pages of 4 tokens: one 30-token prompt at a time
    evicting_round(engine, prompts, "a")
    assert engine.tier.stats.stores > 0
    done = evicting_round(engine, prompts, "b")
    stats = engine.stats()
    assert stats.kv_tier_loads >= 3 * 7 and stats.kv_tier_errors == 0
    assert all(done[f"b{i}"].num_cached_tokens == 28 for i in range(4))


def test_without_the_tier_the_same_workload_recomputes():
    rs = random.Random(0)
    prompts = [[rs.randrange(1, VOCAB) for _ in range(30)] for _ in range(4)]
    engine = make_engine(num_pages=12)
    for rid in "ab":
        done = {}
        for i, prompt in enumerate(prompts):
            done.update(run(engine, {f"{rid}{i}": (prompt, params(3), {})}))
    assert done["b0"].num_cached_tokens == 0


def test_a_restarted_engine_hits_the_disk_tier(tmp_path):
    rs = random.Random(1)
    prompts = [[rs.randrange(1, VOCAB) for _ in range(30)] for _ in range(3)]
    evicting_round(tier_engine(tmp_path), prompts, "a")
    engine = tier_engine(tmp_path, kv_offload_bytes=0)  # disk only, a fresh process's pool
    done = evicting_round(engine, prompts[:2], "b")  # the last prompt's pages stayed on device
    assert done["b0"].num_cached_tokens == 28 and engine.tier.stats.disk_hits >= 7


def test_tenants_never_load_each_others_pages():
    rs = random.Random(2)
    prompts = [[rs.randrange(1, VOCAB) for _ in range(30)] for _ in range(3)]
    engine = tier_engine()
    for i, prompt in enumerate(prompts):
        run(engine, {f"a{i}": (prompt, params(3), {"cache_salt": "a"})})
    engine.kv_connector.flush()
    hits = engine.tier.stats.hits
    done = run(engine, {"b": (prompts[0], params(3), {"cache_salt": "b"})})
    assert done["b"].num_cached_tokens == 0 and engine.tier.stats.hits == hits
    done = run(engine, {"a": (prompts[0], params(3), {"cache_salt": "a"})})
    assert done["a"].num_cached_tokens == 28


@pytest.mark.parametrize(
    "kw", [dict(), dict(debug_preemption_rate=0.2), dict(budget=5, max_num_seqs=4)]
)
def test_a_busy_workload_with_the_tier_is_exact_and_leaks_no_page(kw):
    rs = random.Random(3)
    shared = [rs.randrange(1, VOCAB) for _ in range(24)]
    engine = tier_engine(num_pages=24, kv_offload_bytes=1 << 14, **kw)
    for _ in range(3):
        reqs = random_requests(rs, 12, shared=shared)
        reqs["n"] = (shared + [7], params(4, n=3), {})
        assert_exact(run(engine, reqs), reqs)
        # The tier stores on its own thread: a round's pages are there for the next
        # only once stored (under load the next round's admission came first, and the
        # check below failed with no load).
        engine.kv_connector.flush()
    assert engine.tier.stats.loads > 0


def test_a_corrupt_tier_page_is_recomputed_not_installed():
    rs = random.Random(4)
    prompts = [[rs.randrange(1, VOCAB) for _ in range(30)] for _ in range(3)]
    engine = tier_engine()
    evicting_round(engine, prompts, "a")
    tier = engine.tier
    for digest in list(tier._host):  # flip one bit of every stored page
        data = bytearray(tier._host[digest])
        data[len(data) // 2] ^= 1
        tier._host[digest] = bytes(data)
    done = evicting_round(engine, prompts[:1], "b")
    assert done["b0"].num_cached_tokens == 0 and tier.stats.errors == 1 and tier.stats.loads == 0


def test_mock_runner_pages_move_through_the_tier():
    """The mock's gather/scatter (which the tests above rely on) move slot contents."""
    engine = tier_engine()
    runner: MockRunner = engine.runner
    runner.slots.update({4 * 3 + i: 10 + i for i in range(4)})
    got = runner.gather_pages([3])["kv"][0]
    runner.scatter_pages([5], [{"kv": got}])
    assert [runner.slots[20 + i] for i in range(4)] == [10, 11, 12, 13]
    assert expected_tokens([1], 1, VOCAB) == [1]


# ------------------------------------------------ the engine with a real tiny model


def tiny_prompts(n=4, length=30, seed=5):
    rs = np.random.RandomState(seed)
    return [{"prompt_token_ids": rs.randint(3, 320, size=length).tolist()} for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir):
    """Greedy and seeded outputs of each prompt, alone, with a pool big enough to keep all."""
    from test_engine import make_llm

    llm = make_llm(tiny_model_dir)
    return {
        name: [
            llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in tiny_prompts()
        ]
        for name, sp in SAMPLING.items()
    }


SAMPLING = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_tier_outputs_equal_no_tier_after_device_eviction(tiny_model_dir, tiny_reference, kind):
    from test_engine import make_llm

    # 8 usable pages of 8 tokens: each 30-token prompt evicts the one before it.
    llm = make_llm(tiny_model_dir, num_kv_pages=9, kv_offload_bytes=64 << 20)
    engine = llm.engine
    for _ in range(2):
        for p, want in zip(tiny_prompts(), tiny_reference[kind], strict=True):
            out = llm.generate([p], SAMPLING[kind], use_tqdm=False)[0]
            assert out.outputs[0].token_ids == want
            engine.kv_connector.flush()
    assert engine.stats().kv_tier_loads >= 4 * 3 and engine.stats().kv_tier_errors == 0
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.slow
def test_restarted_engine_with_the_same_dir_gets_hits(tiny_model_dir, tiny_reference, tmp_path):
    from test_engine import make_llm

    kw = dict(num_kv_pages=9, kv_offload_dir=str(tmp_path))
    first = make_llm(tiny_model_dir, **kw)
    for p in tiny_prompts():
        first.generate([p], SAMPLING["greedy"], use_tqdm=False)
        first.engine.kv_connector.flush()
    second = make_llm(tiny_model_dir, **kw)
    out = second.generate(tiny_prompts()[:1], SAMPLING["greedy"], use_tqdm=False)[0]
    assert out.num_cached_tokens == 24 and second.engine.tier.stats.disk_hits == 3
    assert out.outputs[0].token_ids == tiny_reference["greedy"][0]


@pytest.mark.slow
def test_moving_pages_compiles_nothing_after_warm_up(tiny_model_dir):
    from test_engine import make_llm

    llm = make_llm(tiny_model_dir, num_kv_pages=9, kv_offload_bytes=64 << 20, warmup=True)
    compiled = llm.engine.runner.compiles.count
    for _ in range(2):
        for p in tiny_prompts():
            llm.generate([p], SAMPLING["greedy"], use_tqdm=False)
    assert llm.engine.stats().kv_tier_loads > 0
    assert llm.engine.runner.compiles.count == compiled


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_offload_bytes=-1), "kv_offload_bytes must be a non-negative integer, got -1"),
        (dict(kv_offload_bytes=1.5), "kv_offload_bytes must be a non-negative integer"),
        (dict(kv_offload_dir=""), "kv_offload_dir must be a directory path"),
        (dict(kv_offload_bytes=1, enable_prefix_caching=False), "enable_prefix_caching is off"),
    ],
)
def test_bad_tier_config_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        make_engine(**kw)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        dict(speculative_config=dict(method="ngram", num_speculative_tokens=3)),
        dict(max_num_batched_tokens=4, max_num_seqs=4, min_token_bucket=4),  # chunked prefill
        dict(debug_preemption_rate=0.3),
        dict(attention_backend="pallas_tpu_interpret"),
        dict(attention_backend="pallas_gpu_interpret"),
    ],
    ids=["ngram", "chunked", "preemption", "pallas_tpu", "pallas_gpu"],
)
def test_the_tier_composes(tiny_model_dir, tiny_reference, kw):
    from test_engine import make_llm

    llm = make_llm(tiny_model_dir, num_kv_pages=9, kv_offload_bytes=64 << 20, **kw)
    for _ in range(2):
        for kind in ("greedy", "seeded"):
            outs = [llm.generate([p], SAMPLING[kind], use_tqdm=False)[0] for p in tiny_prompts()]
            assert [o.outputs[0].token_ids for o in outs] == tiny_reference[kind]
    assert llm.engine.stats().kv_tier_loads > 0
    llm.engine.pool.check_invariant()
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


@pytest.mark.slow
def test_the_tier_composes_with_n_samples_and_structured_output(tiny_model_dir):
    from test_engine import make_llm

    from jaxserve.sampling_params import StructuredOutputsParams

    requests = [
        (tiny_prompts()[0], SamplingParams(n=3, seed=4, max_tokens=5, ignore_eos=True)),
        (
            tiny_prompts()[1],
            SamplingParams(
                seed=9, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{3,6}")
            ),
        ),
    ]
    want = [
        [c.token_ids for c in make_llm(tiny_model_dir).generate([p], sp, use_tqdm=False)[0].outputs]
        for p, sp in requests
    ]
    llm = make_llm(tiny_model_dir, num_kv_pages=9, kv_offload_bytes=64 << 20)
    for _ in range(2):
        for (p, sp), w in zip(requests, want, strict=True):
            outs = llm.generate([p], sp, use_tqdm=False)[0].outputs
            assert [c.token_ids for c in outs] == w
            llm.generate(tiny_prompts()[2:], SAMPLING["greedy"], use_tqdm=False)  # evicts
    assert llm.engine.stats().kv_tier_loads > 0


@pytest.mark.slow
def test_the_tier_composes_with_a_draft_model():
    from jaxserve import LLM

    base = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
    prompts = [[3 + (7 * i + j) % 200 for j in range(40)] for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for o in LLM(**base).generate([{"prompt_token_ids": p} for p in prompts], greedy)
    ]
    spec = dict(method="draft_model", model="demo-model-tiny", num_speculative_tokens=3)
    llm = LLM(
        **base,
        speculative_config=spec,
        block_size=8,
        num_kv_pages=9,
        kv_offload_bytes=64 << 20,
    )
    for _ in range(2):
        for p, w in zip(prompts, want, strict=True):
            out = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == w
    assert llm.engine.stats().kv_tier_loads > 0


def test_pages_still_on_the_device_are_saved_at_shutdown(tmp_path):
    rs = random.Random(6)
    prompt = [rs.randrange(1, VOCAB) for _ in range(30)]
    engine = tier_engine(tmp_path, num_pages=64)  # nothing is evicted
    run(engine, {"a": (prompt, params(3), {})})
    assert engine.tier.stats.stores == 0
    engine.save_kv_tier()
    assert engine.tier.stats.stores == 8  # 32 of the 33 tokens computed: 8 full pages
    again = tier_engine(tmp_path, kv_offload_bytes=0)
    done = run(again, {"b": (prompt, params(3), {})})
    assert done["b"].num_cached_tokens == 28
