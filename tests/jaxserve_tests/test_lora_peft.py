"""Reading PEFT adapters (`jaxserve.lora.load_adapter`): what is served and how it is
scaled, and every refusal naming what does not match (host logic, no model)."""

import json
import logging
import os

import numpy as np
import pytest
from lora_files import write_adapter
from safetensors.numpy import save_file

from jaxserve.lora import LoRALayout, LoRARequest, load_adapter

Q, DOWN = "layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"
LAYOUT = LoRALayout({Q: (16, 32), "layers.0.mlp.gate_proj": (16, 24), DOWN: (24, 16)}, max_rank=8)


def read(path, layout=LAYOUT, model_dir=""):
    return load_adapter(LoRARequest("ad", 1, str(path)), layout, model_dir)


def test_matrices_are_laid_out_and_scaled_as_peft_computes(tmp_path):
    write_adapter(tmp_path, {Q: (16, 32), DOWN: (24, 16)}, rank=4, alpha=8.0)
    adapter = read(tmp_path)
    assert set(adapter.weights) == {Q, DOWN} and adapter.rank == 4
    a, b = adapter.weights[Q]
    assert a.shape == (4, 16) and b.shape == (4, 32)
    rs = np.random.RandomState(0)
    peft_a, peft_b = rs.randn(4, 16).astype(np.float32), rs.randn(32, 4).astype(np.float32)
    np.testing.assert_allclose(a, peft_a)
    np.testing.assert_allclose(b, peft_b.T * 2.0)  # alpha / r


def test_rslora_scales_by_the_root_of_the_rank(tmp_path):
    write_adapter(tmp_path, {Q: (16, 32)}, rank=4, alpha=8.0, use_rslora=True)
    plain = write_adapter(tmp_path / "plain", {Q: (16, 32)}, rank=4, alpha=8.0)
    ratio = read(tmp_path).weights[Q][1] / read(plain).weights[Q][1]
    np.testing.assert_allclose(ratio, (8 / 2) / (8 / 4))


def test_rank_and_alpha_patterns_are_per_module(tmp_path):
    rs = np.random.RandomState(1)
    prefix = "base_model.model.model."
    tensors = {  # down_proj of rank 6 (rank_pattern), q_proj of the default 2
        f"{prefix}{DOWN}.lora_A.weight": rs.randn(6, 24).astype(np.float32),
        f"{prefix}{DOWN}.lora_B.weight": rs.randn(16, 6).astype(np.float32),
    }
    write_adapter(
        tmp_path,
        {Q: (16, 32)},
        rank=2,
        alpha=4.0,
        tensors=tensors,
        rank_pattern={"down_proj": 6},
        alpha_pattern={"mlp.down_proj": 12},
    )
    adapter = read(tmp_path)
    assert adapter.rank == 6
    np.testing.assert_allclose(
        adapter.weights[DOWN][1], tensors[f"{prefix}{DOWN}.lora_B.weight"].T * 2.0
    )


