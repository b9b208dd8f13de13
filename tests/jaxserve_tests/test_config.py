"""Parsing HF configs and validating engine configs."""

import pytest

from jaxserve.config import (
    ENGINE_ARGS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    RopeConfig,
    SchedulerConfig,
    engine_config,
)

LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def test_defaults_and_derived_fields():
    c = ModelConfig.from_hf(LLAMA)
    assert c.head_dim == 8 and c.num_queries_per_kv == 4
    assert c.rope == RopeConfig() and c.sliding_windows == (None,) * 4


@pytest.mark.parametrize(
    "rope_fields",
    [
        dict(
            rope_theta=5e5,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        dict(
            rope_parameters=dict(
                rope_theta=5e5,
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ],
)
def test_legacy_and_transformers5_rope_layouts_agree(rope_fields):
    rope = ModelConfig.from_hf({**LLAMA, **rope_fields}).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 5e5, 8.0)


def test_legacy_type_key_is_read():
    c = ModelConfig.from_hf({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert c.rope.rope_type == "linear"


@pytest.mark.parametrize(
    "fields,want",
    [
        (dict(sliding_window=16), (16,) * 4),  # Mistral
        (dict(sliding_window=16, use_sliding_window=False), (None,) * 4),  # Qwen2 default
        (
            dict(sliding_window=16, use_sliding_window=True, max_window_layers=2),
            (None, None, 16, 16),
        ),
        (
            dict(sliding_window=16, layer_types=["full_attention", "sliding_attention"] * 2),
            (None, 16, None, 16),
        ),
    ],
)
def test_sliding_window_layouts(fields, want):
    assert ModelConfig.from_hf({**LLAMA, **fields}).sliding_windows == want


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(hidden_act="swiglu"), "hidden_act must be one of"),
        (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "dynamic NTK"),
        (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "original_max_position"),
        (dict(architectures=[]), "exactly one architecture"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
        (dict(num_attention_heads=None), r"lacks \['num_attention_heads'\]"),
    ],
)
def test_bad_model_configs(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**LLAMA, **fields})


def test_engine_config_sizes_the_pool_from_the_budget():
    model = ModelConfig.from_hf(LLAMA)
    # bytes per page: 4 layers * 16 tokens * 2 * 2 heads * 8 dims * 4 bytes = 8 KiB
    cfg = engine_config(
        "x", model, max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=10 * 8192
    )
    assert cfg.kv_bytes_per_page() == 8192
    assert cfg.num_kv_pages() == 10
    roomy = engine_config("x", model, max_model_len=256, max_num_seqs=4)
    assert roomy.num_kv_pages() == 4 * 16 + 1  # never more than max_num_seqs can use
    assert EngineConfig("x", model).max_model_len == 512


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(max_num_seqs=0), "max_num_seqs must be positive"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
        (dict(kv_cache_memory_bytes=100), "holds 0 pages"),
        (dict(kv_cache_dtype="fp4"), "kv_cache_dtype must be one of"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
        (dict(data_parallel_size=1.5), "data_parallel_size must be a positive integer"),
        (dict(data_parallel_backend="mpi"), "data_parallel_backend must be one of"),
        (dict(data_parallel_backend="ray"), "with data_parallel_size=1 there is one engine"),
        (dict(ray_address="auto"), "ray_address='auto' is for data_parallel_backend='ray'"),
        (
            dict(data_parallel_size=2, num_processes=2, coordinator_address="h:1"),
            "use data_parallel_backend='ray'",
        ),
        (dict(max_logit_bias=0), "max_logit_bias must be positive"),
        (dict(debug_preemption_rate=2.0), "debug_preemption_rate must be in"),
    ],
)
def test_bad_engine_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine_config("x", ModelConfig.from_hf(LLAMA), **kwargs).num_kv_pages()


