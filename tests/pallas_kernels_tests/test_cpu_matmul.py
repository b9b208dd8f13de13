"""The CPU matmul kernels for few rows (C++ through the XLA FFI: float32, bfloat16 and
int8 weight-only) against their reference, the way the layers choose between kernel
and XLA, and the build's failure path."""

import functools
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


def case(m, kdim, n, layout, seed=0, dtype="int8"):
    rs = np.random.RandomState(seed)
    x = rs.randn(m, kdim).astype(np.float32)
    shape = (kdim, n) if layout == "kn" else (n, kdim)
    if dtype == "int8":
        w = jnp.asarray(rs.randint(-128, 128, shape).astype(np.int8))
        return jnp.asarray(x), w, jnp.asarray((rs.rand(n) * 0.01).astype(np.float32))
    return jnp.asarray(x), jnp.asarray(rs.randn(*shape).astype(np.float32)).astype(dtype), None


kernel = jax.jit(k.matmul, static_argnums=3)
reference = jax.jit(k.matmul_reference, static_argnums=3)


@pytest.mark.parametrize("dtype", ["int8", "float32", "bfloat16"])
@pytest.mark.parametrize("layout", k.LAYOUTS)
@pytest.mark.parametrize(
    "m, kdim, n",
    [
        (1, 896, 4864),  # a decode step's MLP
        (3, 896, 1152),  # rows that are not a multiple of the row tile
        (16, 4864, 896),
        (5, 100, 37),  # K and N not multiples of the vector width
        (2, 7, 3),  # smaller than one vector
        (1, 64, 20000),  # many column chunks, one row
    ],
)
def test_kernel_equals_reference(layout, dtype, m, kdim, n):
    x, q, scale = case(m, kdim, n, layout, dtype=dtype)
    got, want = np.asarray(kernel(x, q, scale, layout)), np.asarray(reference(x, q, scale, layout))
    assert got.shape == (m, n) and got.dtype == np.float32
    # float32 sums of K products in another order: relative to the row's magnitude
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("layout", k.LAYOUTS)
def test_extreme_weights_and_zero_scales(layout):
    x, q, scale = case(4, 256, 96, layout, seed=1)
    q = jnp.where(q > 0, 127, -128).astype(jnp.int8)  # every weight at an end of the range
    scale = scale.at[::7].set(0.0)
    got, want = np.asarray(kernel(x, q, scale, layout)), np.asarray(reference(x, q, scale, layout))
    assert np.isfinite(got).all()
    assert (got[:, ::7] == 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bad_shapes_are_refused_naming_them():
    x, q, scale = case(2, 16, 8, "kn")
    with pytest.raises(ValueError, match="layout kn"):
        k.matmul(x, q.T, scale, "kn")
    with pytest.raises(ValueError, match="layout must be"):
        k.matmul(x, q, scale, "mk")
    with pytest.raises(ValueError, match="w must be one of"):
        k.matmul(x, q.astype(jnp.int32), scale, "kn")
    with pytest.raises(ValueError, match="scale is needed"):
        k.matmul(x, q, None, "kn")


def _custom_calls(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


def test_layers_use_the_kernel_for_decode_rows_and_xla_for_prefill():
    """int8_dot: up to MAX_ROWS rows call the kernel; more rows take XLA's dot of the
    converted weights. Both give the reference's numbers."""
    _, q, scale = case(1, 64, 48, "kn")
    dims = (((1,), (0,)), ((), ()))
    dot = functools.partial(layers.int8_dot, q=q, scale=scale, dimension_numbers=dims)
    for rows, kernel_called in ((1, True), (k.MAX_ROWS, True), (k.MAX_ROWS + 1, False)):
        x = jnp.asarray(np.random.RandomState(rows).randn(rows, 64).astype(np.float32))
        assert ("jaxserve_matmul_kn_s8" in _custom_calls(dot, x)) == kernel_called, rows
        np.testing.assert_allclose(
            np.asarray(jax.jit(dot)(x)), np.asarray(reference(x, q, scale, "kn")), rtol=1e-5
        )


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
