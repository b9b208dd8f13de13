"""Run in a subprocess with 8 fake CPU devices: an fp8 checkpoint served over 2 devices
(block 128x128 scales: each device's share of a split axis whole blocks) and a
per-channel one over 2 and 4 (its scales multiply after the sum over the inputs, so the
row-parallel projections split anywhere) give one device's greedy tokens, the weights
still e4m3 and split with their scales.

Usage: python fp8_tp_check.py BLOCK_DIR CHANNEL_DIR  (test_fp8_weights' checkpoints)
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import SMALL_LLM_IDS

from jaxserve import LLM, SamplingParams


def serve(model_dir: str, tp: int):
    llm = LLM(model_dir, tensor_parallel_size=tp, **SMALL_LLM_IDS)
    rs = np.random.RandomState(0)
    prompts = [{"prompt_token_ids": rs.randint(3, 120, size=n).tolist()} for n in (5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.runner
    weights = {
        jax.tree_util.keystr(p): x
        for p, x in jax.tree_util.tree_leaves_with_path(runner.model_def.state(runner.weights))
    }
    llm.close()
    return outs, weights


def main(block_dir: str, channel_dir: str) -> None:
    for name, path, tps in (("block", block_dir, (2,)), ("channel", channel_dir, (2, 4))):
        want, _ = serve(path, 1)
        for tp in tps:
            got, weights = serve(path, tp)
            assert got == want, (name, tp, got, want)
            down = [x for k, x in weights.items() if "layers" in k and "down_proj" in k]
            kernel = next(x for x in down if x.dtype == jnp.float8_e4m3fn)
            assert len(kernel.sharding.device_set) == tp, kernel.sharding
            print(f"fp8 {name} tp={tp}: greedy tokens equal one device's")


if __name__ == "__main__":
    main(*sys.argv[1:])
