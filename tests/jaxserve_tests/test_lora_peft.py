"""Reading PEFT adapters (`jaxserve.lora.load_adapter`): what is served and how it is
scaled, and every refusal naming what does not match (host logic, no model)."""

import json
import logging
import os
import re

import numpy as np
import pytest
from lora_files import write_adapter
from safetensors.numpy import save_file

from jaxserve.lora import LoRALayout, LoRARequest, load_adapter
from jaxserve.lora.peft import MAX_CONFIG_BYTES

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


# ------------------------------------------------------------ untrusted files

A_NAME = f"base_model.model.model.{Q}.lora_A.weight"
A_BYTES = np.ones((4, 16), np.float32).tobytes()


def test_files_over_their_bound_are_refused_unread(tmp_path):
    write_adapter(tmp_path, {Q: (16, 32)})
    weights = tmp_path / "adapter_model.safetensors"
    os.truncate(weights, 1 << 40)  # sparse: a read would need 1 TiB of memory
    with pytest.raises(ValueError, match="LoRA adapter 'ad'") as e:
        read(tmp_path)
    bound = LAYOUT.max_weights_bytes
    assert f"adapter_model.safetensors has {1 << 40} bytes, more than the {bound}" in str(e.value)
    write_adapter(tmp_path, {Q: (16, 32)})
    config = tmp_path / "adapter_config.json"
    config.write_text(config.read_text() + " " * MAX_CONFIG_BYTES)  # valid JSON, too long
    with pytest.raises(ValueError, match="adapter_config.json has .* more than the 1048576"):
        read(tmp_path)


def test_the_largest_adapter_the_slots_hold_is_within_the_bound(tmp_path):
    rs = np.random.RandomState(3)
    tensors = {}
    for module, (d_in, d_out) in LAYOUT.modules.items():  # every module, max rank, float64
        name = f"base_model.model.{'m' * 200}.{module}"  # (a long prefix: a long header)
        tensors[f"{name}.lora_A.weight"] = rs.randn(8, d_in)
        tensors[f"{name}.lora_B.weight"] = rs.randn(d_out, 8)
    write_adapter(tmp_path, {}, rank=8, tensors=tensors, target_modules="all-linear")
    assert os.path.getsize(tmp_path / "adapter_model.safetensors") <= LAYOUT.max_weights_bytes
    assert set(read(tmp_path).weights) == set(LAYOUT.modules)


def _header(header) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw


def _entry(**fields):
    return {A_NAME: {"dtype": "F32", "shape": [4, 16], "data_offsets": [0, 256], **fields}}


MALFORMED = [
    # (the file's bytes, words the error names)
    (b"\x01\x02", "it has 2 bytes, fewer than the 8"),
    ((1000).to_bytes(8, "little") + b"{}", "header length 1000 runs past the end of the file"),
    (_header(b'{"\xff\xfe": 1}'), "its header is not UTF-8"),
    (_header(b"{not json"), "its header is not JSON"),
    (_header(b"[" * 100_000 + b"]" * 100_000), "its header is not JSON"),  # nested too deep
    (_header([1, 2]), "its header is a JSON list, not an object"),
    (_header(42), "its header is a JSON int, not an object"),
    (_header({A_NAME: 5}), "is described by 5, not an object"),
    (_header(_entry(dtype="I8")) + A_BYTES, "has dtype 'I8', not one of"),
    (_header(_entry(dtype=None)) + A_BYTES, "has dtype None"),
    (_header(_entry(shape="4x16")) + A_BYTES, "has shape '4x16', not a list"),
    (_header(_entry(shape=[-4, -16])) + A_BYTES, "has shape [-4, -16]"),
    (_header(_entry(shape=[True, 16])) + A_BYTES, "has shape [True, 16]"),
    (_header(_entry(shape=[0] * 100)) + A_BYTES, "not a list of at most 32"),
    (_header(_entry(data_offsets=[0])) + A_BYTES, "data_offsets [0], not [start, end]"),
    (_header(_entry(data_offsets=[0, 1 << 30])) + A_BYTES, "outside the 256 bytes"),
    (_header(_entry(data_offsets=[256, 0])) + A_BYTES, "outside the 256 bytes"),
    (_header(_entry(data_offsets=[0, 128])) + A_BYTES, "needs 256 bytes, its data_offsets"),
    (_header(_entry(shape=[4, 8])) + A_BYTES, "needs 128 bytes, its data_offsets [0, 256]"),
]


