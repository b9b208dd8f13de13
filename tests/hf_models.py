"""Tiny random Hugging Face checkpoints for parity tests (torch + transformers, test-only)."""

from __future__ import annotations

import torch
import transformers

# Small shapes that still cover each architecture's features and the odd cases:
# a single KV head, query:KV ratios 14:2, 12:2, 5:1 and 3:3, head_dim 80 (not a
# power of two), head_dim unrelated to hidden_size / num_heads (Qwen3-style).
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

CASES: dict[str, tuple[str, dict]] = {
    "llama2_mha": ("LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama3_gqa_rope_scaling": (
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama_single_kv_head_bias": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=16,
            hidden_size=80,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "llama_linear_rope_gelu": (
        "LlamaForCausalLM",
        dict(
            rope_scaling=dict(rope_type="linear", factor=2.0),
            hidden_act="gelu_pytorch_tanh",
        ),
    ),
    "mistral_sliding_window": (
        "MistralForCausalLM",
        dict(
            num_attention_heads=12,
            num_key_value_heads=2,
            head_dim=16,
            hidden_size=96,
            sliding_window=8,
        ),
    ),
    "qwen2_14_to_2": (
        "Qwen2ForCausalLM",
        dict(
            num_attention_heads=14,
            num_key_value_heads=2,
            hidden_size=112,
            head_dim=8,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_yarn_head_dim_80": (
        "Qwen2ForCausalLM",
        dict(
            num_attention_heads=3,
            num_key_value_heads=3,
            hidden_size=240,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    # Gemma 2: local, global, local layers; the window (6) shorter than the prompts;
    # soft-caps small enough to bite; query_pre_attn_scalar != head_dim; head_dim
    # unrelated to hidden_size / num_heads.
    "gemma2_window_softcap": (
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=3,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=24,
            query_pre_attn_scalar=20,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            attn_logit_softcapping=1.5,
            final_logit_softcapping=4.0,
        ),
    ),
    # Gemma 3: q/k norms; local rope base 100, global base 5000 with linear scaling (as
    # the 12B); two local layers then a global one; no soft-caps (its default).
    "gemma3_local_global_rope": (
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            hidden_size=80,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
                full_attention=dict(rope_type="linear", factor=4.0, rope_theta=5000.0),
            ),
        ),
    ),
    # The text model of a multimodal Gemma 3 checkpoint (tensors under language_model.);
    # transformers' Gemma 3 ignores attn_logit_softcapping, and so must we.
    "gemma3_multimodal_text": (
        "Gemma3ForConditionalGeneration",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=2.0,
        ),
    ),
    # Mixtral: top-2 of 8 experts, softmax then top-k (renormalised); a single KV head.
    "mixtral_top2_of_8": (
        "MixtralForCausalLM",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=40,
            num_attention_heads=4,
            num_key_value_heads=1,
        ),
    ),
    # Qwen3-MoE: top-3 of 16 experts without renormalising (most experts get no token
    # in a decode step), the middle layer dense (mlp_only_layers), q/k norms.
    "qwen3_moe_top3_of_16": (
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            num_experts=16,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            head_dim=24,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-MoE whose router is zero and whose experts are all equal: every token's
    # scores tie, and we route every token to experts 0 and 1 (lax.top_k breaks ties
    # by the lower index; torch picks others, which compute the same).
    "qwen3_moe_all_tokens_one_expert": (
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            _tied_router=True,
        ),
    ),
    # Qwen2-MoE: top-2 of 8 experts plus a gated shared expert; layer 0 dense
    # (decoder_sparse_step 2), q/k/v biases.
    "qwen2_moe_shared_expert": (
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            decoder_sparse_step=2,
            num_hidden_layers=2,
        ),
    ),
    # DeepSeek-V3: multi-head latent attention (a latent of 32 + a rope key of 16: the
    # shared cache's one 48-wide row), q_lora_rank, 2 of 4 expert groups, a shared
    # expert, layer 0 dense.
    "deepseek_v3_mla": (
        "DeepseekV3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=24,
            v_head_dim=20,
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
        ),
    ),
    "qwen3_head_dim_mismatch": (
        "Qwen3ForCausalLM",
        dict(
            num_attention_heads=6,
            num_key_value_heads=2,
            hidden_size=64,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ),
}


