"""The grouped MoE (both grouped matmuls) against the dense all-experts reference, a plain
numpy definition, and the router; 4-bit experts against float experts of their
dequantized weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.layers import ACTIVATIONS
from models.moe import (
    GROUPED_MATMULS,
    MOE_IMPLS,
    Experts,
    Int4Experts,
    Int4Stack,
    moe_dense,
    route,
    tile_rows,
)

NUM_EXPERTS, DIM, HIDDEN = 6, 24, 40  # odd sizes
SILU = ACTIVATIONS["silu"]


def _weights(seed=0, dtype=np.float32):
    rs = np.random.RandomState(seed)
    e, d, i = NUM_EXPERTS, DIM, HIDDEN
    return tuple(
        (0.2 * rs.randn(*shape)).astype(dtype) for shape in ((e, d, i), (e, d, i), (e, i, d))
    )


def _numpy_moe(x, ids, weights, w_gate, w_up, w_down):
    """Token by token, expert by expert: the plain definition."""
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t], strict=True):
            h = np.asarray(SILU(x[t] @ w_gate[e])) * (x[t] @ w_up[e])
            out[t] += w * (h @ w_down[e])
    return out


def _check(ids, weights, x, tol=1e-5):
    ws = _weights()
    want = _numpy_moe(x, np.asarray(ids), np.asarray(weights), *ws)
    for name, impl in MOE_IMPLS.items():
        got = jax.jit(impl, static_argnums=6)(x, ids, weights, *ws, SILU)
        np.testing.assert_allclose(np.asarray(got), want, atol=tol, rtol=tol, err_msg=name)


@pytest.mark.parametrize("t,k", [(1, 1), (1, 2), (13, 2), (40, 3), (300, 2)])
def test_random_routing(t, k):
    rs = np.random.RandomState(t * 10 + k)
    x = rs.randn(t, DIM).astype(np.float32)
    ids = np.stack([rs.choice(NUM_EXPERTS, k, replace=False) for _ in range(t)]).astype(np.int32)
    _check(ids, rs.rand(t, k).astype(np.float32), x)


def test_all_tokens_pick_the_same_expert():
    rs = np.random.RandomState(1)
    x = rs.randn(17, DIM).astype(np.float32)
    ids = np.full((17, 1), 4, np.int32)  # one group of 17 rows (several tiles), five empty
    _check(ids, np.ones((17, 1), np.float32), x)


def test_some_experts_get_no_tokens():
    rs = np.random.RandomState(2)
    x = rs.randn(9, DIM).astype(np.float32)
    first = rs.choice([1, 5], size=9)
    ids = np.stack([first, np.where(first == 1, 5, 1)], axis=1).astype(np.int32)  # 0, 2-4: none
    _check(ids, rs.rand(9, 2).astype(np.float32), x)


@pytest.mark.parametrize("gmm", sorted(GROUPED_MATMULS))
@pytest.mark.parametrize("sizes", [[0, 0, 21, 0], [1, 0, 0, 0], [3, 9, 0, 17], [0, 0, 0, 0]])
def test_grouped_matmul_equals_per_group_dots(gmm, sizes):
    rs = np.random.RandomState(5)
    lhs = rs.randn(sum(sizes) or 1, 12).astype(np.float32)  # 0 rows: one row, no group
    rhs = rs.randn(len(sizes), 12, 7).astype(np.float32)
    got = np.asarray(jax.jit(GROUPED_MATMULS[gmm])(lhs, rhs, np.asarray(sizes, np.int32)))
    bounds = np.cumsum([0, *sizes])
    for e in range(len(sizes)):
        lo, hi = bounds[e], bounds[e + 1]
        np.testing.assert_allclose(got[lo:hi], lhs[lo:hi] @ rhs[e], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[bounds[-1] :], 0.0)  # rows in no group


def _int4_stack(rs, e, k, n, groups, dtype=np.float32) -> Int4Stack:
    codes = rs.randint(-7, 8, size=(e, k, n)).astype(np.int8)
    scale = (0.02 + 0.02 * rs.rand(e, groups, n)).astype(dtype)
    return Int4Stack(jnp.asarray(codes, jnp.int4), jnp.asarray(scale))


def _dequantized(w: Int4Stack) -> np.ndarray:
    """The plain definition: code * its group's scale, in float64."""
    codes, scale = np.asarray(w.codes, np.float64), np.asarray(w.scale, np.float64)
    return codes * np.repeat(scale, codes.shape[1] // scale.shape[1], axis=1)


@pytest.mark.parametrize("t,k", [(1, 2), (13, 2), (300, 2)])
def test_int4_experts_equal_float_experts_of_their_dequantized_weights(t, k):
    """Every formulation (the CPU's tiles dequantize one expert's codes a tile; the
    others all of them), with several groups along each projection's inputs."""
    rs = np.random.RandomState(t)
    e, d, i = NUM_EXPERTS, DIM, HIDDEN
    ws = (_int4_stack(rs, e, d, i, 3), _int4_stack(rs, e, d, i, 3), _int4_stack(rs, e, i, d, 5))
    x = rs.randn(t, d).astype(np.float32)
    ids = np.stack([rs.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rs.rand(t, k).astype(np.float32)
    want = _numpy_moe(x, ids, weights, *map(_dequantized, ws))
    for name, impl in MOE_IMPLS.items():
        got = jax.jit(impl, static_argnums=6)(x, ids, weights, *ws, SILU)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("rows", [3, 100])
def test_int4_grouped_matmul_on_one_devices_experts(rows):
    """Expert parallelism's shard: this device holds experts 2 and 3 of 6; rows of the
    others come out zero, as the float experts' grouped matmul gives."""
    rs = np.random.RandomState(rows)
    stack = _int4_stack(rs, 2, 24, 7, 3)
    sizes = np.asarray([0, 1, rows // 3, rows - rows // 3 - 2, 1, 0], np.int32)
    lhs = rs.randn(rows, 24).astype(np.float32)
    got = jax.jit(GROUPED_MATMULS["ragged_dot"], static_argnums=3)(lhs, stack, sizes, 2)
    want = GROUPED_MATMULS["ragged_dot"](
        lhs, jnp.asarray(_dequantized(stack), jnp.float32), sizes, 2
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_int4_experts_from_float_experts_within_half_a_step():
    """`Int4Experts.from_experts`: groups of 128 inputs (2 along a 256-input
    projection, the largest divisor of 96 under it for the other), each weight within
    half its group's step of the float one; the layer computes with them."""
    experts = Experts(4, 256, 96, names=("w1", "w3", "w2"), act="silu", dtype=jnp.float32,
                      rngs=nnx.Rngs(0))  # fmt: skip
    q = Int4Experts.from_experts(experts)
    for name, stack in zip(q.names, q.matrices(), strict=True):
        w = np.asarray(getattr(experts, name)[...])
        assert stack.codes.dtype == jnp.int4
        group = 128 if w.shape[1] == 256 else 96
        assert stack.scale.shape == (4, w.shape[1] // group, w.shape[2])
        step = np.repeat(np.asarray(stack.scale), w.shape[1] // stack.scale.shape[1], axis=1)
        assert np.all(np.abs(_dequantized(stack) - w) <= 0.5 * step + 1e-7), name
    rs = np.random.RandomState(0)
    x = rs.randn(5, 256).astype(np.float32)
    ids = np.stack([rs.choice(4, 2, replace=False) for _ in range(5)]).astype(np.int32)
    weights = rs.rand(5, 2).astype(np.float32)
    want = _numpy_moe(x, ids, weights, *map(_dequantized, q.matrices()))
    np.testing.assert_allclose(np.asarray(q(x, ids, weights)), want, atol=1e-4, rtol=1e-4)


def test_tile_size_follows_rows_per_expert():
    assert tile_rows(2, 8) == 8  # a decode: the minimum
    assert tile_rows(4096, 128) == 32
    assert tile_rows(1 << 16, 8) == 128  # the maximum


def test_bfloat16_weights_accumulate_in_float32():
    rs = np.random.RandomState(3)
    x = rs.randn(8, DIM).astype(jnp.bfloat16)
    ids = np.stack([rs.choice(NUM_EXPERTS, 2, replace=False) for _ in range(8)]).astype(np.int32)
    w = rs.rand(8, 2).astype(np.float32)
    ws = _weights(dtype=jnp.bfloat16)
    tiles = jax.jit(functools.partial(MOE_IMPLS["tiles"], act=SILU))(x, ids, w, *ws)
    dense = jax.jit(functools.partial(moe_dense, act=SILU))(x, ids, w, *ws)
    assert tiles.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(tiles, np.float32), np.asarray(dense, np.float32), atol=3e-2, rtol=3e-2
    )


@pytest.mark.parametrize("norm", [True, False])
def test_route_is_softmax_then_top_k(norm):
    rs = np.random.RandomState(4)
    logits = rs.randn(7, NUM_EXPERTS).astype(np.float32)
    ids, weights = route(jnp.asarray(logits), 3, norm_topk_prob=norm)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want_ids = np.argsort(-probs, axis=-1)[:, :3]
    want = np.take_along_axis(probs, want_ids, -1)
    if norm:
        want /= want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6)


def test_route_breaks_ties_by_the_lower_expert():
    ids, weights = route(jnp.zeros((3, NUM_EXPERTS)), 2, norm_topk_prob=True)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1]] * 3)
    np.testing.assert_allclose(np.asarray(weights), 0.5)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("impl", ["ragged_dot", "tiles"])
def test_grouped_moe_lowers_for_accelerators(platform, impl):
    """On TPU and GPU `ragged_dot` stays XLA's native ragged dot (on the CPU JAX expands
    it into a masked dense dot, which is why "auto" picks "tiles" there)."""
    from jax import export

    sds = jax.ShapeDtypeStruct
    args = (
        sds((16, DIM), jnp.bfloat16),
        sds((16, 2), jnp.int32),
        sds((16, 2), jnp.float32),
        sds((NUM_EXPERTS, DIM, HIDDEN), jnp.bfloat16),
        sds((NUM_EXPERTS, DIM, HIDDEN), jnp.bfloat16),
        sds((NUM_EXPERTS, HIDDEN, DIM), jnp.bfloat16),
    )
    fn = jax.jit(functools.partial(MOE_IMPLS[impl], act=SILU))
    text = export.export(fn, platforms=[platform])(*args).mlir_module()
    assert ("chlo.ragged_dot" in text) == (impl == "ragged_dot")
