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
    """Builds a random `arch` model, perturbs norms and biases, saves it HF-style."""
    cfg_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[arch]
    config = cfg_cls(**{**BASE, **overrides})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF inits these to ones; make them matter.
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
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


def save_tokenizer(path, *, vocab_size: int) -> None:
    """Trains a byte-level BPE with special tokens and saves it HF-style with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
