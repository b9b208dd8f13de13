"""Run in a subprocess with 8 fake CPU devices: expert-parallel MoE equals one device.

Usage: python moe_sharded_check.py MODEL_DIR DATA MODEL

Checks, on a ('data', 'model') mesh:
- the MoE layer alone, its experts sharded over 'model' and traced under the mesh
  (the shard_map expert-parallel path, both grouped matmuls), equals the unsharded
  layer; with an expert count 'model' does not divide, the partitioner's fallback too;
- the whole model (MODEL_DIR, an MoE checkpoint) with expert + tensor parallelism,
  traced with and without the mesh in context, gives the unsharded logits.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import jax
from engine_utils import engine_config

from jaxserve.distributed import meshes
from jaxserve.distributed.meshes import make_mesh
from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step import StepInput, forward
from models.moe import Experts, route


def check_layer(mesh, num_experts: int, impl: str) -> None:
    from flax import nnx

    experts = Experts(
        num_experts, 24, 40, names=("g", "u", "d"), act="silu", dtype=np.float32, rngs=nnx.Rngs(0)
    )
    rs = np.random.RandomState(num_experts)
    x = rs.randn(37, 24).astype(np.float32)
    ids, w = route(rs.randn(37, num_experts).astype(np.float32), 2, norm_topk_prob=True)
    graphdef, state = nnx.split(experts)

    def layer(x, ids, w, state):
        return nnx.merge(graphdef, state)(x, ids, w, impl=impl)

    want = np.asarray(jax.jit(layer)(x, ids, w, state))
    # By expert where 'model' divides E; else by the experts' hidden dimension.
    sharded = jax.device_put(state, meshes.state_shardings(state, mesh))
    divisible = num_experts % mesh.shape["model"] == 0
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(layer)(x, ids, w, sharded))
        got = np.asarray(jax.block_until_ready(jax.jit(layer)(x, ids, w, sharded)))
    assert ("shard_map" in jaxpr) == divisible, (num_experts, impl)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    print(f"layer E={num_experts} {impl}: expert parallel {divisible}, equal")


def check_model(model_dir: str, mesh) -> None:
    config = engine_config(model_dir, page_size=8)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(3, 128, size=n).tolist() for n in (5, 19, 8)]
    work = [SeqWork(p, 0, list(range(1 + 3 * i, 4 + 3 * i))) for i, p in enumerate(prompts)]

    def logits(runner):
        out = runner.execute(runner.build(work, all_logits=True))
        return np.asarray(jax.block_until_ready(out))

    want = logits(ModelRunner(config))
    runner = ModelRunner(config, mesh=mesh)
    state = runner.model_def.state(runner.weights)
    moe_layers = [
        layer["block_sparse_moe"] if "block_sparse_moe" in layer else layer["mlp"]
        for layer in state["model"]["layers"].values()
    ]
    experts = next(m["experts"] for m in moe_layers if "experts" in m)
    spec = next(iter(experts.values()))[...].sharding.spec
    print("experts sharded as", spec)
    assert spec[0] == "model", spec
    # The runner traces its steps under its mesh: the experts run expert-meshes.
    batch = runner.build(work, all_logits=True)
    with runner.on_mesh():  # the context every step of the runner is traced in
        text = forward.lower(
            runner.model_def,
            runner.weights,
            runner.kv_caches,
            StepInput.packed(batch),
            runner.no_prev_tokens,
        ).as_text()
    assert "manual_computation" in text or "shard_map" in text, "no expert-parallel region"
    got = logits(runner)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    print("model: expert + tensor parallel logits equal, max diff", np.abs(got - want).max())


def main(model_dir: str, data: int, model: int) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    mesh = make_mesh(data=data, model=model)
    for num_experts in (8, 6):
        for impl in ("tiles", "ragged_dot"):
            check_layer(mesh, num_experts, impl)
    check_model(model_dir, mesh)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
