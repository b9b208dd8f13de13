"""Multi-LoRA on a GPU or TPU (the accelerator suite: `python tools/run_tests.py
--accelerator`, deselected everywhere else): the projections' `lax.ragged_dot` over
token rows grouped by slot, which only these platforms run, against the row-by-row
reference, and the engine's greedy tokens with adapters mixed in its batches (more
adapters than slots) on the device against the same engine on the host's CPU."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.accelerator


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_lora_term_matches_the_reference(dtype):
    from models.lora import lora_delta, lora_reference

    if jax.default_backend() not in ("gpu", "tpu"):
        pytest.fail(
            f"the accelerator suite needs a GPU or TPU; this JAX has {jax.default_backend()}"
        )
    rs = np.random.RandomState(0)
    slots = np.sort(rs.randint(0, 5, size=77)).astype(np.int32)  # 5 groups, some empty
    slots[slots == 3] = 2
    x = rs.randn(77, 96).astype(np.float32)
    a = (0.1 * rs.randn(5, 8, 96)).astype(np.float32)
    b = (0.1 * rs.randn(5, 8, 40)).astype(np.float32)
    a[0], b[0] = 0, 0
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lora_delta)(*(v.astype(dtype) for v in (x, a, b)), slots))
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got, lora_reference(x, a, b, slots), atol=tol, rtol=tol)


_GREEDY = """
import json, os, sys
import jax
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, {tests!r})
from lora_files import write_adapter
from jaxserve import LLM, LoRARequest, SamplingParams
llm = LLM("demo-model-tiny", dtype="float32", skip_tokenizer_init=True, compilation_cache_dir=None,
          max_num_seqs=8, max_num_batched_tokens=64, num_kv_pages=128, enable_lora=True,
          max_loras=2, max_lora_rank=8)
modules = llm.engine.adapters.layout.modules
loras = [None]
for i, part in enumerate(["self_attn", "mlp", ""]):
    mine = {{k: v for k, v in modules.items() if part in k}}
    path = os.path.join({root!r}, f"a{{i}}")
    if not os.path.exists(path):
        write_adapter(path, mine, rank=2 * i + 2, seed=i)
    loras.append(LoRARequest(f"a{{i}}", i + 1, path))
prompts = [{{"prompt_token_ids": list(range(10 + i, 10 + 7 * i + 5))}} for i in range(8)]
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
outs = llm.generate(prompts, params, lora_request=[loras[i % 4] for i in range(8)])
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def _greedy(root: str, env: dict) -> list[list[int]]:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _GREEDY.format(tests=tests, root=root)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_with_adapters_on_the_device_equals_the_cpu(tmp_path):
    on_device = _greedy(str(tmp_path), {})
    on_cpu = _greedy(str(tmp_path), {"JAX_PLATFORMS": "cpu"})
    assert on_device == on_cpu
    base = on_device[0::4]
    assert all(on_device[j::4] != base for j in (1, 2, 3))  # the adapters matter
