"""The compiled step: a pure function of (model state, KV caches, batch)."""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from jaxserve.runner.input_batch import HostBatch, SamplingMetadata
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


def _forward(graphdef, state, kv_caches, batch: StepInput):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(kv_caches, batch.input_ids, batch.positions, batch.attention)
    return model.compute_logits(hidden[batch.logits_indices]), kv_caches


def make_step(graphdef: nnx.GraphDef):
    """Returns `step(state, kv_caches, batch) -> (logits [B, V] f32, kv_caches)`, jitted.

    The KV caches are donated: XLA updates them in place, and the caller must
    use the returned ones from then on.
    """
    return jax.jit(functools.partial(_forward, graphdef), donate_argnums=1)


def make_sampling_step(graphdef: nnx.GraphDef):
    """Returns `step(state, kv_caches, batch, sampling) -> (SamplerOutput, kv_caches)`, jitted.

    The serving step: only the sampled ids (and logprobs) leave the device.
    """

    def step(state, kv_caches, batch: StepInput, sampling: SamplingMetadata):
        logits, kv_caches = _forward(graphdef, state, kv_caches, batch)
        return sample(logits, sampling), kv_caches

    return jax.jit(step, donate_argnums=1)
