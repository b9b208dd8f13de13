"""LoRA adapters on a model's projections, many adapters in one batch.

`add_lora` wraps every attention and MLP projection (`LORA_TARGETS`: q/k/v/o and
gate/up/down, wherever a model has them as linears: the dense layers and shared
experts of the MoE families too, never the stacked experts) in a `LoRALinear`,
which holds the adapters' matrices stacked by *slot*:

    lora_a [S + 1, in, r]    lora_b [S + 1, r, out]

S = max_loras device slots and r = max_lora_rank (an adapter of lower rank is
zero-padded; its scale, alpha / r, is folded into its B). Slot 0 is "no adapter":
zeros, so a token there gets exactly the base projection. The matrices are
parameters like the weights (the step's inputs, placed once, sharded as their
base layer: a column-parallel layer's B splits on its outputs, a row-parallel
layer's A on its inputs), so writing an adapter into a slot changes data, never a
program.

Each step binds one slot per token row (`bind_slots`, [T] int32), and each wrapped
projection computes, per token t,

    y[t] = base(x)[t] + (x[t] @ A[slot[t]]) @ B[slot[t]]

`lora_delta` has three formulations of the second term; which one runs is fixed
when the step is traced (the platform, and the token count T, are static):

- TPU and GPU: `lax.ragged_dot` over token rows grouped by slot. The host orders
  a batch's sequences by slot (`jaxserve.runner.input_batch.build_batch` checks
  that the slots never decrease), so each slot's rows are one contiguous group.
- CPU, T <= GATHER_MAX_ROWS (decode steps): each row's matrices gathered (A[slot]).
- CPU, more rows: every row against every slot's A at once (one dot with S * r
  columns), the other slots' columns zeroed, then one dot with the stacked B.
  Measured on 2 cores of an AMD EPYC (family 26, Zen 5: AVX-512), float32,
  r = 16, S = 4, ms per projection (gather / one-hot / ragged_dot as XLA:CPU
  decomposes it):
  896x896 at T=1: 0.017 / 0.037 / 0.041; T=8: 0.053 / 0.040 / 0.131;
  T=256: 1.63 / 0.24 / 0.79; T=2048: 73 / 1.7 / 15. 4864x896 at T=1: 0.023 /
  0.159 / 0.147; T=16: 0.22 / 0.17 / 0.38; T=2048: 355 / 7.7 / 230.
  On the CPU a step where no token has an adapter skips the term (`lax.cond`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models.layers import QuantizedLinear, RowsLinear, _axes

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GATHER_MAX_ROWS = 8  # CPU: up to this many rows gather their matrices (see above)


class LoRAWeight(nnx.Param):
    """A projection's LoRA matrices stacked by slot (A or B)."""


class LoRALinear(nnx.Module):
    """A projection (`nnx.Linear`, `RowsLinear` or int8 `QuantizedLinear`) plus the
    LoRA term of each token's slot. `slots` is set on the merged model of one step
    (`bind_slots`); unset, the layer is its base layer."""

    def __init__(self, base: nnx.Module, *, num_slots: int, rank: int, abstract: bool = False):
        self.base = base
        if isinstance(base, RowsLinear):  # kernel [out, in] (QuantizedLinear included)
            d_out, d_in = base.kernel.shape
            axes = _axes(base.kernel, reverse=True)
        else:  # nnx.Linear: kernel [in, out]
            d_in, d_out = base.kernel.shape
            axes = _axes(base.kernel)
        # The adapters compute in the model's dtype (an int8 layer's: its scales').
        dtype = base.scale.dtype if isinstance(base, QuantizedLinear) else base.kernel.dtype
        in_axis, out_axis = axes if axes is not None else (None, None)

        def zeros(shape, names):
            value = jax.ShapeDtypeStruct(shape, dtype) if abstract else jnp.zeros(shape, dtype)
            return LoRAWeight(value, out_sharding=names, eager_sharding=False)

        self.lora_a = zeros((num_slots + 1, d_in, rank), (None, in_axis, None))
        self.lora_b = zeros((num_slots + 1, rank, d_out), (None, None, out_axis))
        self.slots = None  # [T] int32 for one step

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, in] -> [T, out]
        y = self.base(x)
        if self.slots is None:
            return y
        if x.ndim != 2 or x.shape[0] != self.slots.shape[0]:
            raise ValueError(
                f"a LoRA projection takes one row per token: input {x.shape}, "
                f"{self.slots.shape[0]} token slots"
            )
        delta = lora_delta(x, self.lora_a[...], self.lora_b[...], self.slots)
        return y + delta.astype(y.dtype)


