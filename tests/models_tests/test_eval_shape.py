"""Every supported architecture builds and traces at its real size without allocating."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoint import abstract_model
from jaxserve.config import ModelConfig
from jaxserve.runner.input_batch import PageTable, SeqWork, build_batch
from jaxserve.runner.sampler import prompt_logprobs_layout
from jaxserve.runner.step import ModelDef, StepInput, forward, logits_step, prompt_logprobs_step
from models import supported_architectures

# Published configs (config.json fields) and parameter counts.
REAL_CONFIGS = {
    "Llama-2-7B": (
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
        ),
        6.74e9,
    ),
    "Llama-3.1-8B": (
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        8.03e9,
    ),
    "Mistral-7B-v0.1": (
        dict(
            architectures=["MistralForCausalLM"],
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            sliding_window=4096,
        ),
        7.24e9,
    ),
    "Qwen2.5-7B": (
        dict(
            architectures=["Qwen2ForCausalLM"],
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
        7.62e9,
    ),
    "Qwen2.5-0.5B": (
        dict(
            architectures=["Qwen2ForCausalLM"],
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
        4.94e8,
    ),
    "Qwen3-8B": (
        dict(
            architectures=["Qwen3ForCausalLM"],
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
        8.19e9,
    ),
    "Gemma-2-9B": (
        dict(
            architectures=["Gemma2ForCausalLM"],
            vocab_size=256000,
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=8192,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=4096,
        ),
        9.24e9,
    ),
    # Text only: the Gemma 3 report's embedding (1,012M) + non-embedding (10,759M)
    # parameters; its 12.2B total includes the 417M vision encoder.
    "Gemma-3-12B-text": (
        dict(
            architectures=["Gemma3ForCausalLM"],
            vocab_size=262208,
            hidden_size=3840,
            intermediate_size=15360,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            sliding_window_pattern=6,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            max_position_embeddings=131072,
        ),
        11.771e9,
    ),
    # The multimodal checkpoint's config.json as published: its text_config lists only
    # what differs from the defaults. Text model: 675M + 3,209M (Gemma 3 report).
    "Gemma-3-4B-it-text": (
        dict(
            architectures=["Gemma3ForConditionalGeneration"],
            eos_token_id=[1, 106],
            text_config=dict(
                hidden_size=2560,
                intermediate_size=10240,
                model_type="gemma3_text",
                num_hidden_layers=34,
                rope_scaling=dict(factor=8.0, rope_type="linear"),
                sliding_window=1024,
            ),
        ),
        3.884e9,
    ),
    "Mixtral-8x7B": (
        dict(
            architectures=["MixtralForCausalLM"],
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        46.7e9,
    ),
    "Qwen3-30B-A3B": (
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=40960,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
        30.5e9,
    ),
    "Qwen1.5-MoE-A2.7B": (
        dict(
            architectures=["Qwen2MoeForCausalLM"],
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            max_position_embeddings=8192,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
        14.3e9,
    ),
    # MLA: the cache's one KV head is kv_lora_rank + qk_rope_head_dim = 576 wide.
    "DeepSeek-V2-Lite": (
        dict(
            architectures=["DeepseekV2ForCausalLM"],
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            topk_method="greedy",
            scoring_func="softmax",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            max_position_embeddings=163840,
            rope_theta=10000,
            rope_scaling=dict(
                type="yarn",
                factor=40,
                original_max_position_embeddings=4096,
                beta_fast=32,
                beta_slow=1,
                mscale=0.707,
                mscale_all_dim=0.707,
            ),
            tie_word_embeddings=False,
        ),
        15.7e9,
    ),
    # The main model (the 14B multi-token-prediction layer is not served).
    "DeepSeek-V3": (
        dict(
            architectures=["DeepseekV3ForCausalLM"],
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=3,
            moe_layer_freq=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=1,
            max_position_embeddings=163840,
            rope_theta=10000,
            rope_scaling=dict(
                type="yarn",
                factor=40,
                original_max_position_embeddings=4096,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            tie_word_embeddings=False,
        ),
        671e9,
    ),
}


def test_every_registered_architecture_is_covered():
    covered = {hf["architectures"][0] for hf, _ in REAL_CONFIGS.values()}
    assert covered == set(supported_architectures())


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_size_builds_and_traces_abstractly(name):
    hf, params = REAL_CONFIGS[name]
    config = ModelConfig.from_hf(hf)
    model_def, leaves = ModelDef.split(
        abstract_model(config, dtype="bfloat16", attention_backend="reference")
    )
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    # bfloat16 throughout, but DeepSeek's routers: float32, as transformers keeps them.
    others = [x for x in leaves if x.dtype != jnp.bfloat16]
    assert not others or config.mla is not None
    assert all(x.dtype == jnp.float32 and x.shape[0] == config.moe.num_experts for x in others)
    count = sum(int(np.prod(x.shape)) for x in leaves)
    assert abs(count - params) / params < 0.01, f"{count:,} parameters, expected ~{params:,.0f}"

    # The whole step traces at full size: a mixed batch of a prefill chunk and a decode.
    page, pages_per_seq = 16, 8
    kv = [
        jax.ShapeDtypeStruct((64, page, 2 * config.num_kv_heads, config.head_dim), jnp.bfloat16)
    ] * config.num_layers
    table = PageTable(pages_per_seq, 8, max_writes=10)  # (the page tables kept on the device)
    batch = build_batch(
        [SeqWork(list(range(20)), 0, [1, 2]), SeqWork([5], 40, [3, 4, 5])],
        page_size=page,
        pages_per_seq=pages_per_seq,
        token_bucket=32,
        seq_bucket=4,
        table=table,
    )
    selected, hidden, new_kv, new_table = jax.eval_shape(
        functools.partial(forward, model_def),
        leaves,
        kv,
        StepInput.packed(batch),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct(table.shape, jnp.int32),
    )
    assert new_table.shape == table.shape
    logits = jax.eval_shape(functools.partial(logits_step, model_def), leaves, selected)
    prompt_lp = jax.eval_shape(
        functools.partial(prompt_logprobs_step, model_def), leaves, hidden, batch.prompt_targets
    )
    assert selected.shape == (4, config.hidden_size)
    assert hidden.shape == (32, config.hidden_size)
    assert prompt_lp.shape == (prompt_logprobs_layout(32).size,)  # packed:
    assert prompt_logprobs_layout(32).shapes() == ((32,), (32,), (32, 20), (32, 20))
    assert logits.shape == (4, config.vocab_size) and logits.dtype == jnp.float32
    assert [x.shape for x in new_kv] == [x.shape for x in kv]
