"""The CPU matmul kernel for few rows (C++ through the XLA FFI: float32, bfloat16 and
int8 weight-only weights [N, K]) against its reference, the way the layers choose
between kernel and XLA, and the build's failure path."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers
from pallas_kernels.cpu import library
from pallas_kernels.cpu import matmul as k


@pytest.fixture(scope="module", autouse=True)
def loaded(tmp_path_factory):
    if not library.load(str(tmp_path_factory.mktemp("kernels"))):
        pytest.fail("the CPU kernels did not build (g++ and the jaxlib headers are needed)")


def case(m, kdim, n, seed=0, dtype="int8"):
    """x [m, kdim], weights [n, kdim] and, for int8, their scales [n]."""
    rs = np.random.RandomState(seed)
    x = jnp.asarray(rs.randn(m, kdim).astype(np.float32))
    if dtype == "int8":
        w = jnp.asarray(rs.randint(-128, 128, (n, kdim)).astype(np.int8))
        return x, w, jnp.asarray((rs.rand(n) * 0.01).astype(np.float32))
    return x, jnp.asarray(rs.randn(n, kdim).astype(np.float32)).astype(dtype), None


def tolerance(dtype) -> float:
    """Of the output's largest magnitude: float32 sums of K products in another order
    (1e-5); int8 with AVX-512 VNNI takes the rows of x in 16-bit fixed point (each
    value within 1/65534 of its row's largest): 1e-4 (measured 4.5e-5 for K = 896),
    about 1% of the int8 weights' own rounding error."""
    return 1e-4 if dtype == "int8" else 1e-5


kernel = jax.jit(k.matmul)
reference = jax.jit(k.matmul_reference)


def check(x, w, scale, dtype):
    got, want = np.asarray(kernel(x, w, scale)), np.asarray(reference(x, w, scale))
    assert got.shape == want.shape and got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=tolerance(dtype) * np.abs(want).max())
    return got


@pytest.mark.parametrize("dtype", ["int8", "float32", "bfloat16"])
@pytest.mark.parametrize(
    "m, kdim, n",
    [
        (1, 896, 4864),  # a decode step's MLP
        (3, 896, 1152),  # rows that are not a multiple of the row tile
        (16, 4864, 896),
        (5, 100, 37),  # K not a multiple of the vector width
        (2, 7, 3),  # smaller than one vector
        (1, 64, 20000),  # many chunks of outputs, one row
        (2, 5000, 16),  # int8: past one flush of the int32 sums (4096 columns)
    ],
)
def test_kernel_equals_reference(dtype, m, kdim, n):
    check(*case(m, kdim, n, dtype=dtype), dtype)


def test_extreme_weights_activations_and_zero_scales():
    x, q, scale = case(6, 256, 96, seed=1)
    q = jnp.where(q > 0, 127, -128).astype(jnp.int8)  # every weight at an end of the range
    x = x.at[1].multiply(1e4).at[2].set(0.0).at[3, 5].set(-3e3)  # large, zero, an outlier
    scale = scale.at[::7].set(0.0)
    got = check(x, q, scale, "int8")
    assert (got[:, ::7] == 0).all() and (got[2] == 0).all()


def test_long_rows_at_the_extremes_do_not_overflow_the_integer_sums():
    """K = 12288 with every product at its largest (int8 weights at +-127, x's values at
    its row's largest magnitude, signs agreeing): the VNNI path's int32 partial sums
    must be flushed to float in time."""
    x, q, scale = case(4, 12288, 40, seed=3)
    q = jnp.where(q >= 0, 127, -127).astype(jnp.int8)
    x = jnp.broadcast_to(jnp.where(q[0] > 0, 3.0, -3.0).astype(jnp.float32), x.shape)
    got = check(x, q, scale, "int8")
    assert got[0, 0] == pytest.approx(3.0 * 127 * 12288 * float(scale[0]), rel=1e-4)