def add_lora(model: nnx.Module, *, num_slots: int, rank: int, abstract: bool = False):
    """Wraps, in place, every projection named in LORA_TARGETS in a `LoRALinear` of
    `num_slots` slots (plus slot 0) of rank `rank`, its matrices zeros (with
    `abstract`, ShapeDtypeStructs: a model built for a compile-only target); returns
    the model."""
    kinds = (nnx.Linear, RowsLinear)  # (QuantizedLinear is a RowsLinear)
    for _, module in list(nnx.iter_modules(model)):
        for name in LORA_TARGETS:
            child = getattr(module, name, None)
            if isinstance(child, kinds):
                wrapped = LoRALinear(child, num_slots=num_slots, rank=rank, abstract=abstract)
                setattr(module, name, wrapped)
    return model


def bind_slots(model: nnx.Module, slots: jax.Array) -> None:
    """Gives every LoRA projection of `model` (a step's merged model) the step's
    slot per token row, [T] int32 (0: no adapter)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, LoRALinear):
            module.slots = nnx.data(slots)  # (an array: data, not the graph's structure)


def lora_modules(model: nnx.Module) -> dict[str, LoRALinear]:
    """The model's LoRA projections by their path ('model.layers.0.self_attn.q_proj')."""
    return {
        ".".join(str(p) for p in path): module
        for path, module in nnx.iter_modules(model)
        if isinstance(module, LoRALinear)
    }


# ----------------------------------------------------------------------------
# The LoRA term: x [T, in], a [S + 1, in, r], b [S + 1, r, out], slots [T] -> [T, out]
# float32 (the dots accumulate in float32; between them the rank-r rows are cast to
# the adapters' dtype, as PEFT computes B(A(x)) in the adapter's dtype).
# ----------------------------------------------------------------------------


def lora_gather(x, a, b, slots):
    """Each row's slot's matrices gathered: T * (in + out) * r values read."""
    h = jnp.einsum("ti,tir->tr", x.astype(a.dtype), a[slots], preferred_element_type=jnp.float32)
    return jnp.einsum("tr,tro->to", h.astype(b.dtype), b[slots], preferred_element_type=jnp.float32)


def lora_one_hot(x, a, b, slots):
    """Every row against every slot 1..S, the other slots' columns zeroed: two dense
    dots with S * r inner columns (slot 0, the zeros, is skipped)."""
    h = jnp.einsum("ti,sir->tsr", x.astype(a.dtype), a[1:], preferred_element_type=jnp.float32)
    mine = slots[:, None] == jnp.arange(1, a.shape[0], dtype=slots.dtype)[None, :]  # [T, S]
    h = jnp.where(mine[:, :, None], h, 0.0)
    return jnp.einsum("tsr,sro->to", h.astype(b.dtype), b[1:], preferred_element_type=jnp.float32)


def lora_ragged(x, a, b, slots):
    """`lax.ragged_dot` over the rows grouped by slot: the slots must never decrease
    (the host orders the batch so)."""
    groups = jnp.arange(a.shape[0], dtype=slots.dtype)
    sizes = jnp.sum(slots[:, None] == groups[None, :], axis=0, dtype=jnp.int32)  # [S + 1]
    h = lax.ragged_dot(x.astype(a.dtype), a, sizes, preferred_element_type=jnp.float32)
    return lax.ragged_dot(h.astype(b.dtype), b, sizes, preferred_element_type=jnp.float32)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """The LoRA term of each row (see the module docstring for which formulation)."""

    def cpu(x, a, b, slots):
        f = lora_gather if x.shape[0] <= GATHER_MAX_ROWS else lora_one_hot
        # A step where no token has an adapter skips the term. (Not on the GPU, where
        # XLA reads a conditional's predicate back to the host: a sync per projection
        # made an H200's steps 1.8x slower.)
        zeros = jnp.zeros((x.shape[0], b.shape[2]), jnp.float32)
        return lax.cond(jnp.any(slots > 0), lambda: f(x, a, b, slots), lambda: zeros)

    return lax.platform_dependent(x, a, b, slots, cpu=cpu, default=lora_ragged)


def lora_reference(x, a, b, slots) -> np.ndarray:
    """The LoRA term row by row in numpy (float64), for tests."""
    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    return np.stack([x[t] @ a[s] @ b[s] for t, s in enumerate(np.asarray(slots))])
