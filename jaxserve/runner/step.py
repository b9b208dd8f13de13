"""The compiled step: a pure function of (model state, KV caches, batch)."""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from jaxserve.runner.input_batch import HostBatch
from jaxserve.runner.sampler import sample
from pallas_kernels import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """A step's inputs: all data fields, so only their shapes select a program."""

    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attention: AttentionMetadata
    logits_indices: jax.Array  # [B] int32: rows of the hidden states to turn into logits

    @classmethod
    def from_host(cls, b: HostBatch) -> StepInput:
        return cls(
            input_ids=b.input_ids,
            positions=b.positions,
            attention=AttentionMetadata(
                slot_mapping=b.slot_mapping,
                kv_lens=b.kv_lens,
                page_indices=b.page_indices,
                cu_q_lens=b.cu_q_lens,
                num_seqs=b.num_seqs,
            ),
            logits_indices=b.logits_indices,
        )


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def step(
    graphdef: nnx.GraphDef, state: nnx.State, kv_caches: list[jax.Array], batch: StepInput
) -> tuple[jax.Array, list[jax.Array]]:
    """One forward pass: (logits [B, V] float32, the updated KV caches).

    The graphdef is static (hashable), so every runner of the same model shares
    the compiled programs. The KV caches are donated: XLA updates them in place,
    and the caller must use the returned ones from then on.
    """
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(kv_caches, batch.input_ids, batch.positions, batch.attention)
    return model.compute_logits(hidden[batch.logits_indices]), kv_caches


# Sampling is its own program: it depends only on the sequence bucket, not the
# token bucket, so it compiles once per sequence bucket; logits stay on device.
sample_step = jax.jit(sample)
