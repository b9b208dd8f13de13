"""Weights sharded over a 'model' mesh axis give the unsharded logits (8 fake CPU devices)."""

import pytest
from fake_devices import run_on_8_devices


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
