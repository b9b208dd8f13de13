"""The registry checks the model interface at registration."""

import pytest
from flax import nnx

from models import get_model_class, register, supported_architectures
from models.llama import LlamaForCausalLM


def test_supported_architectures():
    assert {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
    } <= set(supported_architectures())
    assert get_model_class("MistralForCausalLM") is LlamaForCausalLM


@pytest.mark.parametrize(
    "arch,path,want",
    [
        (
            "Gemma2ForCausalLM",
            ("model", "layers", 3, "pre_feedforward_layernorm", "weight"),
            ("model.layers.3.pre_feedforward_layernorm.weight", False),
        ),
        (
            "Gemma3ForConditionalGeneration",
            ("model", "layers", 0, "self_attn", "q_norm", "weight"),
            ("language_model.model.layers.0.self_attn.q_norm.weight", False),
        ),
        (
            "MixtralForCausalLM",
            ("model", "layers", 1, "block_sparse_moe", "experts", "w3"),
            ("model.layers.1.block_sparse_moe.experts.{}.w3.weight", True),
        ),
        (
            "Qwen3MoeForCausalLM",
            ("model", "layers", 2, "mlp", "gate", "kernel"),
            ("model.layers.2.mlp.gate.weight", True),
        ),
    ],
)
def test_checkpoint_names_of_the_new_families(arch, path, want):
    assert get_model_class(arch).checkpoint_key(path) == want


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: .*Llama"):
        get_model_class("GPT2LMHeadModel")


def test_interface_is_checked_at_registration():
    class NoLogits(nnx.Module):
        def __init__(self, config, *, dtype, attention_backend, rngs):
            pass

        def __call__(self, kv_caches, input_ids, positions, attention_metadata):
            pass

        @classmethod
        def checkpoint_key(cls, path):
            return "", False

    with pytest.raises(TypeError, match="lacks method compute_logits"):
        register("NoLogitsForCausalLM")(NoLogits)

    class WrongCall(NoLogits):
        def __call__(self, input_ids, kv_caches):
            pass

        def compute_logits(self, hidden):
            pass

    with pytest.raises(TypeError, match=r"__call__ must take parameters \('kv_caches'"):
        register("WrongCallForCausalLM")(WrongCall)

    with pytest.raises(TypeError, match="subclass of flax.nnx.Module"):
        register("NotAModule")(object)
    assert "NoLogitsForCausalLM" not in supported_architectures()


def test_an_architecture_cannot_be_registered_twice():
    class Other(LlamaForCausalLM):
        pass

    with pytest.raises(ValueError, match="registered twice"):
        register("LlamaForCausalLM")(Other)
