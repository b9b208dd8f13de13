"""Writes a benchmark model with random weights, float32, saved by transformers.

  python benchmarks/make_model.py --shape=qwen05 --out=/tmp/qwen05
  python benchmarks/make_model.py --shape=llama60m --out=/tmp/llama60m
  python benchmarks/make_model.py --shape=moe1b --out=/tmp/moe1b

- `qwen05`: Qwen2.5-0.5B's shape, a `Qwen2ForCausalLM`: 494M parameters, 24
  layers, hidden 896, 14 query and 2 KV heads, vocabulary 151,936, tied
  embeddings, rope theta 1e6.
- `llama60m`: a 60M-parameter `LlamaForCausalLM` (8 layers, hidden 512, 8 heads,
  vocabulary 32,000), the small model of the start-up workload.
- `moe1b`: IBM Granite-3.0-1B-A400M's shape as a `Qwen3MoeForCausalLM`: 1.33B
  parameters (~0.4B active), 24 layers, hidden 1024, 16 query and 8 KV heads of
  64, 32 experts of hidden 512 with top-8 routing (renormalised), vocabulary
  49,155, tied embeddings (Qwen3-MoE adds q/k norms: 2 x 64 weights a layer).
- `tiny`: a 2-layer `LlamaForCausalLM` (hidden 256, 4 heads of 64, vocabulary 2,048),
  whose steps are mostly the engine's own work (`host_path.py`, the peers' host path).

Made with `save_pretrained`, seeded. The tokenizer files are the embedded demo
model's (benchmarks feed token ids, so only their shape matters). Needs the test
extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import shutil

import torch
import transformers

from jaxserve.assets import EMBEDDED_MODELS

LLAMA_SHAPES = {
    "llama60m": (32000, 512, 1536, 8, 8, 2048),
    "tiny": (2048, 256, 768, 2, 4, 40960),
}


def _config(shape: str) -> transformers.PretrainedConfig:
    if shape == "moe1b":
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=49155,
            hidden_size=1024,
            intermediate_size=512,
            moe_intermediate_size=512,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            num_experts=32,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        return cfg
    if shape == "qwen05":
        cfg = transformers.Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.architectures = ["Qwen2ForCausalLM"]
        return cfg
    # The Llama shapes: (vocabulary, hidden, MLP, layers, heads, positions); KV heads = heads.
    vocab, hidden, mlp, layers, heads, positions = LLAMA_SHAPES[shape]
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", choices=("qwen05", "moe1b", *LLAMA_SHAPES), default="qwen05")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = _config(args.shape)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{EMBEDDED_MODELS['demo-model']}/{name}", f"{args.out}/{name}")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
