"""LoRA adapters on a model's projections, many adapters in one batch.

`add_lora` wraps every attention and MLP projection (`LORA_TARGETS`: q/k/v/o and
gate/up/down, wherever a model has them as linears: the dense layers and shared
experts of the MoE families too, never the stacked experts) in a `LoRALinear`,
which holds the adapters' matrices stacked by *slot*, each in PEFT's orientation:

    lora_a [S + 1, r, in]    lora_b [S + 1, r, out]

S = max_loras device slots and r = max_lora_rank (an adapter of lower rank is
zero-padded; its scale, alpha / r, is folded into its B). Slot 0 is "no adapter":
zeros, so a token there gets exactly the base projection. The matrices are
parameters like the weights (the step's inputs, placed once, sharded as their
base layer: a column-parallel layer's B splits on its outputs, a row-parallel
layer's A on its inputs), so writing an adapter into a slot changes data, never a
program. Both are laid out so that all slots side by side are one matrix without a
copy (A as [(S + 1) r, in], B as [(S + 1) r, out]). The base projection may be
float, int8, 4-bit or fp8 (`BASES`): a quantized base stays as it is, and the
adapters are in the model's dtype (QLoRA-style serving).

Each step where a token has an adapter binds one slot per token row (`bind_slots`,
[T] int32; a step where none has runs the base model's program, compiled apart:
`jaxserve.runner.step`), and each wrapped projection computes, per token t,

    y[t] = base(x)[t] + (x[t] @ A[slot[t]]^T) @ B[slot[t]]

`lora_delta` has two formulations of the second term; which one runs is fixed when
the step is traced (by the platform):

- TPU and GPU: `lax.ragged_dot_general` over token rows grouped by slot. The host
  orders a batch's sequences by slot (`jaxserve.runner.input_batch.build_batch`
  checks that the slots never decrease), so each slot's rows are one contiguous
  group.
- CPU: `lora_dense`, two plain matmuls over every slot's columns at once, the other
  slots' columns of each row zeroed between them. Measured with
  `benchmarks/lora_formulations.py` (2 cores of an AMD EPYC, Zen 5, float32, r = 16,
  S = 4, the 168 projections of a 0.5B model), ms at T = 1 / 16 / 256 rows: dense
  5.2 / 9.9 / 67; ragged_dot as XLA:CPU decomposes it 60 / 65 / 123; each row's own
  matrices gathered 10.5 / 154 / 2877.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models.fp8 import Fp8Linear
from models.int4 import Int4Linear
from models.layers import RowsLinear, _axes

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAWeight(nnx.Param):
    """A projection's LoRA matrices stacked by slot (A or B)."""


# The projections an adapter can wrap. Those whose kernel is [out, in]: the rows
# layouts and the quantized ones (QLoRA-style serving: the base stays int8, 4-bit or
# fp8, the adapters are in the model's dtype).
OUT_IN = (RowsLinear, Int4Linear, Fp8Linear)  # (QuantizedLinear is a RowsLinear)
BASES = (nnx.Linear, *OUT_IN)


class LoRALinear(nnx.Module):
    """A projection (one of BASES: `nnx.Linear`, `RowsLinear`, int8 `QuantizedLinear`,
    4-bit `Int4Linear`, fp8 `Fp8Linear`) plus the LoRA term of each token's slot.
    `slots` is set on the merged model of one step (`bind_slots`); unset, the layer is
    its base layer. `dtype`: the adapters' (the model's compute dtype: a quantized
    base's own arrays do not say it, an fp8 layer's scales being float32)."""

    def __init__(
        self,
        base: nnx.Module,
        *,
        num_slots: int,
        rank: int,
        dtype,
        abstract: bool = False,
    ):
        if not isinstance(base, BASES):
            raise TypeError(f"LoRA cannot wrap a {type(base).__name__}; it wraps {BASES}")
        self.base = base
        if isinstance(base, OUT_IN):
            d_out, d_in = base.kernel.shape
            axes = _axes(base.kernel, reverse=True)
        else:  # nnx.Linear: kernel [in, out]
            d_in, d_out = base.kernel.shape
            axes = _axes(base.kernel)
        in_axis, out_axis = axes if axes is not None else (None, None)

        def zeros(shape, names):
            value = jax.ShapeDtypeStruct(shape, dtype) if abstract else jnp.zeros(shape, dtype)
            return LoRAWeight(value, out_sharding=names, eager_sharding=False)

        self.lora_a = zeros((num_slots + 1, rank, d_in), (None, None, in_axis))
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


def add_lora(model: nnx.Module, *, num_slots: int, rank: int, dtype, abstract: bool = False):
    """Wraps, in place, every projection named in LORA_TARGETS in a `LoRALinear` of
    `num_slots` slots (plus slot 0) of rank `rank` and `dtype`, its matrices zeros (with
    `abstract`, ShapeDtypeStructs: a model built for a compile-only target); returns
    the model."""
    for _, module in list(nnx.iter_modules(model)):
        for name in LORA_TARGETS:
            child = getattr(module, name, None)
            if isinstance(child, BASES):
                wrapped = LoRALinear(
                    child, num_slots=num_slots, rank=rank, abstract=abstract, dtype=dtype
                )
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
# The LoRA term: x [T, in], a [S + 1, r, in], b [S + 1, r, out], slots [T] -> [T, out]
# float32 (the dots accumulate in float32; between them the rank-r rows are cast to
# the adapters' dtype, as PEFT computes B(A(x)) in the adapter's dtype).
# ----------------------------------------------------------------------------


def lora_dense(x, a, b, slots):
    """Every row against every slot's A at once ([T, in] x [(S + 1) r, in]^T), the
    columns of other slots than the row's zeroed, then one matmul with every slot's
    B ([(S + 1) r, out]): (S + 1) times a row's own work, in two plain matmuls."""
    r = a.shape[1]
    h = lax.dot_general(
        x.astype(a.dtype),
        a.reshape(-1, a.shape[2]),
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )  # [T, (S + 1) r]
    column_slot = jnp.arange(h.shape[1], dtype=slots.dtype) // r
    h = jnp.where(slots[:, None] == column_slot[None, :], h, 0.0)
    return jnp.dot(h.astype(b.dtype), b.reshape(-1, b.shape[2]), preferred_element_type=jnp.float32)


def lora_ragged(x, a, b, slots):
    """`lax.ragged_dot_general` over the rows grouped by slot: the slots must never
    decrease (the host orders the batch so)."""
    groups = jnp.arange(a.shape[0], dtype=slots.dtype)
    sizes = jnp.sum(slots[:, None] == groups[None, :], axis=0, dtype=jnp.int32)  # [S + 1]
    transposed = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())),  # x [T, in] . A[g] [r, in]
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    h = lax.ragged_dot_general(
        x.astype(a.dtype), a, sizes, transposed, preferred_element_type=jnp.float32
    )
    return lax.ragged_dot(h.astype(b.dtype), b, sizes, preferred_element_type=jnp.float32)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """The LoRA term of each row (see the module docstring for which formulation).
    Each formulation is named in the program's op names (what a profile shows, and how
    the deviceless compiles tell which one a target took)."""
    dense = jax.named_call(lora_dense, name="lora_dense")
    ragged = jax.named_call(lora_ragged, name="lora_ragged")
    return lax.platform_dependent(x, a, b, slots, cpu=dense, default=ragged)


def lora_reference(x, a, b, slots) -> np.ndarray:
    """The LoRA term row by row in numpy (float64), for tests."""
    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    return np.stack([x[t] @ a[s].T @ b[s] for t, s in enumerate(np.asarray(slots))])
