"""PEFT adapter directories written with numpy alone, as PEFT saves them (for tests that
need adapter files, not PEFT's model: no torch), and adapters over a served model."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from jaxserve.lora import LoRARequest


def write_adapter(
    path,
    modules: dict[str, tuple[int, int]],
    *,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    prefix: str = "base_model.model.model.",
    tensors: dict[str, np.ndarray] | None = None,
    **config,
) -> str:
    """An adapter of `rank` on `modules` ({'layers.0.self_attn.q_proj': (in, out)}),
    random matrices; `config` are more adapter_config.json fields, `tensors` more (or
    replacing) safetensors entries. Returns the directory."""
    os.makedirs(path, exist_ok=True)
    rs = np.random.RandomState(seed)
    out = {}
    targets = sorted({name.rsplit(".", 1)[-1] for name in modules})
    for name, (d_in, d_out) in modules.items():
        out[f"{prefix}{name}.lora_A.weight"] = rs.randn(rank, d_in).astype(np.float32)
        out[f"{prefix}{name}.lora_B.weight"] = rs.randn(d_out, rank).astype(np.float32)
    out.update(tensors or {})
    save_file(out, os.path.join(path, "adapter_model.safetensors"))
    cfg = dict(
        peft_type="LORA",
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        bias="none",
        use_dora=False,
        use_rslora=False,
        base_model_name_or_path=None,
    )
    cfg.update(config)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


def adapters(llm, root, count: int, rank: int = 4) -> list[LoRARequest]:
    """`count` adapters on every projection of the model `llm` serves (an `LLM` with
    enable_lora; random, distinct), written under `root`: "ad0" (id 1), "ad1", ..."""
    modules = llm.engine.adapters.layout.modules
    return [
        LoRARequest(f"ad{i}", i + 1, write_adapter(root / f"ad{i}", modules, rank=rank, seed=i))
        for i in range(count)
    ]
