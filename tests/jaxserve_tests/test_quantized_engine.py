"""Quantized KV caches and int8 weights through the engine: capacity, composition
with prefix caching, chunked prefill, preemption, n > 1 and speculative decoding,
and the errors for what is not supported."""

import pytest
from engine_utils import engine_config
from test_engine import GREEDY, make_llm, shared_prefix_prompts

from jaxserve import LLM, SamplingParams
from jaxserve.assets import EMBEDDED_MODELS
from pallas_kernels.quantization import QuantizedKV

QUANTIZED = [
    dict(kv_cache_dtype="int8"),
    dict(kv_cache_dtype="fp8_e4m3"),
    dict(kv_cache_dtype="fp8_e5m2"),
    dict(quantization="int8"),
    dict(quantization="int8", kv_cache_dtype="int8"),
]
IDS = ["kv-int8", "kv-fp8e4m3", "kv-fp8e5m2", "w-int8", "w-int8+kv-int8"]


@pytest.mark.slow
@pytest.mark.parametrize("quant", QUANTIZED[::2], ids=IDS[::2])
def test_outputs_do_not_depend_on_caching_chunking_or_preemption(tiny_model_dir, quant):
    """Greedy outputs under one quantized configuration are the same alone without
    cache or chunking, and in a busy batch with prefix caching (twice: the second
    round hits the cache), chunked prefill, or forced preemption."""
    prompts = shared_prefix_prompts()
    alone = make_llm(tiny_model_dir, enable_prefix_caching=False, **quant)
    want = [alone.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    for kw in (
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=16, max_num_seqs=4),
        dict(debug_preemption_rate=0.3),
    ):
        llm = make_llm(tiny_model_dir, **quant, **kw)
        for _ in range(2):
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want, kw
        llm.engine.pool.check_invariant()
        assert llm.engine.pool.num_free == llm.engine.pool.capacity


@pytest.mark.parametrize("quant", QUANTIZED[1::2], ids=IDS[1::2])
def test_n_samples_share_the_quantized_prompt_pages(tiny_model_dir, quant):
    llm = make_llm(tiny_model_dir, **quant)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    a, b = llm.generate([{"prompt_token_ids": list(range(3, 40))}], greedy, use_tqdm=False)[
        0
    ].outputs
    assert a.token_ids == b.token_ids


SPECULATIVE = {
    "ngram": dict(method="ngram", num_speculative_tokens=3),
    "draft": dict(method="draft_model", model="demo-model-tiny", num_speculative_tokens=3),
}


@pytest.mark.parametrize(
    "method,quant",
    [("ngram", QUANTIZED[0]), ("draft", QUANTIZED[1]), ("draft", QUANTIZED[4])],
    ids=["ngram-kv-int8", "draft-kv-fp8e4m3", "draft-w-int8+kv-int8"],
)
def test_speculative_decoding_keeps_quantized_outputs_exact(method, quant):
    """Greedy outputs with speculation equal those without, under the same
    quantization (the draft model's KV is quantized too)."""
    kw = dict(max_model_len=256, max_num_seqs=4, block_size=16, num_kv_pages=64, warmup=False)
    prompts = ["If the file does not exist, the", "Return the number of items in the list"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(**kw, **quant).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(**kw, **quant, speculative_config=SPECULATIVE[method])
    if method == "draft":
        assert isinstance(spec_llm.engine.drafter.kv_caches[0], QuantizedKV) == (
            "kv_cache_dtype" in quant
        )
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_a_byte_budget_holds_about_four_times_the_tokens_in_int8():
    """The pool is sized in bytes: at a fixed budget int8 pages (a byte a value plus a
    float32 scale per head row) hold (4 * H) / (H + 4) times float32's tokens."""
    path = EMBEDDED_MODELS["demo-model"]
    budget = dict(kv_cache_memory_bytes=1 << 22, max_num_seqs=256, max_model_len=512)
    budget = dict(page_size=16, **budget)
    f32 = engine_config(path, num_pages=None, **budget)
    head_dim = f32.model.head_dim
    for kv in ("int8", "fp8_e4m3", "fp8_e5m2"):
        q = engine_config(path, num_pages=None, kv_cache_dtype=kv, **budget)
        assert q.kv_bytes_per_page() * (4 * head_dim) == f32.kv_bytes_per_page() * (head_dim + 4)
        ratio = q.num_kv_pages() / f32.num_kv_pages()
        assert ratio == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.02)
    budget["block_size"] = budget.pop("page_size")
    llm = LLM(warmup=False, kv_cache_dtype="int8", **budget)
    info = llm.engine.model_info()
    assert info.kv_cache_dtype == "int8"
    assert info.kv_cache_tokens == (q.num_kv_pages() - 1) * q.cache.page_size


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of .* got 'int4'"),
        (dict(quantization="nf4"), "quantization must be one of .* got 'nf4'"),
        (dict(quantization="awq"), "quantization='awq' reads a checkpoint stored in that"),
    ],
)
def test_unknown_quantization_settings_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(warmup=False, **kw)


def test_fp8_alias_and_int8_weights_in_the_model_info():
    llm = LLM(warmup=False, kv_cache_dtype="fp8", quantization="int8", max_num_seqs=4)
    assert llm.config.kv_dtype == "fp8_e4m3" and llm.config.quantization == "int8"
    info = llm.engine.model_info()
    plain = LLM(warmup=False, max_num_seqs=4).engine.model_info()
    assert info.kv_cache_dtype == "fp8_e4m3"
    # int8 weights and float32 scales per output channel / vocabulary row
    assert plain.weight_bytes / 4.2 < info.weight_bytes < plain.weight_bytes / 3.5