@pytest.mark.parametrize("data,words", MALFORMED, ids=[w[:40] for _, w in MALFORMED])
def test_malformed_safetensors_are_refused_naming_the_file(tmp_path, data, words):
    write_adapter(tmp_path, {Q: (16, 32)})
    (tmp_path / "adapter_model.safetensors").write_bytes(data)
    with pytest.raises(ValueError, match="LoRA adapter 'ad'") as e:
        read(tmp_path)
    assert "cannot read adapter_model.safetensors: " in str(e.value)
    assert words in str(e.value)


CONFIGS = [
    # (adapter_config.json fields, words the error names)
    (dict(rank_pattern=[1]), "rank_pattern must be an object, got [1]"),
    (dict(rank_pattern={"q_proj": "4"}), "rank_pattern['q_proj'] must be a positive integer"),
    (dict(alpha_pattern={"q_proj": "8"}), "alpha_pattern['q_proj'] must be a number"),
    (dict(rank_pattern={r"(q)\1_proj": 4}), r"rank_pattern key '(q)\\1_proj' is not a regular"),
    (dict(alpha_pattern={"(?=q)q_proj": 4}), "alpha_pattern key '(?=q)q_proj' is not a regular"),
    (dict(rank_pattern={"(a{1000}){1000}": 4}), "is not a regular expression RE2 reads"),
    (dict(target_modules=["lm_head", 1, "q_proj"]), "target_modules [1, 'lm_head']"),
]


@pytest.mark.parametrize("config,words", CONFIGS, ids=[w[:40] for _, w in CONFIGS])
def test_malformed_configs_are_refused_by_name(tmp_path, config, words):
    write_adapter(tmp_path, {Q: (16, 32)}, **config)
    with pytest.raises(ValueError, match="LoRA adapter 'ad'") as e:
        read(tmp_path)
    assert words in str(e.value)


def test_a_config_that_is_not_utf8_is_refused_by_name(tmp_path):
    write_adapter(tmp_path, {Q: (16, 32)})
    (tmp_path / "adapter_config.json").write_bytes(b'{"peft_type": "\xff"}')
    with pytest.raises(ValueError, match="LoRA adapter 'ad'.*adapter_config.json is not JSON"):
        read(tmp_path)


def test_a_pattern_key_that_backtracks_is_matched_in_linear_time(tmp_path):
    # Python's `re` (PEFT's get_pattern_key) takes ~4x longer per 2 more word characters
    # of the module's name on this key: hours on these 40. RE2 answers at once.
    prefix = f"base_model.model.{'m' * 40}."
    write_adapter(tmp_path, {Q: (16, 32)}, rank=4, prefix=prefix, rank_pattern={r"(\w*)*!": 2})
    assert read(tmp_path).rank == 4  # (the key matches no module: the default rank)


PEFT_KEYS = [
    "q_proj",
    "self_attn.q_proj",
    "attn.q_proj",  # (not at a dot boundary)
    "proj",
    "layers.0.self_attn.q_proj",
    "^model.layers.0.self_attn.q_proj",
    r"layers\.[01]\.self_attn\.(q|v)_proj",
    ".*_proj",
    "down_proj|q_proj",
    "mlp",
]
MODULES = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "x.layers.0.mlp"]


@pytest.mark.parametrize("key", PEFT_KEYS)
def test_pattern_keys_match_the_modules_peft_matches(key):
    from jaxserve.lora.peft import _pattern_value, _patterns

    compiled = _patterns({"rank_pattern": {key: 2}}, "rank_pattern", "ad")
    for module in MODULES:
        peft = re.match(rf"(.*\.)?({key})$", module) is not None  # PEFT's get_pattern_key
        assert (_pattern_value(compiled, module, None) == 2) == peft, module
