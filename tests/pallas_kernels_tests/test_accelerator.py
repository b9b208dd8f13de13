"""The accelerator suite: run on a GPU or TPU machine with
`python tools/run_tests.py --accelerator` (deselected everywhere else; see
tests/conftest.py).

- the Pallas kernels of the machine's platform, compiled natively (not
  interpreted), against the reference, with every unowned KV page NaN;
- greedy parity of the engine on the device (its Pallas attention backend, float32
  at the highest matmul precision) against the same engine on this host's CPU;
- `jaxserve bench --roofline` on the device: its measured model bandwidth
  utilization (MBU), for benchmarks/README.md.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.accelerator

PLATFORM = jax.default_backend()


@pytest.fixture(scope="module")
def kernel():
    from pallas_kernels import ragged_paged_attention_gpu as gpu
    from pallas_kernels import ragged_paged_attention_tpu as tpu

    if PLATFORM not in ("gpu", "tpu"):
        pytest.fail(f"the accelerator suite needs a GPU or TPU; this machine's JAX has {PLATFORM}")
    return tpu if PLATFORM == "tpu" else gpu


@pytest.mark.parametrize("batch", ["decode", "mixed", "verify"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_runs_natively_and_matches_the_reference(kernel, batch, dtype, head_dim):
    from test_kernels import BATCHES
    from test_reference import make_case

    from pallas_kernels import ragged_paged_attention as ref

    q_lens, kv_lens = BATCHES[batch]
    q, kv, kvl, pi, cu, ns, _ = make_case(
        q_lens,
        kv_lens,
        num_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=16,
        pages_per_seq=8,
        num_pages=48,
        token_bucket=sum(q_lens) + 5,
        seq_bucket=len(q_lens) + 2,
    )
    q, kv = q.astype(dtype), kv.astype(dtype)
    run = lambda f: np.asarray(jax.device_get(f(q, kv, kvl, pi, cu, ns, sm_scale=0.2)), np.float32)
    with jax.default_matmul_precision("highest"):
        want = run(ref.ragged_paged_attention_jit)
        got = run(kernel.ragged_paged_attention)
    t = sum(q_lens)
    assert np.isfinite(got[:t]).all()
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got[:t], want[:t], atol=tol, rtol=tol)
    if dtype == "float32" and PLATFORM == "gpu":
        # JAX's default precision: float32 dots in TF32 (10-bit mantissa), as XLA's own
        # matmuls on the same GPU; within TF32's error, and not bitwise the IEEE result.
        fast = run(kernel.ragged_paged_attention)
        np.testing.assert_allclose(fast[:t], want[:t], atol=1e-2, rtol=1e-2)


_GREEDY = """
import json, sys
import jax
jax.config.update("jax_default_matmul_precision", "highest")
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
llm = LLM("demo-model", dtype="float32", skip_tokenizer_init=True, compilation_cache_dir=None,
          max_num_seqs=8, max_num_batched_tokens=256, num_kv_pages=256)
prompts = [{"prompt_token_ids": list(range(10 + i, 10 + 7 * i + 5))} for i in range(6)]
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
print(json.dumps([o.outputs[0].token_ids for o in llm.generate(prompts, params)]))
"""


def _greedy(env: dict) -> list[list[int]]:
    proc = subprocess.run(
        [sys.executable, "-c", _GREEDY],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_greedy_on_the_device_equals_the_cpu(kernel):
    on_device = _greedy({})
    on_cpu = _greedy({"JAX_PLATFORMS": "cpu"})
    assert on_device == on_cpu


def test_roofline_bench_on_the_device(kernel, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli.main",
            "bench",
            "--model=demo-model",
            "--roofline",
            f"--output_json={out}",
            "--output_png=",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout[-2000:])  # the MBU line, for benchmarks/README.md
    roofline = json.loads(out.read_text())["roofline"]
    assert roofline["decode_step_ms"] > 0 and 0 < roofline["model_bandwidth_utilization"] <= 1
