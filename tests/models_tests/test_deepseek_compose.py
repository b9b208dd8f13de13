"""DeepSeek-V3's latent attention (a shared cache: one row a token) with what the
engine does beside it, each against the same model without it on the same numerics:
the KV tier, preemption from a short pool, asynchronous scheduling and n-gram
speculation together (greedy and seeded n = 2 samples, two rounds: the second from
the prefix cache and the tier); a draft model (itself: a draft's shared cache on the
target's page tables); sleep and wake; weights updated in place against a
fresh engine of the new weights.
"""

import numpy as np
import pytest
from test_deepseek_parity import CASES, PAGE, make_deepseek

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams

# A pool too small for four requests (pages evicted, sequences preempted), 16-token
# steps (chunked prefill), prompts sharing a prefix of two pages.
BUSY = dict(num_kv_pages=14, max_num_batched_tokens=16, max_num_seqs=4, min_token_bucket=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, n=2, seed=7, max_tokens=8, ignore_eos=True)


def _prompts() -> list[dict]:
    rs = np.random.RandomState(3)
    shared = rs.randint(3, 200, size=2 * PAGE).tolist()
    tails = [rs.randint(3, 200, size=n).tolist() for n in (3, 9, 14, 20)]
    return [{"prompt_token_ids": shared + t} for t in tails]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Two DeepSeek-V3 checkpoints of one config: W, and W' (another seed)."""
    arch, overrides = CASES["v3_grouped_routing"]
    out = []
    for seed in (0, 1):
        path = str(tmp_path_factory.mktemp(f"v3_seed{seed}"))
        make_deepseek(path, arch, overrides, seed=seed)
        out.append(path)
    return out


def make(path: str, **kw) -> LLM:
    return LLM(
        path,
        skip_tokenizer_init=True,
        block_size=PAGE,
        max_model_len=128,
        sampling_branches="host",
        compilation_cache_dir=None,
        **{**dict(num_kv_pages=64, max_num_seqs=4, max_num_batched_tokens=32), **kw},
    )


def tokens(llm: LLM, params: SamplingParams = GREEDY, prompts=PROMPTS) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def want(paths):
    """W's greedy tokens and seeded samples from a roomy engine (no preemption)."""
    llm = make(paths[0])
    try:
        return tokens(llm), tokens(llm, SAMPLED), llm.engine.runner.cache_layout
    finally:
        llm.close()


def test_the_tier_preemption_async_scheduling_and_ngrams_change_no_output(paths, want):
    greedy, sampled, layout = want
    assert layout.shared_kv and layout.rows == 1
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make(
        paths[0], async_scheduling=True, kv_offload_bytes=1 << 22, speculative_config=spec, **BUSY
    )
    filler = [{"prompt_token_ids": list(range(10 + i, 50 + i))} for i in range(4)]
    try:
        for _ in range(2):  # the second round finds the prefix in the tier
            assert tokens(llm) == greedy
            assert tokens(llm, SAMPLED) == sampled
            tokens(llm, prompts=filler)  # other prompts take the pool: pages to the tier
        stats, engine = llm.engine.tier.stats, llm.engine
        assert stats.stores > 0 and stats.loads > 0  # pages went to the tier and came back
        assert engine.stats().num_preemptions > 0
    finally:
        llm.close()


def test_a_draft_model_keeps_the_greedy_tokens(paths, want):
    spec = {"method": "draft_model", "model": paths[0], "num_speculative_tokens": 3}
    llm = make(paths[0], speculative_config=spec)  # itself: every draft is accepted
    try:
        assert tokens(llm) == want[0]
        assert llm.engine.drafter.kv_caches[0].shape[2] == 1  # its cache is shared too
    finally:
        llm.close()


def test_sleep_wake_and_an_update_of_the_weights(paths, want):
    llm = make(paths[0], kv_offload_bytes=1 << 22)
    try:
        assert tokens(llm) == want[0]
        llm.sleep(level=2)
        llm.wake_up()
        assert tokens(llm) == want[0]
        assert llm.update_weights(path=paths[1]) == 1
        fresh = make(paths[1])
        try:
            assert tokens(llm) == tokens(fresh) != want[0]
        finally:
            fresh.close()
    finally:
        llm.close()