def test_bfloat16_and_float16_tensors_are_read(tmp_path):
    rs = np.random.RandomState(2)
    a = rs.randn(4, 16).astype(np.float32)
    b = rs.randn(32, 4).astype(np.float16)
    bits = (a.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: the top half
    header = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {
            "dtype": "BF16",
            "shape": [4, 16],
            "data_offsets": [0, bits.nbytes],
        },
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": {
            "dtype": "F16",
            "shape": [32, 4],
            "data_offsets": [bits.nbytes, bits.nbytes + b.nbytes],
        },
    }
    write_adapter(tmp_path, {Q: (16, 32)})
    raw = json.dumps(header).encode()
    with open(tmp_path / "adapter_model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + bits.tobytes() + b.tobytes())
    got_a, got_b = read(tmp_path).weights[Q]
    np.testing.assert_allclose(got_a, (bits.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_allclose(got_b, b.astype(np.float32).T * 2.0)


def test_the_key_is_the_contents(tmp_path):
    one = read(write_adapter(tmp_path / "a", {Q: (16, 32)}, seed=1))
    same = read(write_adapter(tmp_path / "b", {Q: (16, 32)}, seed=1))
    other = read(write_adapter(tmp_path / "c", {Q: (16, 32)}, seed=2))
    assert one.key == same.key != other.key


REFUSED = [
    # (what the adapter has, words the error names)
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "bias='all'"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(peft_type="IA3"), "peft_type is 'IA3'"),
    (dict(target_modules=["q_proj", "lm_head"]), "target_modules ['lm_head']"),
    (dict(target_parameters=["experts.gate_up_proj"]), "MoE expert"),
    (dict(layer_replication=[[0, 1]]), "layer_replication"),
    (dict(r=0), "r must be a positive integer"),
    (dict(rank_pattern={"q_proj": 2}), "q_proj has rank 4"),
]


@pytest.mark.parametrize("config,words", REFUSED, ids=[w for _, w in REFUSED])
def test_unsupported_configs_are_refused_by_name(tmp_path, config, words):
    write_adapter(tmp_path, {Q: (16, 32)}, **config)
    with pytest.raises(ValueError, match="LoRA adapter 'ad'") as e:
        read(tmp_path)
    assert words in str(e.value)


TENSORS = [
    # (modules, rank, extra tensors, words the error names)
    ({Q: (16, 48)}, 4, {}, "maps 16 -> 48 features, the served model's maps 16 -> 32"),
    ({Q: (20, 32)}, 4, {}, "maps 20 -> 32"),
    ({Q: (16, 32)}, 16, {}, "rank 16, over max_lora_rank=8"),
    ({"layers.0.mlp.experts.3.gate_proj": (16, 24)}, 4, {}, "an MoE expert weight"),
    ({"layers.0.self_attn.k_proj": (16, 32)}, 4, {}, "a projection this model does not have"),
    ({"layers.0.mlp.gate": (16, 8)}, 4, {}, "not one of the supported targets"),
    ({"lm_head": (16, 100)}, 4, {}, "lm_head, the embeddings or the LM head"),
    (
        {Q: (16, 32)},
        4,
        {f"base_model.model.model.{Q}.lora_magnitude_vector": np.ones(32, np.float32)},
        "lora_magnitude_vector",
    ),
    (
        {},
        4,
        {f"base_model.model.model.{Q}.lora_A.weight": np.ones((4, 16), np.float32)},
        "lora_A without its pair",
    ),
]


@pytest.mark.parametrize("modules,rank,extra,words", TENSORS, ids=[t[-1][:30] for t in TENSORS])
def test_tensors_that_do_not_fit_are_refused_by_name(tmp_path, modules, rank, extra, words):
    write_adapter(tmp_path, modules, rank=rank, tensors=extra, target_modules="all-linear")
    with pytest.raises(ValueError, match="LoRA adapter 'ad'") as e:
        read(tmp_path)
    assert words in str(e.value)


def test_missing_and_unreadable_files_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="lora_path is not a directory"):
        read(tmp_path / "nowhere")
    write_adapter(tmp_path, {Q: (16, 32)})
    os.rename(tmp_path / "adapter_model.safetensors", tmp_path / "adapter_model.bin")
    with pytest.raises(ValueError, match="no adapter_model.safetensors.*adapter_model.bin"):
        read(tmp_path)
    save_file({}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="holds no LoRA matrices"):
        read(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(ValueError, match="cannot read adapter_model.safetensors"):
        read(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json is not JSON"):
        read(tmp_path)


def test_another_base_model_name_is_logged_not_refused(tmp_path, caplog):
    served = tmp_path / "Qwen2.5-0.5B"
    served.mkdir()
    write_adapter(tmp_path / "a", {Q: (16, 32)}, base_model_name_or_path="Qwen/Qwen2.5-0.5B")
    write_adapter(tmp_path / "b", {Q: (16, 32)}, base_model_name_or_path="meta-llama/Llama-3-8B")
    with caplog.at_level(logging.WARNING, logger="jaxserve.lora.peft"):
        read(tmp_path / "a", model_dir=str(served))
        assert not caplog.records  # the same name
        read(tmp_path / "b", model_dir=str(served))
    assert "was trained on 'meta-llama/Llama-3-8B'" in caplog.text
