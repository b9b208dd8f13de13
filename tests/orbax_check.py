"""Run in a subprocess with 8 fake CPU devices: an orbax model directory (`jaxserve
convert`) gives the safetensors load's logits exactly, unsharded and with TP 4, and a
sharded restore reads each stored byte once (not once per device).

Usage: python orbax_check.py HF_DIR ORBAX_DIR
"""

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import engine_config, prompt_logits

from jaxserve.checkpoint import load_model
from jaxserve.distributed import meshes
from jaxserve.runner.model_runner import ModelRunner


def bytes_read() -> int:
    """This process's bytes read by read(2)-family calls so far (Linux /proc)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def main(hf_dir: str, orbax_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    ids = list(range(3, 40))
    for tp in (1, 4):
        logits = []
        for model_dir in (hf_dir, orbax_dir):
            runner = ModelRunner(engine_config(model_dir, tensor_parallel_size=tp))
            logits.append(prompt_logits(runner, ids, [1, 2, 3, 4, 5]))
        np.testing.assert_array_equal(logits[1], logits[0])
        print(f"tp={tp}: orbax logits equal safetensors logits")

    stored = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(os.path.join(orbax_dir, "orbax"))
        for f in files
    )
    config = engine_config(orbax_dir).model
    read = {}
    for tp in (1, 4, 8):
        mesh = meshes.engine_mesh(tp)
        before = bytes_read()
        model = load_model(orbax_dir, config, mesh=mesh)
        jax.block_until_ready(jax.tree.leaves(model))
        read[tp] = bytes_read() - before
        print(f"tp={tp}: restore read {read[tp]} bytes of {stored} stored")
    # Each device reads only its shard: with 4 or 8 devices the process reads about
    # what one device does (replicated norms and the like are read per device).
    assert read[4] < 1.3 * read[1] and read[8] < 1.5 * read[1], (read, stored)
    assert read[1] < 1.2 * stored, (read, stored)


if __name__ == "__main__":
    main(*sys.argv[1:])
