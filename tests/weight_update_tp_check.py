"""Run in a subprocess with 8 fake CPU devices: weight updates under tensor parallelism.

Usage: python weight_update_tp_check.py OLD_DIR NEW_DIR

An engine of OLD_DIR with tensor_parallel_size=2, updated to NEW_DIR's weights, gives
what a fresh engine of NEW_DIR gives, and compiles nothing, whether the new arrays
come on one device (each re-sharded onto the engine's sharding), already sharded as
the engine's (used as they are), or from an orbax directory (each device reading its
shard); int8 weights are quantized again from the float ones. Data-parallel replicas
are each updated onto their own devices (`LLM.update_weights` through their front).
Prints one "ok ..." line per check.
"""

import os
import sys

import jax
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import SMALL_LLM_IDS

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import convert, load_model
from jaxserve.config import ModelConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 19, 30)]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def main(old_dir: str, new_dir: str) -> None:
    one_device = nnx.state(load_model(new_dir, ModelConfig.from_pretrained(new_dir)))
    orbax_dir = convert(new_dir, os.path.join(new_dir, "orbax"))
    for quant in (None, "int8"):
        kw = dict(SMALL_LLM_IDS, tensor_parallel_size=2, quantization=quant)
        fresh = LLM(new_dir, **kw)
        want = tokens(fresh)
        llm = LLM(old_dir, **kw)
        assert tokens(llm) != want
        runner = llm.engine.runner
        shardings = [w.sharding for w in runner.weights]
        llm.update_weights(one_device)
        assert [w.sharding for w in runner.weights] == shardings
        assert tokens(llm) == want
        print(f"ok {quant} re-sharded from one device")
        # (Re-sharding a one-device array compiles a slicing program per shape, once;
        # the steps compile nothing.)
        before = runner.compiles.count
        llm.update_weights(path=orbax_dir)
        assert tokens(llm) == want
        print(f"ok {quant} from orbax")
        llm.update_weights(one_device)
        assert tokens(llm) == want
        assert runner.compiles.count == before, runner.compiles.count - before
        print(f"ok {quant} compiled nothing")
        if quant is None:  # the fresh engine's arrays: sharded as this one's
            state = fresh.engine.runner.model_def.state(fresh.engine.runner.weights)
            llm.update_weights(state)
            assert all(a is b for a, b in zip(runner.weights, jax.tree.leaves(state), strict=True))
            assert tokens(llm) == want
            print("ok adopted as sharded")
    want = tokens(LLM(new_dir, **SMALL_LLM_IDS))
    dp = LLM(old_dir, **SMALL_LLM_IDS, data_parallel_size=2)
    try:
        engines = [r.engine for r in dp.engine.replicas]
        shardings = [[w.sharding for w in e.runner.weights] for e in engines]
        assert dp.update_weights(one_device) == 1
        assert [e.weight_version for e in engines] == [1, 1]
        # Each replica's copy on its own device, placed as its weights were.
        assert [[w.sharding for w in e.runner.weights] for e in engines] == shardings
        assert tokens(dp) == want
        assert dp.reset_prefix_cache() and not any(e.pool.num_cached for e in engines)
        print("ok data parallel updated")
    finally:
        dp.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