def test_engine_config_maps_vllm_arguments_onto_the_nested_config():
    cfg = engine_config(
        "x",
        ModelConfig.from_hf(LLAMA),
        block_size=32,
        kv_cache_dtype="bf16",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        tensor_parallel_size=2,
        seed=7,
    )
    assert cfg.cache == CacheConfig(page_size=32, dtype="bfloat16")
    assert cfg.scheduler == SchedulerConfig(4, 64, enable_prefix_caching=False)
    assert cfg.parallel == ParallelConfig(tensor_parallel_size=2)
    assert cfg.seed == 7 and cfg.kv_dtype == "bfloat16"
    assert engine_config("x", ModelConfig.from_hf(LLAMA)).kv_dtype == "float32"  # auto
    assert "kv_cache_dtype" in ENGINE_ARGS and "max_num_seqs" in ENGINE_ARGS
    with pytest.raises(TypeError, match=r"unknown engine arguments \['max_num_seq'\]"):
        engine_config("x", ModelConfig.from_hf(LLAMA), max_num_seq=4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(page_size=12), "block_size must be a positive power of two"),
        (dict(num_pages=1), "num_kv_pages must be >= 2"),
        (dict(dtype="fp4"), "kv_cache_dtype must be one of .* got 'fp4'"),
    ],
)
def test_bad_cache_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


@pytest.mark.parametrize(
    "name,dtype,row_bytes",  # row: one token's K (or V) of one head, H = 8
    [
        ("auto", "auto", 32),
        ("bf16", "bfloat16", 16),
        ("INT8", "int8", 8 + 4),
        ("fp8", "fp8_e4m3", 8 + 4),
        ("fp8_e5m2", "fp8_e5m2", 8 + 4),
    ],
)
def test_kv_cache_dtypes_and_their_page_bytes(name, dtype, row_bytes):
    assert CacheConfig(dtype=name).dtype == dtype
    cfg = engine_config("x", ModelConfig.from_hf(LLAMA), kv_cache_dtype=name, block_size=8)
    model = cfg.model  # 4 layers, 2 KV heads of 8
    assert model.head_dim == 8
    assert cfg.kv_bytes_per_page() == model.num_layers * 8 * 2 * model.num_kv_heads * row_bytes


def test_pool_from_a_fraction_of_device_memory():
    model = ModelConfig.from_hf(LLAMA)
    cfg = engine_config(
        "x", model, max_model_len=256, max_num_seqs=64, kv_cache_memory_fraction=0.5
    )
    # 0.5 * 1 MiB - 256 KiB of weights = 256 KiB = 32 pages of 8 KiB.
    assert cfg.num_kv_pages(device_memory=(1 << 20, 1 << 18)) == 32
    assert cfg.num_kv_pages(device_memory=None) == 64 * 16 + 1  # CPU: the byte budget
    full = r"fraction=0.5 of 1048576 bytes, less 1048576 in use \(the weights\), holds 0"
    with pytest.raises(ValueError, match=full):
        cfg.num_kv_pages(device_memory=(1 << 20, 1 << 20))
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
        CacheConfig(memory_fraction=1.5)


@pytest.mark.parametrize(
    "rope_scaling,reach",
    [
        (None, 512),
        ({"rope_type": "linear", "factor": 2.0}, 1024),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            512,  # (llama3's configs give the extended length)
        ),
    ],
)
def test_a_max_model_len_past_the_models_positions_is_refused(rope_scaling, reach):
    """vLLM refuses a max_model_len its model's positions do not cover (unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN); it was accepted silently (issue 42)."""
    model = ModelConfig.from_hf({**LLAMA, "rope_scaling": rope_scaling})
    assert model.max_positions == reach
    assert EngineConfig("x", model, max_model_len=reach).max_model_len == reach
    with pytest.raises(ValueError, match=f"max_model_len={reach + 1} .* {reach} positions"):
        engine_config("x", model, max_model_len=reach + 1)
    allowed = engine_config("x", model, max_model_len=reach + 1, allow_long_max_model_len=True)
    assert allowed.max_model_len == reach + 1
