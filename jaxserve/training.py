"""The served model as a trainer sees it: the engine's own model definition, its
weights as a pytree, and a dense, differentiable forward over whole sequences.

An RL loop in one JAX program (`examples/rl_loop.py`) samples rollouts with the
engine, scores them, and takes gradient steps on the log-probabilities of the
sampled tokens under the policy, then hands the new weights back with
`LLM.update_weights`. The engine's forward is built for serving (paged KV cache,
ragged batches, kernels with no gradient); training needs the same model with a
plain causal attention over each sequence. `Policy` is that model: the class and
configuration the engine serves, its attention swapped for `DenseAttention`, and
a state with exactly the engine's parameter tree, so the trained state goes back
to the engine as it is (`LLM.update_weights(policy_state)`).

Glossary: B sequences, L tokens a sequence, T = B * L tokens, N query heads,
K KV heads, H head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.checkpoint import abstract_model
from models.config import ModelConfig
from pallas_kernels.backends import AttentionBackend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseBatch:
    """The attention metadata of a dense batch: B sequences of L tokens, flattened."""

    seq_len: int = dataclasses.field(metadata=dict(static=True))  # L


def _no_kv_write(*args, **kwargs):
    raise NotImplementedError("DenseAttention keeps no KV cache")


@dataclasses.dataclass(frozen=True)
class DenseAttention(AttentionBackend):
    """Causal attention within each of B sequences of L tokens (no pages, no cache),
    differentiable: the training forward's backend. Sliding windows and soft-capping
    as the serving backends apply them."""

    name: str = "dense"
    write_kv: object = _no_kv_write
    ragged_paged_attention: object = _no_kv_write

    def __call__(
        self, queries, keys, values, kv_cache, md, *, sm_scale, sliding_window=None, soft_cap=None
    ):
        length = md.seq_len
        t, n, h = queries.shape
        b, k = t // length, keys.shape[1]
        q = queries.reshape(b, length, k, n // k, h)  # [B, L, K, N/K, H]
        keys = keys.reshape(b, length, k, h)
        values = values.reshape(b, length, k, h)
        s = jnp.einsum("bqkgh,bskh->bkgqs", q, keys, preferred_element_type=jnp.float32)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        pos = jnp.arange(length)
        mask = pos[None, :] <= pos[:, None]  # [L(q), L(s)]
        if sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(values.dtype)
        out = jnp.einsum("bkgqs,bskh->bqkgh", p, values)
        return out.reshape(t, n, h), kv_cache


class Policy:
    """The engine's model for training: `logprobs(state, tokens)` and the state tree
    `LLM.update_weights` takes back.

    `state` is an `nnx.State` with the served model's parameter tree (from
    `Policy.state_of(llm)` or any tree of the same shapes); only float, unquantized
    weights train (an int8 engine quantizes what it is given at each update).
    """

    def __init__(self, config: ModelConfig, dtype: str = "float32"):
        self.config = config
        model = abstract_model(config, dtype=dtype, attention_backend=DenseAttention())
        self.graphdef, _ = nnx.split(model)

    @classmethod
    def of(cls, llm) -> Policy:
        """The policy of the model an `LLM` serves."""
        return cls(llm.config.model, llm.config.dtype)

    @staticmethod
    def state_of(llm) -> nnx.State:
        """The weights the `LLM` serves now, as a state to train (the arrays themselves:
        an optimizer's update makes new ones, and the engine never writes its weights)."""
        runner = llm.engine.runner
        return runner.model_def.state(runner.weights)

    def logits(self, state: nnx.State, tokens: jax.Array) -> jax.Array:
        """tokens [B, L] int32 -> next-token logits [B, L, V] float32."""
        b, length = tokens.shape
        model = nnx.merge(self.graphdef, state)
        positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), b)
        caches = [None] * self.config.num_layers
        hidden, _ = model(caches, tokens.reshape(-1), positions, DenseBatch(length))
        return model.compute_logits(hidden).reshape(b, length, -1)

    def logprobs(self, state: nnx.State, tokens: jax.Array) -> jax.Array:
        """tokens [B, L] -> the logprob of each token after the first given those
        before it [B, L - 1] float32 (the model's raw distribution)."""
        logits = self.logits(state, tokens)[:, :-1]
        lp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]


__all__ = ["DenseAttention", "DenseBatch", "Policy"]
