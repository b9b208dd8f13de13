"""Expert-parallel (and expert + tensor parallel) MoE equals one device (8 fake CPU devices)."""

import pytest
from fake_devices import run_on_8_devices


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
    stdout = run_on_8_devices("moe_sharded_check.py", path, data, model)
    assert "layer E=8 tiles: expert parallel True, equal" in stdout
    assert "layer E=6 ragged_dot: expert parallel False, equal" in stdout
    assert "experts sharded as P('model', None, None)" in stdout
    assert "model: expert + tensor parallel logits equal" in stdout
