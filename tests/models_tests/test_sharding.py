"""Weights sharded over a 'model' mesh axis give the unsharded logits (8 fake CPU devices)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(__file__))


def run_on_8_devices(script: str, *args) -> str:
    """Runs tests/`script` with `args` in a subprocess with 8 fake CPU devices (the
    device count is fixed when JAX starts); asserts it succeeded, returns its stdout."""
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.sharded
@pytest.mark.parametrize(
    "case,data,model,kv_sharded",
    [
        ("llama2_mha", 2, 4, True),  # 4 kv heads over 4 devices
        ("qwen2_14_to_2", 1, 8, False),  # 2 kv heads over 8 devices: replicated
    ],
)
def test_sharded_logits_equal_unsharded(case, data, model, kv_sharded, hf_model_dir):
    path, _ = hf_model_dir(case)
    stdout = run_on_8_devices("sharded_check.py", path, data, model)
    assert f"kv sharded over model: {kv_sharded}" in stdout
    assert "max diff" in stdout
