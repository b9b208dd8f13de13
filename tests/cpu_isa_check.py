"""Run in a subprocess: the CPU kernels built for another instruction set (`-march`,
e.g. x86-64-v3 for AVX2 + FMA without AVX-512, or x86-64 for the scalar code) give
the references' results. Each process can register only one build of the kernels.

Usage: python cpu_isa_check.py ARCH CACHE_DIR
"""

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pallas_kernels_tests"))

from pallas_kernels import ragged_paged_attention as ref
from pallas_kernels.cpu import attention, library, matmul


def main(arch: str, cache_dir: str) -> None:
    assert library.load(cache_dir, arch=arch), "the build failed"
    from test_cpu_attention import float_case
    from test_cpu_matmul import case
    from test_quantization import quantized_case

    for dtype in ("int8", "float32", "bfloat16"):
        for m, k, n in ((1, 896, 1152), (5, 100, 37), (16, 64, 96)):
            x, w, scale = case(m, k, n, dtype=dtype)
            got = np.asarray(jax.jit(matmul.matmul)(x, w, scale))
            want = np.asarray(matmul.matmul_reference(x, w, scale))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    kernel = jax.jit(attention.ragged_paged_attention, static_argnames=("sm_scale", "soft_cap"))
    cases = [float_case("mixed"), float_case("mixed", head_dim=20), quantized_case("mixed", "int8")]
    for args, t in cases:
        for kw in ({}, {"soft_cap": 2.0}):
            got = np.asarray(kernel(*args, sm_scale=0.25, **kw))
            want = np.asarray(ref.ragged_paged_attention_jit(*args, sm_scale=0.25, **kw))
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got[:t], want[:t], atol=2e-5, rtol=2e-5)
    print(f"{arch}: kernels equal the references")


if __name__ == "__main__":
    main(*sys.argv[1:])
