"""Stacked experts load from one tensor per expert and save back to the same names."""

import os

import numpy as np
import pytest
from safetensors import safe_open

from jaxserve.checkpoint import load_model, save_weights
from models.config import ModelConfig


@pytest.mark.parametrize("case", ["mixtral_top2_of_8", "qwen2_moe_shared_expert"])
def test_experts_round_trip_through_hf_names(case, hf_model_dir, tmp_path):
    path, _ = hf_model_dir(case)
    model = load_model(path, ModelConfig.from_pretrained(path))
    experts = model.model.layers[1].mlp if "qwen" in case else model.model.layers[1]
    experts = (experts.block_sparse_moe if "mixtral" in case else experts).experts
    assert experts.names[0] in ("w1", "gate_proj")
    saved = save_weights(model, str(tmp_path))
    with (
        safe_open(saved, "np") as ours,
        safe_open(os.path.join(path, "model.safetensors"), "np") as theirs,
    ):
        names = set(theirs.keys())  # (a safe_open handle is not a dict)
        assert set(ours.keys()) == names
        expert = "block_sparse_moe.experts.7.w2" if "mixtral" in case else "mlp.experts.7.down_proj"
        assert f"model.layers.1.{expert}.weight" in names
        for name in sorted(names):
            np.testing.assert_array_equal(ours.get_tensor(name), theirs.get_tensor(name), name)
