"""Run in a subprocess with 8 fake CPU devices: sharded logits must equal unsharded.

Usage: python sharded_check.py MODEL_DIR DATA MODEL
"""

import os
import sys

import numpy as np
from jax.sharding import PartitionSpec

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import engine_config

from jaxserve.distributed.meshes import make_mesh
from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner


def main(model_dir: str, data: int, model: int) -> None:
    import jax

    assert len(jax.devices()) == 8, jax.devices()
    config = engine_config(model_dir, page_size=8)
    mesh = make_mesh(data=data, model=model)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(3, 128, size=n).tolist() for n in (5, 19, 8)]
    work = [SeqWork(p, 0, list(range(1 + 3 * i, 4 + 3 * i))) for i, p in enumerate(prompts)]

    results = []
    for m in (None, mesh):
        runner = ModelRunner(config, mesh=m)
        logits = runner.execute(runner.build(work, all_logits=True))
        results.append(np.asarray(jax.block_until_ready(logits)))
        if m is not None:
            state = runner.model_def.state(runner.weights)
            q = state["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
            assert q.sharding.spec == PartitionSpec(None, "model"), q.sharding
            assert len(q.sharding.device_set) == 8
            print("kv sharded over model:", "model" in runner.kv_caches[0].sharding.spec)
    np.testing.assert_allclose(results[1], results[0], atol=2e-5, rtol=1e-5)
    print("max diff", np.abs(results[1] - results[0]).max())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
