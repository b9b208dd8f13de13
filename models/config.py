"""What a model definition knows about its architecture, parsed from HF `config.json`.

`ModelConfig` (with its `RopeConfig`) belongs to the models layer: model files
import it from here, and the engine's `jaxserve.config` builds on it, so the
dependency points from the engine down to the models and never back up.

This module imports no JAX: the engine's host-side config imports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
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


TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP: each token runs `top_k` of `num_experts` experts.

    The router's softmax runs over all experts, the top k are kept, and with
    `norm_topk_prob` their weights are renormalised to sum to one (Mixtral always;
    Qwen3-MoE per its config). `sparse_layers` says which layers have the MoE MLP
    (the others a dense MLP of `ModelConfig.intermediate_size`). Qwen2-MoE adds a
    shared expert, run on every token, of `shared_expert_intermediate_size`
    (DeepSeek's shared experts, ungated, are one MLP of that size too).

    DeepSeek's routers (`models.moe.route_grouped`) choose by `topk_method`:
    "greedy" is the softmax top k above; "group_limited_greedy" (V2) first keeps the
    `topk_group` of `n_group` groups of experts whose best expert scores highest;
    "noaux_tc" (V3) scores by sigmoid, chooses groups (by their two best) and experts
    on the scores plus a learnt per-expert bias, and weighs them by the scores alone.
    Both multiply the weights by `routed_scaling_factor`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int | None = None
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) exceeds num_experts ({self.num_experts})"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.topk_method == "greedy":
            return
        per_group, groups = divmod(self.num_experts, self.n_group)
        if groups or self.topk_group > self.n_group:
            raise ValueError(
                f"n_group={self.n_group} must divide the {self.num_experts} experts and be "
                f">= topk_group={self.topk_group}"
            )
        if self.top_k > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} exceeds the {self.topk_group * per_group} "
                f"experts of the topk_group={self.topk_group} groups a token may use"
            )
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(
                f"n_group={self.n_group} leaves {per_group} expert a group; noaux_tc "
                "scores a group by its two best experts"
            )


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): a token's keys and values are
    up-projected (`kv_b_proj`) from one latent of `kv_lora_rank` values, beside a
    rope key of `qk_rope_head_dim` values shared by all heads. A query head is
    `qk_nope_head_dim` values matched against its key's up-projected part plus
    `qk_rope_head_dim` roped ones; a value head has `v_head_dim`. `q_lora_rank`: the
    queries' own low-rank path (q_a_proj, q_a_layernorm, q_b_proj); None: q_proj.
    `rope_interleave`: the rope dimensions rotate in adjacent pairs (V2 always, V3
    by its config), not as two halves."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and not (
            isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0
        ):
            raise ValueError(
                f"q_lora_rank must be a positive integer or None, got {self.q_lora_rank!r}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The one KV head the paged cache stores a token as: the latent, then the
        rope key (`models.deepseek`)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only model: the Llama family and its relatives
    (Gemma 2/3's soft-capping, attention scale and local rope; MoE MLPs)."""

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
    # Attention scores are q.k * query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim.
    query_pre_attn_scalar: float | None = None
    # scores -> cap * tanh(scores / cap) (Gemma 2); None: no capping.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # The rope of sliding-window layers where it differs from `rope` (Gemma 3).
    local_rope: RopeConfig | None = None
    moe: MoeConfig | None = None
    # DeepSeek's attention; the cache then holds one KV head (num_kv_heads 1) of
    # mla.cache_head_dim values (head_dim), whatever the checkpoint's config says.
    mla: MlaConfig | None = None
    # Weights stored quantized ("int8" / "int4": an orbax directory `jaxserve convert
    # --quantization=...` wrote; "awq", "gptq", "compressed-tensors": a 4-bit checkpoint
    # as users download it: its quant_method); None: floating point.
    quantization: str | None = None
    # Another tool's checkpoint: config.json's quantization_config, as JSON (hashable);
    # the engine reads it (`jaxserve.quantized.served.checkpoint_format`).
    quantization_config: str | None = None

    @property
    def max_positions(self) -> int:
        """The longest sequence the model's positions cover (vLLM's derived
        max_model_len): max_position_embeddings, stretched by linear rope scaling's
        factor; YaRN's reach is its original positions times the factor (llama3's
        configs already give the extended length)."""
        rope = self.rope
        if rope.rope_type == "linear":
            return int(self.max_position_embeddings * rope.factor)
        if rope.rope_type == "yarn":
            return int(rope.original_max_position_embeddings * rope.factor)
        return self.max_position_embeddings

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
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError(
                f"moe.sparse_layers has {len(self.moe.sparse_layers)} entries for "
                f"{self.num_layers} layers"
            )
        mla = self.mla
        if mla is not None and (self.num_kv_heads, self.head_dim) != (1, mla.cache_head_dim):
            raise ValueError(
                f"multi-head latent attention caches 1 KV head of kv_lora_rank + "
                f"qk_rope_head_dim = {mla.cache_head_dim} values, got num_kv_heads="
                f"{self.num_kv_heads}, head_dim={self.head_dim}"
            )

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax (and the soft-cap). DeepSeek's:
        qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where
        the rope is scaled (as transformers' `yarn_apply_mscale`)."""
        if self.mla is not None:
            scale = self.mla.qk_head_dim**-0.5
            rope = self.rope
            if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
                mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
                scale *= mscale * mscale
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_for_layer(self, layer: int) -> RopeConfig:
        """Sliding-window layers take `local_rope` where the model has one."""
        if self.local_rope is not None and self.sliding_windows[layer] is not None:
            return self.local_rope
        return self.rope

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parses a Hugging Face `config.json` dict of a supported model."""
        archs = hf.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        hf = _with_defaults(archs[0], hf)
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
        rope, local_rope = _ropes(hf)
        mla = _mla(archs[0], hf)
        if mla is None:
            num_kv_heads = hf.get("num_key_value_heads") or num_heads
            head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        else:  # the cache's one head (`MlaConfig.cache_head_dim`)
            num_kv_heads, head_dim = 1, mla.cache_head_dim
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=rope,
            local_rope=local_rope,
            # Gemma's configs name it hidden_activation (and HF's Gemma reads only that).
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            sliding_windows=_sliding_windows(hf, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=normalize_dtype(
                hf.get("dtype") or hf.get("torch_dtype") or "float32", field="torch_dtype"
            ),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            moe=_deepseek_moe(archs[0], hf, num_layers) if mla else _moe(hf, num_layers),
            mla=mla,
            **_stored_quantization(hf),
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


# `quantization_config.quant_method` of checkpoints whose weights jaxserve stored
# quantized (`jaxserve convert --quantization`) -> the quantization they hold.
STORED_QUANTIZATIONS = {"jaxserve_int8": "int8", "jaxserve_int4": "int4", "jaxserve_fp8": "fp8"}


def _stored_quantization(hf: dict[str, Any]) -> dict[str, Any]:
    """The quantization the checkpoint's weights are stored in, from config.json's
    `quantization_config` (or compressed-tensors' older `compression_config`):
    {quantization, quantization_config} of `ModelConfig`. Another tool's format is
    kept as it is, for the engine to read or refuse."""
    key = "quantization_config" if "quantization_config" in hf else "compression_config"
    qc = hf.get(key)
    if qc is None:
        return dict(quantization=None)
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method in STORED_QUANTIZATIONS:
        return dict(quantization=STORED_QUANTIZATIONS[method])
    return dict(quantization=str(method), quantization_config=json.dumps(qc, sort_keys=True))


# HF config-class defaults that a config.json may omit, by architecture: Gemma 3's
# multimodal checkpoints list only the text fields that differ from these.
_GEMMA2_DEFAULTS = dict(
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=256,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    sliding_window=4096,
    sliding_window_pattern=2,  # local, global, local, ...
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
_GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    sliding_window_pattern=6,  # five local layers, then a global one
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    bos_token_id=2,
    eos_token_id=1,
)
# DeepSeek's own fields (transformers' DeepseekV2Config / DeepseekV3Config defaults).
_DEEPSEEK_V2_DEFAULTS = dict(
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    moe_intermediate_size=1407,
    first_k_dense_replace=0,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
)
_DEEPSEEK_V3_DEFAULTS = dict(
    _DEEPSEEK_V2_DEFAULTS,
    n_routed_experts=256,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    first_k_dense_replace=3,
    topk_method="noaux_tc",
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    rope_interleave=True,
)
_DEFAULTS = {
    "Gemma2ForCausalLM": _GEMMA2_DEFAULTS,
    "Gemma3ForCausalLM": _GEMMA3_TEXT_DEFAULTS,
    "DeepseekV2ForCausalLM": _DEEPSEEK_V2_DEFAULTS,
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3_DEFAULTS,
}


def _with_defaults(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` with its architecture's HF defaults filled in; Gemma 3's multimodal config
    contributes its `text_config` (its vision tower is not served)."""
    if arch == "Gemma3ForConditionalGeneration":
        text = hf.get("text_config") or {}
        keys = ("eos_token_id", "bos_token_id", "dtype", "torch_dtype")
        top = {k: hf[k] for k in keys if k in hf}
        return {**_GEMMA3_TEXT_DEFAULTS, **text, **top, "architectures": [arch]}
    return {**_DEFAULTS.get(arch, {}), **hf}


def _ropes(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """The global rope and, where it differs, the sliding layers' (Gemma 3).

    transformers 5 writes Gemma 3's as `rope_parameters` keyed by layer type; older
    configs write `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`.
    """
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        rope = RopeConfig.from_hf({"rope_parameters": params.get("full_attention") or {}})
        local = params.get("sliding_attention")
        return rope, (RopeConfig.from_hf({"rope_parameters": local}) if local else None)
    rope = RopeConfig.from_hf(hf)
    if hf.get("rope_local_base_freq") is not None:
        return rope, RopeConfig(theta=float(hf["rope_local_base_freq"]))
    return rope, None


def _moe(hf: dict[str, Any], num_layers: int) -> MoeConfig | None:
    """Mixtral's experts (of `intermediate_size`, always renormalised) or Qwen3-MoE's (of
    `moe_intermediate_size`; `decoder_sparse_step` and `mlp_only_layers` pick the sparse
    layers). transformers 5 writes the count as `num_local_experts` for both; Qwen's
    older configs as `num_experts`."""
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if num_experts and hf.get("moe_intermediate_size"):
        step = hf.get("decoder_sparse_step") or 1
        dense = set(hf.get("mlp_only_layers") or ())
        return MoeConfig(
            num_experts=num_experts,
            top_k=hf.get("num_experts_per_tok", 1),
            intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or None,
        )
    if num_experts:
        return MoeConfig(
            num_experts=num_experts,
            top_k=hf.get("num_experts_per_tok", 2),
            intermediate_size=hf["intermediate_size"],
            norm_topk_prob=True,
            sparse_layers=(True,) * num_layers,
        )
    return None


MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _mla(arch: str, hf: dict[str, Any]) -> MlaConfig | None:
    """DeepSeek's attention fields, None for another architecture. V2 always rotates
    the rope dimensions in pairs."""
    if arch not in MLA_ARCHITECTURES:
        return None
    return MlaConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        q_lora_rank=hf["q_lora_rank"],
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def _deepseek_moe(arch: str, hf: dict[str, Any], num_layers: int) -> MoeConfig | None:
    """DeepSeek's experts: layers from `first_k_dense_replace` on are sparse, with
    `n_shared_experts` experts' worth of shared MLP. The router is transformers':
    V3's sigmoid "noaux_tc" (its `topk_method` and `scoring_func` say so, or are
    absent), V2's softmax "greedy" or "group_limited_greedy". Where transformers and
    DeepSeek's own code disagree, refused: V2's `norm_topk_prob` (transformers
    ignores it) and `moe_layer_freq` other than 1 (transformers makes every layer
    from first_k_dense_replace on sparse)."""
    if not hf["n_routed_experts"]:
        return None
    v3 = arch == "DeepseekV3ForCausalLM"
    scoring, method = hf.get("scoring_func"), hf["topk_method"]
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    scoring_func = "sigmoid" if v3 else "softmax"
    if scoring not in (None, scoring_func):
        raise ValueError(
            f"{arch}: scoring_func {scoring!r} is not supported, only {scoring_func!r}"
        )
    if method not in methods:
        raise ValueError(f"{arch}: topk_method {method!r} is not supported, only {methods}")
    if not v3 and hf["norm_topk_prob"]:
        raise ValueError(
            f"{arch}: norm_topk_prob True is not supported (transformers' DeepSeek-V2 "
            "ignores it, DeepSeek's own code renormalises; released V2 checkpoints set false)"
        )
    freq = hf.get("moe_layer_freq") or 1
    if freq != 1:
        raise ValueError(
            f"{arch}: moe_layer_freq {freq} is not supported (transformers makes every "
            "layer from first_k_dense_replace on sparse)"
        )
    size, first_dense = hf["moe_intermediate_size"], hf["first_k_dense_replace"] or 0
    return MoeConfig(
        num_experts=hf["n_routed_experts"],
        top_k=hf.get("num_experts_per_tok") or 1,
        intermediate_size=size,
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        shared_expert_intermediate_size=(hf["n_shared_experts"] or 0) * size or None,
        topk_method=method,
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
    )


def _sliding_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Which layers use a sliding window, from whichever fields the config declares.

    transformers 5 writes `layer_types`; older Qwen2/Qwen3 configs write
    `use_sliding_window` + `max_window_layers` (layers at or past it slide);
    older Gemma configs a `sliding_window_pattern` (layer i is global when
    i + 1 is a multiple of it; the default filled in per architecture);
    Mistral writes only `sliding_window` (all layers slide when it is set).
    """
    window = hf.get("sliding_window")
    if window is None:
        return (None,) * num_layers
    if "layer_types" in hf and hf["layer_types"] is not None:
        return tuple(window if t == "sliding_attention" else None for t in hf["layer_types"])
    if hf.get("sliding_window_pattern"):
        pattern = hf["sliding_window_pattern"]
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    if "use_sliding_window" in hf:
        if not hf["use_sliding_window"]:
            return (None,) * num_layers
        first = hf.get("max_window_layers", 0)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers
