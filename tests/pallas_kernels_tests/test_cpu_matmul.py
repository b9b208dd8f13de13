"""The CPU matmul kernel for few rows (C++ through the XLA FFI: float32, bfloat16 and
int8 weight-only weights [N, K], and 4-bit codes in groups) against its reference, the
way the layers choose between kernel and XLA, and the build's failure path."""

import logging
import subprocess
import sys
import textwrap

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


# ------------------------------------------------------------------------ int4 groups


def int4_case(m, kdim, n, group, zero, seed=0):
    """x [m, kdim], int4 codes [n, kdim], scales (and zero points) [n, kdim / group]."""
    rs = np.random.RandomState(seed)
    x = jnp.asarray(rs.randn(m, kdim).astype(np.float32))
    codes = jnp.asarray(rs.randint(-8, 8, (n, kdim)).astype(np.int8)).astype(jnp.int4)
    scale = jnp.asarray((rs.rand(n, kdim // group) * 0.01).astype(np.float32))
    zeros = jnp.asarray(rs.randint(-8, 8, scale.shape).astype(np.float32)) if zero else None
    return x, codes, scale, zeros


int4_kernel = jax.jit(k.matmul_int4)
int4_reference = jax.jit(k.int4_matmul_reference)


def check_int4(x, codes, scale, zeros):
    """The kernel takes x in 16-bit fixed point, as the int8 VNNI path does."""
    got = np.asarray(int4_kernel(x, codes, scale, zeros))
    want = np.asarray(int4_reference(x, codes, scale, zeros))
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    return got


INT4_CASES = [
    (1, 896, 4864, 128),  # a decode step's MLP, groups of 128
    (3, 896, 1152, 64),  # rows that are not a multiple of the row tile
    (16, 4864, 896, 128),
    (5, 100, 37, 50),  # groups that are not whole blocks of 32 columns
    (7, 200, 33, 40),
    (2, 96, 7, 96),  # one group a row (channel-wise)
    (1, 64, 20000, 32),  # many chunks of outputs, the smallest group
    (4, 12288, 40, 12288),  # a channel-wise row past several flushes of the int32 sums
]


@pytest.mark.parametrize("zero", [False, True], ids=["symmetric", "zero_points"])
@pytest.mark.parametrize("m, kdim, n, group", INT4_CASES)
def test_int4_kernel_equals_reference(m, kdim, n, group, zero):
    check_int4(*int4_case(m, kdim, n, group, zero))


def test_int4_extreme_codes_and_activations_do_not_overflow_the_integer_sums():
    """Every code at an end of the range, x at its row's largest magnitude with agreeing
    signs, a channel-wise row of 16384 columns; and zero scales give zero."""
    x, codes, scale, zeros = int4_case(4, 16384, 24, 16384, True, seed=3)
    codes = jnp.where(codes >= 0, 7, -8).astype(jnp.int4)
    x = jnp.broadcast_to(jnp.where(codes[0] > 0, 3.0, -3.0).astype(jnp.float32), x.shape)
    scale = scale.at[::5].set(0.0)
    got = check_int4(x, codes, scale, zeros)
    assert (got[:, ::5] == 0).all()
    pos = int(jnp.sum(codes[0].astype(jnp.int32) > 0))
    neg = 16384 - pos  # x = 3 where the code is 7, -3 where it is -8
    exact = (3.0 * 7 * pos + 3.0 * 8 * neg - float(zeros[0, 0]) * 3.0 * (pos - neg)) * float(
        scale[0, 0]
    )
    assert got[0, 0] == pytest.approx(exact, rel=1e-4)


def test_int4_non_finite_activations_give_what_float_arithmetic_gives():
    x, codes, scale, zeros = int4_case(4, 256, 16, 128, True, seed=4)
    x = x.at[0, 7].set(jnp.nan).at[1, 3].set(jnp.inf).at[2].multiply(1e-38)
    got, want = (
        np.asarray(int4_kernel(x, codes, scale, zeros)),
        np.asarray(int4_reference(x, codes, scale, zeros)),
    )
    assert np.isnan(got[0]).all() and np.isnan(want[0]).all()
    assert not np.isfinite(got[1]).any() and not np.isfinite(want[1]).any()
    np.testing.assert_allclose(got[2:], want[2:], rtol=1e-3, atol=1e-3 * np.abs(want[2:]).max())


def test_int4_bad_arguments_are_refused_naming_them():
    x, codes, scale, zeros = int4_case(2, 96, 8, 32, True)
    with pytest.raises(ValueError, match="codes int4"):
        k.matmul_int4(x, codes.astype(jnp.int8), scale)
    with pytest.raises(ValueError, match="do not agree"):
        k.matmul_int4(x[:, :64], codes, scale)
    with pytest.raises(ValueError, match="do not agree"):
        k.matmul_int4(x, codes, scale, zeros[:, :1])
    odd = jnp.ones((8, 96 // 3), jnp.float32)  # groups of 3 columns: not whole bytes
    assert not k.int4_supports(codes, odd)
    with pytest.raises(ValueError, match="even number"):
        k.matmul_int4(x, codes, odd)


def test_int4_layer_uses_the_kernel_for_decode_rows_and_xla_beyond():
    """Int4Linear on the CPU: up to INT4_MAX_ROWS rows call the kernel, more rows (and a
    layer marked `without_cpu_kernels`) the dequantized XLA product; all agree."""
    from models.int4 import Int4Linear

    _, codes, scale, zeros = int4_case(1, 256, 48, 64, True)
    layer = Int4Linear(codes, scale, zeros)
    run = jax.jit(lambda x: layer.product(x))
    for rows, called in ((1, True), (k.INT4_MAX_ROWS, True), (k.INT4_MAX_ROWS + 1, False)):
        x = jnp.asarray(np.random.RandomState(rows).randn(rows, 256).astype(np.float32))
        hlo = jax.jit(lambda x: layer.product(x)).lower(x).as_text()
        assert ("jaxserve_matmul_s4" in hlo) == called, rows
        want = np.asarray(int4_reference(x, codes, scale, zeros))
        np.testing.assert_allclose(run(x), want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    layers.without_cpu_kernels(layer)
    hlo = jax.jit(lambda x: layer.product(x)).lower(x[:1]).as_text()
    assert "jaxserve_matmul_" not in hlo


def test_the_portable_code_computes_the_same(tmp_path):
    """The scalar code (what a CPU without AVX2 builds: -march=x86-64) against the
    references, in a process of its own (the kernels are registered once a process)."""
    script = textwrap.dedent(
        f"""
        import jax, jax.numpy as jnp, numpy as np
        from pallas_kernels.cpu import library, matmul as k
        assert library.load({str(tmp_path)!r}, arch="x86-64")
        rs = np.random.RandomState(0)
        for m, kdim, n, group in [(1, 256, 40, 128), (5, 100, 37, 50), (3, 4200, 9, 4200)]:
            x = jnp.asarray(rs.randn(m, kdim).astype(np.float32))
            codes = jnp.asarray(rs.randint(-8, 8, (n, kdim)).astype(np.int8)).astype(jnp.int4)
            scale = jnp.asarray(rs.rand(n, kdim // group).astype(np.float32))
            zero = jnp.asarray(rs.randint(-8, 8, scale.shape).astype(np.float32))
            for z in (None, zero):
                got = np.asarray(k.matmul_int4(x, codes, scale, z))
                want = np.asarray(k.int4_matmul_reference(x, codes, scale, z))
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
            q = jnp.asarray(rs.randint(-128, 128, (n, kdim)).astype(np.int8))
            s = jnp.asarray(rs.rand(n).astype(np.float32))
            got, want = k.matmul(x, q, s), k.matmul_reference(x, q, s)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        print("portable ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and "portable ok" in proc.stdout, proc.stderr[-3000:]
