"""Run in a subprocess with 8 fake CPU devices: the engine with tensor parallelism
gives what one device gives.

Usage: python tp_engine_check.py MODEL_DIR TP[,TP...] [SCENARIO[,SCENARIO...]]

For each scenario, `LLM(tensor_parallel_size=1)` and then each TP serve the same
prompts (token ids, shared prefixes) with greedy decoding (logprobs too) and seeded
sampling with n=2; the greedy tokens and samples must be equal, the logprobs close.
Scenarios: "basic"; "stress" (prefix caching hits, chunked prefill, preemption from a
short pool); "int8" (int8 weights quantized at load, with "stress"'s settings) and
"int8_orbax" (int8 weights from `jaxserve convert --quantization=int8`); "int4" (as
"int8", 4-bit); "ngram" and
"draft" (speculative decoding; the draft model is the model itself, sharded the same
way); "guard" (warm-up, then zero compilations while serving).
Every step is waited for (the engine fetches each step's tokens), which keeps the CPU
collectives from deadlocking.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import SMALL_LLM_IDS

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import convert

BASE = SMALL_LLM_IDS

SCENARIOS = {
    "basic": {},
    # 16-token steps chunk every prompt; 12 pages of 8 cannot hold the batch: preemption.
    "stress": dict(max_num_batched_tokens=16, num_kv_pages=12, max_num_seqs=4),
    # The same, with asynchronous scheduling and the KV tier taking evicted pages.
    "async_tier": dict(
        max_num_batched_tokens=16,
        num_kv_pages=12,
        max_num_seqs=4,
        async_scheduling=True,
        kv_offload_bytes=1 << 22,
    ),
    # ... with an int8 KV cache (its scales sharded as the pages' heads).
    "async_tier_int8": dict(
        max_num_batched_tokens=16,
        num_kv_pages=12,
        max_num_seqs=4,
        async_scheduling=True,
        kv_offload_bytes=1 << 22,
        kv_cache_dtype="int8",
    ),
    # int8 weights quantized at load (each int8 array and scale sharded as its layer),
    # with prefix hits, chunked prefill and preemption.
    "int8": dict(quantization="int8", max_num_batched_tokens=16, num_kv_pages=12, max_num_seqs=4),
    # The same with int4 weights (an MoE model's experts too, split over the devices),
    # XLA's int4 products on both sides (one device's CPU kernel takes x in 16-bit fixed
    # point: logprobs 3e-4 apart).
    "int4": dict(
        quantization="int4",
        native_cpu_kernels=False,
        max_num_batched_tokens=16,
        num_kv_pages=12,
        max_num_seqs=4,
    ),
    # int8 weights stored by `jaxserve convert --quantization=int8`, restored straight
    # into their shardings.
    "int8_orbax": "int8_orbax",
    "ngram": dict(speculative_config=dict(method="ngram", num_speculative_tokens=3)),
    "draft": "draft",
    "guard": dict(warmup=True, compile_guard=True, max_num_seqs=4, max_num_batched_tokens=32),
}


def prompts(vocab: int) -> list[dict]:
    rs = np.random.RandomState(0)
    system = rs.randint(3, vocab, size=21).tolist()
    return [
        {"prompt_token_ids": system[:k] + rs.randint(3, vocab, size=m).tolist()}
        for k, m in ((21, 5), (21, 9), (13, 7), (0, 30), (21, 1))
    ]


def serve(model_dir: str, tp: int, scenario: str):
    kw = SCENARIOS[scenario]
    if kw == "int8_orbax":
        int8_dir = os.path.join(model_dir, "int8-orbax")
        if not os.path.exists(int8_dir):
            convert(model_dir, int8_dir, quantization="int8")
        model_dir, kw = int8_dir, {}
    if kw == "draft":
        kw = dict(speculative_config=dict(method="draft_model", num_speculative_tokens=2))
        kw["speculative_config"]["model"] = model_dir
    llm = LLM(model_dir, tensor_parallel_size=tp, **{**BASE, **kw})
    runner = llm.engine.runner
    assert (runner.mesh is None) == (tp == 1), runner.mesh
    if tp > 1:
        assert runner.mesh.shape["model"] == tp
    ps = prompts(llm.config.model.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, n=2, seed=7, ignore_eos=True)
    before = runner.compiles.count
    tokens, logprobs = [], []
    for params in (greedy, sampled):
        for out in llm.generate(ps + ps[:2], params, use_tqdm=False):  # again: cache hits
            for c in out.outputs:
                tokens.append(c.token_ids)
                if c.logprobs is not None:
                    logprobs.append([lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
    stats = llm.engine.stats()
    llm.engine.pool.check_invariant()
    assert llm.engine.pool.num_free == llm.engine.pool.capacity
    if scenario.startswith("int8"):
        assert llm.config.quantization == "int8" and any(w.dtype == np.int8 for w in runner.weights)
    if scenario == "int4":
        assert any(w.dtype == jnp.int4 for w in runner.weights)
    if scenario.startswith(("stress", "async_tier")) or scenario in ("int8", "int4"):
        assert stats.num_preemptions > 0, stats
    if scenario.startswith("async_tier"):
        assert llm.engine.tier.stats.loads > 0, llm.engine.tier.stats
    if scenario in ("stress", "basic", "int8", "int8_orbax", "int4"):
        assert stats.prefix_cache_hits > 0, stats
    if scenario in ("ngram", "draft"):
        assert stats.spec_decode_num_accepted_tokens > 0, stats
    if scenario == "guard":
        assert runner.compiles.count == before, (before, runner.compiles.count)
    return tokens, logprobs


def main(model_dir: str, tps: str, scenarios: str = "basic") -> None:
    assert len(jax.devices()) == 8, jax.devices()
    for scenario in scenarios.split(","):
        want_tokens, want_lp = serve(model_dir, 1, scenario)
        for tp in map(int, tps.split(",")):
            tokens, lp = serve(model_dir, tp, scenario)
            assert tokens == want_tokens, (scenario, tp, tokens, want_tokens)
            for got, want in zip(lp, want_lp, strict=True):
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
            print(f"{scenario} tp={tp}: {len(tokens)} outputs equal to tp=1")


if __name__ == "__main__":
    main(*sys.argv[1:])