def make_hf_model(path, arch: str, overrides: dict, *, seed: int = 0, dtype=torch.float32):
    """Builds a random `arch` model, perturbs norms and biases, saves it HF-style.

    `overrides` are config fields, and `_tied_router=True` (MoE): a zero router and
    all experts equal to expert 0, so that every token's expert scores tie.
    """
    overrides = dict(overrides)
    tied_router = overrides.pop("_tied_router", False)
    cfg_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
        "Gemma3ForConditionalGeneration": transformers.Gemma3Config,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
        "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
    }[arch]
    if arch == "Gemma3ForConditionalGeneration":  # a tiny vision tower beside the text model
        vision = dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        config = cfg_cls(
            text_config={**BASE, **overrides}, vision_config=vision, mm_tokens_per_image=4
        )
    else:
        config = cfg_cls(**{**BASE, **overrides})
    config.architectures = [arch]
    torch.manual_seed(seed)
    gemma = arch.startswith("Gemma")
    # Eager attention: Gemma 3's default (sdpa) silently drops the attention soft-cap.
    kw = dict(attn_implementation="eager") if gemma else {}
    model = getattr(transformers, arch)._from_config(config, **kw).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name:
                continue
            if "norm" in name:  # HF inits these to ones (Gemma: zeros); make them matter.
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, buffer in model.named_buffers():  # DeepSeek-V3's router correction
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
        if tied_router:
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.zero_()
                elif ".experts." in name:  # fused [E, ...] in transformers 5
                    p.copy_(p[:1].expand_as(p))
    model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return model


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld! Ça va? naïve café — 東京 and 北京, emoji 🙂🚀.",
    "Once upon a time, there was a little engine that could.",
] * 20


def save_tokenizer(path, *, vocab_size: int, added: dict[str, bool] | None = None) -> None:
    """Trains a byte-level BPE with special tokens and saves it HF-style with a chat
    template; `added` are more added tokens (text -> whether it is special)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    for text, special in (added or {}).items():
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def hf_greedy(model, weights: dict | None, prompt: list[int], max_tokens: int):
    """transformers' greedy tokens after `prompt` with `weights` loaded into `model`
    (a quantized checkpoint's dequantized weights; None: its own, e.g. a PEFT model's),
    and its first step's log-probabilities [V] (numpy, float64)."""
    if weights is not None:
        model.load_state_dict(weights)
    ids, first = list(prompt), None
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            if first is None:
                first = torch.log_softmax(logits, -1).numpy()
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], first


def check_like_reference(outs, want, case: str) -> None:
    """Served outputs (greedy, `logprobs` >= 5) against `hf_greedy`'s (tokens,
    first-step log-probabilities) per prompt: the same tokens, and the first step's
    top logprobs within 2e-2 (a quantized model's kernels against transformers' float
    dequantized weights)."""
    for out, (tokens, first) in zip(outs, want, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens, (case, got.token_ids, tokens)
        top = got.logprobs[0]
        assert len(top) >= 5
        for token, lp in top.items():
            assert abs(lp.logprob - first[token]) < 2e-2, (case, token, lp.logprob, first[token])


def tiny_causal_lms(archs, shapes: dict) -> dict:
    """Architecture name -> a random transformers model of `shapes` (config fields),
    float32, in eval mode; seeded by its place in `archs`."""
    models = {}
    for seed, arch in enumerate(archs):
        torch.manual_seed(seed)
        config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**shapes)
        models[arch] = getattr(transformers, arch)(config).float().eval()
    return models
