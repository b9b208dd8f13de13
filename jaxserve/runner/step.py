"""The compiled step: a pure function of (model state, KV caches, batch)."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jaxserve.runner.input_batch import HostBatch
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


def make_step(graphdef: nnx.GraphDef):
    """Returns `step(state, kv_caches, batch) -> (logits [B, V] f32, kv_caches)`, jitted.

    The KV caches are donated: XLA updates them in place, and the caller must
    use the returned ones from then on.
    """

    def step(state: nnx.State, kv_caches: list[jax.Array], batch: StepInput):
        model = nnx.merge(graphdef, state)
        hidden, kv_caches = model(kv_caches, batch.input_ids, batch.positions, batch.attention)
        logits = model.compute_logits(hidden[batch.logits_indices])
        return logits, kv_caches

    return jax.jit(step, donate_argnums=1)