@pytest.mark.parametrize("dtype", ["int8", "float32", "bfloat16"])
def test_non_finite_and_tiny_activations_give_what_float_arithmetic_gives(dtype):
    x, w, scale = case(5, 300, 24, seed=4, dtype=dtype)
    x = x.at[0, 7].set(jnp.nan).at[1, 3].set(jnp.inf).at[2].multiply(1e-38).at[3].set(1e-45)
    got = np.asarray(kernel(x, w, scale))
    want = np.asarray(reference(x, w, scale))
    assert np.isnan(got[0]).all() and np.isnan(want[0]).all()  # a NaN reaches every output
    assert not np.isfinite(got[1]).any() and not np.isfinite(want[1]).any()  # so does inf
    np.testing.assert_allclose(got[2:], want[2:], rtol=1e-3, atol=1e-3 * np.abs(want[2:]).max())


def test_bad_shapes_are_refused_naming_them():
    x, q, scale = case(2, 16, 8)
    with pytest.raises(ValueError, match="do not agree"):
        k.matmul(x, q.T, scale)
    with pytest.raises(ValueError, match="w must be one of"):
        k.matmul(x, q.astype(jnp.int32), scale)
    with pytest.raises(ValueError, match="scale is needed"):
        k.matmul(x, q, None)


def test_layers_use_the_kernel_for_decode_rows_and_xla_beyond():
    """rows_dot: up to max_rows(dtype) rows call the kernel; more rows take XLA's dot.
    Both give the reference's numbers."""
    for dtype in ("int8", "float32"):
        _, w, scale = case(1, 64, 48, dtype=dtype)
        limit = k.max_rows(w.dtype)
        for rows, called in ((1, True), (limit, True), (limit + 1, False)):
            x = jnp.asarray(np.random.RandomState(rows).randn(rows, 64).astype(np.float32))
            hlo = jax.jit(layers.rows_dot).lower(x, w, scale).as_text()
            assert ("jaxserve_matmul_" in hlo) == called, (dtype, rows)
            np.testing.assert_allclose(
                np.asarray(jax.jit(layers.rows_dot)(x, w, scale)),
                np.asarray(reference(x, w, scale)),
                rtol=1e-5,
                atol=tolerance(dtype) * 10,
            )


@pytest.mark.parametrize("rows", [1, 4, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_linear_computes_what_the_linear_it_replaces_does(rows, bias):
    """`store_rows` (bfloat16 on the CPU) transposes each Linear's kernel to [out, in]:
    decode rows go to the kernel, more rows to XLA's dot; both equal the Linear's."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.up = layers.linear(
                96, 200, ("embed", "mlp"), bias=bias, dtype="bfloat16", rngs=rngs
            )
            self.down = layers.linear(
                200, 96, ("mlp", "embed"), bias=bias, dtype="bfloat16", rngs=rngs
            )

        def __call__(self, x):
            return self.down(jax.nn.silu(self.up(x)))

    block = Block()
    x = jnp.asarray(np.random.RandomState(rows).randn(rows, 96), jnp.bfloat16)
    want = np.asarray(nnx.jit(lambda m, x: m(x))(block, x), np.float32)
    layers.store_rows(block)
    assert isinstance(block.up, layers.RowsLinear) and block.up.kernel.shape == (200, 96)
    got = np.asarray(nnx.jit(lambda m, x: m(x))(block, x), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_a_failed_build_is_reported_once_and_leaves_xla(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(library, "_loaded", None)
    monkeypatch.setattr(library, "_failure", None)
    build = library.build
    monkeypatch.setattr(library, "build", lambda d, arch: build(d, "no-such-compiler", arch))
    with caplog.at_level(logging.WARNING):
        assert library.load(str(tmp_path)) is False
        assert library.load(str(tmp_path)) is False  # not retried, not logged again
    assert not library.is_loaded()
    warned = [r.getMessage() for r in caplog.records if "CPU kernels unavailable" in r.getMessage()]
    assert len(warned) == 1 and "no-such-compiler" in warned[0]
