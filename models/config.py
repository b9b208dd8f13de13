"""What a model definition knows about its architecture, parsed from HF `config.json`.

`ModelConfig` (with its `RopeConfig`) belongs to the models layer: model files
import it from here, and the engine's `jaxserve.config` builds on it, so the
dependency points from the engine down to the models and never back up.

This module imports no JAX: the engine's host-side config imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


def normalize_dtype(name: str, *, field: str = "dtype") -> str:
    """Maps "bf16", "bfloat16", "torch.bfloat16" ... to one of float32/bfloat16/float16."""
    key = str(name).removeprefix("torch.").lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"{field} must be one of {DTYPES} (or an alias), got {name!r}")
    return key


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    From HF `rope_parameters`, or the legacy `rope_theta` + `rope_scaling`.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r} "
                "(dynamic NTK scaling depends on the sequence length at run time; "
                "it is not supported)"
            )
        if not self.theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if not self.factor > 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        params = dict(hf.get("rope_parameters") or {})
        # Legacy (transformers 4.x) layout: rope_theta at top level, scaling in rope_scaling.
        params.update({k: v for k, v in (hf.get("rope_scaling") or {}).items() if v is not None})
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        if "partial_rotary_factor" in params and params["partial_rotary_factor"] != 1.0:
            raise ValueError(
                f"partial_rotary_factor {params['partial_rotary_factor']} is not supported"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in params.items() if k in fields and v is not None}
        return cls(theta=float(theta), rope_type=rope_type, **kwargs)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only model of the Llama family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Llama: bias on q, k, v and o projections.
    mlp_bias: bool = False
    # One entry per layer: the sliding window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "float32"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {_ACTIVATIONS}, got {self.hidden_act!r}")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )
        for w in self.sliding_windows:
            if w is not None and w <= 0:
                raise ValueError(f"sliding_window must be positive, got {w}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parses a Hugging Face `config.json` dict of a Llama-family model."""
        archs = hf.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise ValueError(f"config.json of {archs[0]!r} lacks {missing}")
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(hf),
            hidden_act=hf.get("hidden_act", "silu"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            sliding_windows=_sliding_windows(hf, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=normalize_dtype(
                hf.get("dtype") or hf.get("torch_dtype") or "float32", field="torch_dtype"
            ),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> ModelConfig:
        """Reads config.json; generation_config.json's eos_token_id, if any, takes precedence."""
        path = os.path.join(model_dir, "config.json")
        try:
            with open(path) as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json in model directory {model_dir!r}") from None
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                hf = {**hf, "eos_token_id": eos}
        return cls.from_hf(hf)


def _sliding_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Which layers use a sliding window, from whichever fields the config declares.

    transformers 5 writes `layer_types`; older Qwen2/Qwen3 configs write
    `use_sliding_window` + `max_window_layers` (layers at or past it slide);
    Mistral writes only `sliding_window` (all layers slide when it is set).
    """
    window = hf.get("sliding_window")
    if window is None:
        return (None,) * num_layers
    if "layer_types" in hf and hf["layer_types"] is not None:
        return tuple(window if t == "sliding_attention" else None for t in hf["layer_types"])
    if "use_sliding_window" in hf:
        if not hf["use_sliding_window"]:
            return (None,) * num_layers
        first = hf.get("max_window_layers", 0)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers
