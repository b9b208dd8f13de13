"""Parsing the new families' HF configs: Gemma 2/3 layer types, ropes and caps; MoE fields."""

import dataclasses
import json

import pytest

from models.config import ModelConfig, MoeConfig, RopeConfig

BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_gemma2_hub_config_without_layer_types_alternates_local_and_global():
    # google/gemma-2-9b's config.json predates layer_types.
    c = ModelConfig.from_hf(
        dict(
            BASE,
            architectures=["Gemma2ForCausalLM"],
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=4096,
            query_pre_attn_scalar=144,
        )
    )
    assert c.sliding_windows == (4096, None) * 3
    assert c.query_pre_attn_scalar == 144 and c.attention_scale == 144**-0.5
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)  # HF's defaults
    assert c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings
    assert c.head_dim == 256 and c.local_rope is None and c.moe is None


def test_gemma2_explicit_nulls_are_kept():
    c = ModelConfig.from_hf(
        dict(
            BASE,
            architectures=["Gemma2ForCausalLM"],
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )
    )
    assert c.attn_logit_softcap is None and c.final_logit_softcap is None


def test_gemma3_legacy_rope_fields_and_window_pattern():
    c = ModelConfig.from_hf(
        dict(
            BASE,
            architectures=["Gemma3ForCausalLM"],
            num_hidden_layers=12,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            sliding_window=512,
            sliding_window_pattern=6,
        )
    )
    assert c.sliding_windows == ((512,) * 5 + (None,)) * 2
    assert c.rope == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert c.local_rope == RopeConfig(theta=1e4)
    assert c.rope_for_layer(0) == c.local_rope and c.rope_for_layer(5) == c.rope
    assert c.final_logit_softcap is None


def test_gemma3_transformers5_rope_parameters_by_layer_type():
    c = ModelConfig.from_hf(
        dict(
            BASE,
            architectures=["Gemma3ForCausalLM"],
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10.0),
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=20.0),
            ),
        )
    )
    assert c.sliding_windows == (8, None)
    assert c.local_rope == RopeConfig(theta=10.0)
    assert c.rope == RopeConfig(theta=20.0, rope_type="linear", factor=2.0)


def test_gemma3_multimodal_config_takes_its_text_config_with_defaults():
    c = ModelConfig.from_hf(
        dict(
            architectures=["Gemma3ForConditionalGeneration"],
            eos_token_id=[1, 106],
            text_config=dict(hidden_size=2560, num_hidden_layers=34, sliding_window=1024),
            vision_config=dict(hidden_size=1152),
        )
    )
    assert c.architecture == "Gemma3ForConditionalGeneration"
    assert (c.hidden_size, c.num_layers, c.vocab_size) == (2560, 34, 262208)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (8, 4, 256)
    assert c.eos_token_ids == (1, 106)
    assert c.sliding_windows[:6] == (1024,) * 5 + (None,)
    assert c.local_rope.theta == 1e4 and c.rope.theta == 1e6


def test_mixtral_experts():
    c = ModelConfig.from_hf(
        dict(BASE, architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2)
    )
    assert c.moe == MoeConfig(8, 2, 128, norm_topk_prob=True, sparse_layers=(True,) * 6)


@pytest.mark.parametrize("count_field", ["num_experts", "num_local_experts"])  # legacy, HF 5
def test_qwen3_moe_sparse_layers(count_field):
    c = ModelConfig.from_hf(
        dict(
            BASE,
            architectures=["Qwen3MoeForCausalLM"],
            moe_intermediate_size=32,
            num_experts_per_tok=4,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            **{count_field: 16},
        )
    )
    assert c.moe.num_experts == 16 and c.moe.top_k == 4 and c.moe.intermediate_size == 32
    assert not c.moe.norm_topk_prob  # HF's default for Qwen3-MoE
    # sparse where (i + 1) % 2 == 0, except the listed dense layer 3
    assert c.moe.sparse_layers == (False, True, False, False, False, True)


def test_moe_config_errors():
    with pytest.raises(ValueError, match="exceeds num_experts"):
        MoeConfig(num_experts=4, top_k=5, intermediate_size=8)
    with pytest.raises(ValueError, match="intermediate_size must be a positive"):
        MoeConfig(num_experts=4, top_k=2, intermediate_size=0)
    with pytest.raises(ValueError, match="sparse_layers has 1 entries for 6 layers"):
        llama = ModelConfig.from_hf(dict(BASE, architectures=["LlamaForCausalLM"]))
        dataclasses.replace(llama, moe=MoeConfig(4, 2, 8, sparse_layers=(True,)))
    with pytest.raises(ValueError, match="attn_logit_softcap must be positive"):
        ModelConfig.from_hf(
            dict(BASE, architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=0.0)
        )


def test_qwen2_moe_shared_expert():
    c = ModelConfig.from_hf(
        dict(
            BASE,
            architectures=["Qwen2MoeForCausalLM"],
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
        )
    )
    assert c.moe.shared_expert_intermediate_size == 5632 and c.moe.sparse_layers == (True,) * 6


def test_stored_quantization_is_read_and_other_methods_are_refused():
    llama = dict(BASE, architectures=["LlamaForCausalLM"])
    assert ModelConfig.from_hf(llama).quantization is None
    stored = dict(llama, quantization_config={"quant_method": "jaxserve_int8"})
    assert ModelConfig.from_hf(stored).quantization == "int8"
    gptq = dict(llama, quantization_config={"quant_method": "gptq", "bits": 4})
    c = ModelConfig.from_hf(gptq)  # another tool's: the engine reads it (or refuses)
    assert c.quantization == "gptq" and json.loads(c.quantization_config) == {
        "quant_method": "gptq",
        "bits": 4,
    }
