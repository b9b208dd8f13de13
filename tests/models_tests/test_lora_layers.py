"""The LoRA projections (`models.lora`): each formulation of the per-token LoRA term
against the row-by-row reference, and the wrapped layers (float and int8 bases)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.layers import linear
from models.lora import (
    LoRALinear,
    add_lora,
    bind_slots,
    lora_delta,
    lora_dense,
    lora_modules,
    lora_ragged,
    lora_reference,
)
from models.quantize import quantize_weights


def case(rows: int, seed: int = 0, slots: int = 4):
    rs = np.random.RandomState(seed)
    x = rs.randn(rows, 24).astype(np.float32)
    a = rs.randn(slots + 1, 8, 24).astype(np.float32)
    b = rs.randn(slots + 1, 8, 40).astype(np.float32)
    a[0], b[0] = 0, 0  # slot 0: no adapter
    s = np.sort(rs.randint(0, slots + 1, size=rows)).astype(np.int32)
    return x, a, b, s


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 64])
@pytest.mark.parametrize("f", [lora_dense, lora_ragged, lora_delta])
def test_each_formulation_matches_the_reference(f, rows):
    x, a, b, s = case(rows)
    np.testing.assert_allclose(
        jax.jit(f)(x, a, b, s), lora_reference(x, a, b, s), rtol=1e-5, atol=1e-4
    )


def test_slot_zero_rows_get_exactly_nothing():
    x, a, b, _ = case(16)
    s = np.array([0] * 8 + [2] * 8, np.int32)
    for f in (lora_dense, lora_ragged):
        out = np.asarray(jax.jit(f)(x, a, b, s))
        assert (out[:8] == 0).all() and np.abs(out[8:]).min() > 0


class Block(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = linear(24, 40, ("embed", "q_heads"), bias=True, dtype=jnp.float32, rngs=rngs)
        self.gate = linear(24, 4, ("embed", None), bias=False, dtype=jnp.float32, rngs=rngs)


@pytest.mark.parametrize("quantized", [False, True])
def test_wrapped_projection_adds_each_rows_slot(quantized):
    block = Block(nnx.Rngs(0))
    if quantized:
        quantize_weights(block)
    base_out = np.asarray(block.q_proj(jnp.ones((3, 24))))
    add_lora(block, num_slots=2, rank=8, dtype=jnp.float32)
    assert isinstance(block.q_proj, LoRALinear) and not isinstance(block.gate, LoRALinear)
    assert list(lora_modules(block)) == ["q_proj"]
    assert block.q_proj.lora_a.shape == (3, 8, 24) and block.q_proj.lora_b.shape == (3, 8, 40)
    assert block.q_proj.lora_a.get_metadata()["out_sharding"] == (None, None, "embed")
    assert block.q_proj.lora_b.get_metadata()["out_sharding"] == (None, None, "q_heads")
    x, a, b, _ = case(3, slots=2)
    block.q_proj.lora_a[...] = a
    block.q_proj.lora_b[...] = b
    np.testing.assert_allclose(block.q_proj(jnp.ones((3, 24))), base_out, rtol=1e-6)  # unbound
    s = np.array([0, 1, 2], np.int32)
    bind_slots(block, jnp.asarray(s))
    got = np.asarray(block.q_proj(jnp.asarray(x)))
    plain = np.asarray(block.q_proj.base(jnp.asarray(x)))
    np.testing.assert_allclose(got - plain, lora_reference(x, a, b, s), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one row per token"):
        block.q_proj(jnp.ones((4, 24)))
