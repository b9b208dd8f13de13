"""Run in a subprocess with 8 fake CPU devices: an int4 engine split over 2 devices
(`LLM(quantization="int4", tensor_parallel_size=2)`) gives one device's greedy tokens
and logprobs, its int4 kernels and their group scales split alike: the row-parallel
projections (o_proj, down_proj) on their inputs, on whole groups.

Usage: python int4_tp_check.py MODEL_DIR  (the demo model: o_proj's 256 inputs are 2
groups of 128, down_proj's 768 are 6)
"""

import os
import sys

import jax
import numpy as np
from jax.sharding import PartitionSpec

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import SMALL_LLM_IDS

from jaxserve import LLM, SamplingParams


def serve(model_dir: str, tp: int):
    llm = LLM(model_dir, tensor_parallel_size=tp, quantization="int4", **SMALL_LLM_IDS)
    rs = np.random.RandomState(0)
    prompts = [{"prompt_token_ids": rs.randint(3, 4000, size=n).tolist()} for n in (5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate(prompts + prompts[:1], params, use_tqdm=False)]
    llm.engine.pool.check_invariant()
    runner = llm.engine.runner
    weights = {
        jax.tree_util.keystr(p): x
        for p, x in jax.tree_util.tree_leaves_with_path(runner.model_def.state(runner.weights))
    }
    return outs, weights


def spec(weights, layer: str, name: str) -> PartitionSpec:
    """The sharding of layer 0's `layer` projection's array `name`."""
    [x] = [x for k, x in weights.items() if "[0]" in k and f"['{layer}']['{name}']" in k]
    return x.sharding.spec


def main(model_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    want, _ = serve(model_dir, 1)
    got, weights = serve(model_dir, 2)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        lp = [[d[t] for d, t in zip(c.logprobs, c.token_ids, strict=True)] for c in (g, w)]
        np.testing.assert_allclose(*lp, atol=1e-4, rtol=1e-4)
    for layer in ("o_proj", "down_proj"):  # row-parallel: inputs and groups split
        for name in ("kernel", "scale"):
            assert tuple(spec(weights, layer, name)) == (None, "model"), (layer, name)
    for layer in ("q_proj", "up_proj"):  # column-parallel: outputs split
        for name in ("kernel", "scale"):
            assert tuple(spec(weights, layer, name)) == ("model", None), (layer, name)
    print(f"int4 tp=2: greedy tokens equal one device's ({len(got)} outputs)")


if __name__ == "__main__":
    main(*sys.argv[1:])
