"""The engine's capabilities together: asynchronous scheduling, the KV tier,
quantized weights and KV pages, speculative decoding, on top of prefix caching,
preemption, chunked prefill and n > 1.

Each feature is tested alone in its own file; here, the combinations. What one
feature must not change is checked against a run without it on the same
numerics: asynchronous scheduling and the tier never change an output; a
quantized run is compared with the same quantization synchronously, without the
tier.
"""

import pytest
from test_async_scheduling import assert_same, generate, mixed_params
from test_engine import make_llm, shared_prefix_prompts

# A pool too small for the workload: pages are evicted (to the tier, when there is
# one) and running sequences preempted; small steps chunk the prompts.
BUSY = dict(num_kv_pages=14, max_num_batched_tokens=16, max_num_seqs=4, min_token_bucket=8)
TIER = dict(kv_offload_bytes=1 << 22)


def run_twice(path, **kw):
    """Two rounds of the mixed workload (the second hits the prefix cache or the tier)."""
    llm = make_llm(path, **BUSY, **kw)
    prompts, sps = shared_prefix_prompts(4), mixed_params(llm.tokenizer)
    outs = [generate(llm, prompts, sps) for _ in range(2)]
    return outs, llm.engine


@pytest.mark.slow
@pytest.mark.parametrize(
    "numerics",
    [dict(), dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8", quantization="int8")],
    ids=["float32", "int8-kv", "fp8-kv-int8-weights"],
)
def test_async_scheduling_and_the_tier_change_no_output(tiny_model_dir, numerics):
    base, _ = run_twice(tiny_model_dir, **numerics)
    both, engine = run_twice(tiny_model_dir, async_scheduling=True, **TIER, **numerics)
    for a, b in zip(both, base, strict=True):
        # (the tier finds more cached tokens; everything else is the same)
        assert_same(*([(c, 0, lp) for c, _, lp in out] for out in (a, b)))
    assert engine.tier.stats.stores > 0  # the pool was too small: pages went to the tier
    assert engine.tier.stats.loads > 0
