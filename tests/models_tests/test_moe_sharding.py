"""Expert-parallel (and expert + tensor parallel) MoE equals one device (8 fake CPU devices)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(__file__))


@pytest.mark.sharded
@pytest.mark.parametrize(
    "case,data,model",
    [
        ("mixtral_top2_of_8", 2, 4),  # 8 experts: 2 per device; attention heads split too
        ("qwen3_moe_top3_of_16", 1, 8),  # 16 experts over 8 devices; a dense middle layer
    ],
)
def test_expert_parallel_equals_one_device(case, data, model, hf_model_dir):
    path, _ = hf_model_dir(case)
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "moe_sharded_check.py"), path, str(data), str(model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layer E=8 tiles: expert parallel True, equal" in proc.stdout
    assert "layer E=6 ragged_dot: expert parallel False, equal" in proc.stdout
    assert "experts sharded as P('model', None, None)" in proc.stdout
    assert "model: expert + tensor parallel logits equal" in proc.stdout
