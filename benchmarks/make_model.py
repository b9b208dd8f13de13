"""Writes a benchmark model with random weights, float32, saved by transformers.

  python benchmarks/make_model.py --shape=qwen05 --out=/tmp/qwen05
  python benchmarks/make_model.py --shape=llama60m --out=/tmp/llama60m
  python benchmarks/make_model.py --shape=moe1b --out=/tmp/moe1b
  python benchmarks/make_model.py --shape=llama3_8b --streamed --out=/tmp/llama3_8b

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
- `llama3_8b`: Llama-3-8B's shape (8.03B parameters: 32 layers, hidden 4096, 32 query
  and 8 KV heads of 128, MLP 14,336, vocabulary 128,256, rope theta 500,000, untied
  LM head): `device_bench.py`'s model.

Made with `save_pretrained`, seeded; needs the test extra (torch, transformers).
`--streamed` (the Llama shapes) writes bfloat16 instead, without torch: config.json,
then model.safetensors one tensor at a time, each cut from one seeded 64 MiB random
block (RMSNorm weights are ones), under the names and layouts jaxserve's own model
class loads. No model is ever in host memory: Llama-3-8B's 16 GB are written as fast
as the disk takes them. The tokenizer files are the embedded demo model's (benchmarks
feed token ids, so only their shape matters).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.assets import EMBEDDED_MODELS


class LlamaShape(NamedTuple):
    vocab: int
    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    positions: int
    rope_theta: float = 10000.0


LLAMA_SHAPES = {
    "llama3_8b": LlamaShape(128256, 4096, 14336, 32, 32, 8, 8192, 500000.0),
    "llama60m": LlamaShape(32000, 512, 1536, 8, 8, 8, 2048),
    "tiny": LlamaShape(2048, 256, 768, 2, 4, 4, 40960),
}
# safetensors' names of the dtypes a streamed model is written in
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def llama_config(shape: str) -> dict:
    """`shape`'s config.json (a `LlamaForCausalLM`), as transformers writes it."""
    s = LLAMA_SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.mlp,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "max_position_embeddings": s.positions,
        "rope_theta": s.rope_theta,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _copy_tokenizer(out: str) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{EMBEDDED_MODELS['demo-model']}/{name}", f"{out}/{name}")


def write_streamed(shape: str, out: str, *, dtype: str = "bfloat16", seed: int = 0) -> int:
    """Writes `shape`'s model directory with random `dtype` weights, one tensor at a
    time (the module docstring); returns the weights' bytes."""
    import jax
    import ml_dtypes
    from flax import nnx

    from jaxserve.checkpoint.hf import abstract_model, tensor_names
    from models import get_model_class
    from models.config import ModelConfig

    hf = llama_config(shape)
    config = ModelConfig.from_hf(hf)
    cls = get_model_class(config.architecture)
    abstract = abstract_model(config, dtype=dtype, attention_backend="reference")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tree_path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(abstract)):
        names, transpose, stacked = tensor_names(cls, tree_path, leaf.shape)
        dims = leaf.shape[1:] if stacked else leaf.shape
        dims = dims[::-1] if transpose else dims  # HF stores linears [out, in]
        for name in names:
            size = math.prod(dims) * np_dtype.itemsize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(dims),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(32 << 20, dtype=np.float32) * 0.02).astype(np_dtype)
    block_bytes = memoryview(block.view(np.uint8))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**hf, "torch_dtype": dtype}, f, indent=1)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            if "norm" in name:  # RMSNorm scales: ones, as a trained model's are near
                f.write(np.ones((end - start) // np_dtype.itemsize, np_dtype).tobytes())
                continue
            while start < end:
                n = min(end - start, len(block_bytes))
                f.write(block_bytes[:n])
                start += n
    _copy_tokenizer(out)
    return offset


def transformers_config(shape: str) -> transformers.PretrainedConfig:
    """`shape`'s transformers config (`llama_config` for the Llama shapes)."""
    import transformers

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
    hf = llama_config(shape)
    architectures = hf.pop("architectures")
    del hf["model_type"], hf["hidden_act"], hf["rms_norm_eps"], hf["tie_word_embeddings"]
    cfg = transformers.LlamaConfig(**hf)
    cfg.architectures = architectures
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", choices=("qwen05", "moe1b", *LLAMA_SHAPES), default="qwen05")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--streamed",
        action="store_true",
        help="Llama shapes: bfloat16 weights written tensor by tensor, without torch",
    )
    args = p.parse_args()
    if args.streamed:
        if args.shape not in LLAMA_SHAPES:
            p.error(f"--streamed writes the Llama shapes {sorted(LLAMA_SHAPES)}, not {args.shape}")
        num_bytes = write_streamed(args.shape, args.out, seed=args.seed)
        print(f"wrote {args.out}: {num_bytes / 1e9:.2f} GB of bfloat16 weights")
        return
    import torch
    import transformers

    cfg = transformers_config(args.shape)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(args.out, safe_serialization=True)
    _copy_tokenizer(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
