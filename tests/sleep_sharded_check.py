"""Run in a subprocess with 8 fake CPU devices: sleep and wake-up of an engine on a
tensor-parallel mesh (its weights and KV caches sharded and committed): after
`sleep(2)` every buffer is deleted, after `wake_up()` the engine gives the same greedy
tokens, and nothing was compiled again (the KV caches come back from the zeros
program that first made them). Scenarios: a float32 KV cache; an int8 one (pages and
scales); a draft model (speculative decoding: its weights and KV sleep too).

Usage: python sleep_sharded_check.py
"""

import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import SMALL_LLM_IDS

from jaxserve import LLM, SamplingParams
from jaxserve.runner import residency

PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [40] * 19}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SCENARIOS = {
    "float32": {},
    "int8 KV": dict(kv_cache_dtype="int8"),
    "draft": dict(
        speculative_config=dict(
            method="draft_model", model="demo-model-tiny", num_speculative_tokens=2
        )
    ),
}


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def main() -> None:
    for name, extra in SCENARIOS.items():
        with LLM("demo-model-tiny", tensor_parallel_size=2, **SMALL_LLM_IDS, **extra) as llm:
            runner = llm.engine.runner
            want = tokens(llm)
            compiles = runner.compiles.count
            models = [runner] + ([runner.drafter] if runner.drafter else [])
            buffers = [x for m in models for x in jax.tree.leaves((m.weights, m.kv_caches))]
            assert all(len(x.sharding.device_set) == 2 for x in buffers)
            freed = residency.live_bytes(buffers)
            before = sum(x.nbytes for x in jax.live_arrays())
            llm.sleep(2)
            assert all(x.is_deleted() for x in buffers), name
            assert before - sum(x.nbytes for x in jax.live_arrays()) >= freed, name
            llm.wake_up()
            again = [x for m in models for x in jax.tree.leaves((m.weights, m.kv_caches))]
            assert [x.sharding for x in again] == [x.sharding for x in buffers], name
            assert tokens(llm) == want, name
            assert runner.compiles.count == compiles, (name, runner.compiles.count, compiles)
            print(f"tp=2 {name}: sleep(2) freed {freed} bytes; same tokens, 0 compiles")


if __name__ == "__main__":
    main()
