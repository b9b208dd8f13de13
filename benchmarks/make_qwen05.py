"""Writes the benchmark model: Qwen2.5-0.5B's shape with random weights, float32.

  python benchmarks/make_qwen05.py --out=/tmp/qwen05

A `Qwen2ForCausalLM` made and saved by transformers (`save_pretrained`, seeded):
494M parameters, 24 layers, hidden 896, 14 query and 2 KV heads, vocabulary
151,936, tied embeddings, rope theta 1e6. The tokenizer files are the embedded
demo model's (benchmarks feed token ids, so only their shape matters). Needs the
test extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import shutil

import torch
import transformers

from jaxserve.assets import EMBEDDED_MODELS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
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
    torch.manual_seed(args.seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{EMBEDDED_MODELS['demo-model']}/{name}", f"{args.out}/{name}")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
