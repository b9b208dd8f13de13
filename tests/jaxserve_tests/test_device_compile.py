"""Every program the engine compiles at warm-up, compiled for real for TPUs and GPUs
that are not here (`jaxserve.targets`: Mosaic and XLA:TPU, Triton and XLA:GPU).

Each case builds the engine itself for a compile-only target (`LLMEngine(target=...)`,
the warm-up a TPU VM or a GPU machine runs) from a `config.json` alone: a small
model, and real-size ones (Llama-3-8B, Qwen2.5-7B, Gemma-2-9B, Mixtral-8x7B shapes,
with 2 of their layers: every layer compiles alike, and the program count and
compile time stay within the test budget; `jaxserve preflight` compiles them whole,
benchmarks/README.md). Small step budgets (8 sequences and 64 tokens; 2 and 16 at
real sizes) keep each engine at 9-15 programs while every kind of program is there:
forward and sampling buckets (the structured-output bitmask is a sampling input), speculative
verification rows and the draft model's programs, int8 weights, int8/fp8 KV pages,
MoE, tensor parallelism over the target's devices, multi-LoRA (its slot write).
"""

import json
import re

import jax
import pytest

from jaxserve.config import ModelConfig, engine_config
from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.preflight import program_cost
from jaxserve.runner.input_batch import WARM_BRANCHES
from jaxserve.targets import Target

SMALL = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
REAL = {
    "llama3_8b": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "qwen25_7b": dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
    "gemma2_9b": dict(
        architectures=["Gemma2ForCausalLM"],
        vocab_size=256000,
        hidden_size=3584,
        intermediate_size=14336,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        max_position_embeddings=8192,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "mixtral_8x7b": dict(
        architectures=["MixtralForCausalLM"],
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
}
# A hybrid KV cache (Gemma 3's layout: local layers of window 128, then a global one):
# two layer groups, each with its page table and its own KV page count.
HYBRID = dict(
    architectures=["Gemma3ForCausalLM"],
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=1024,
    sliding_window=128,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
)
# DeepSeek-V3's attention at its real width (multi-head latent attention: the cache's
# one KV head is kv_lora_rank + qk_rope_head_dim = 576 lanes, its V row [latent, 0]),
# the rest small: q_lora_rank, grouped routing over 8 experts, the first layer dense.
MLA = dict(
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=512,
    q_lora_rank=96,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=1024,
)
STEP = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, block_size=16)
# Real sizes: the same kinds of programs, fewer buckets (each compiles for seconds).
REAL_STEP = dict(max_num_seqs=2, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """name -> a directory holding only config.json (2 layers of the real ones)."""
    dirs = {}
    for name, hf in [("small", SMALL), ("hybrid", HYBRID), ("mla", MLA), *REAL.items()]:
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, **hf}))
        dirs[name] = str(path)
    return dirs


def build(model_dir: str, target: str, **args) -> LLMEngine:
    spec = args.get("speculative_config")
    if spec and spec.get("model") == "self":  # the draft: the same small model
        args["speculative_config"] = {**spec, "model": model_dir}
    kw = {"dtype": "bfloat16", "kv_cache_memory_fraction": 0.5, **STEP, **args}
    config = engine_config(model_dir, ModelConfig.from_pretrained(model_dir), **kw)
    return LLMEngine(config, target=Target.parse(target))


def expected_programs(engine: LLMEngine) -> int:
    runner = engine.runner
    # Sampling per row bucket: a plain and a full batch's program, or on a GPU (where
    # the host decides the branches) each of WARM_BRANCHES'.
    kinds = sum(map(len, WARM_BRANCHES.values())) if runner.host_branches else 2
    count = 2 * len(runner.token_buckets) + kinds * len(runner.row_buckets)
    if engine.drafter is not None:  # a forward per token bucket and the proposer
        count += len(runner.token_buckets) + 1
    if runner.lora is not None:  # a forward with the adapters per token bucket, the slot write
        count += len(runner.token_buckets) + 1
    return count + len(runner.copy_buckets) + 1  # copy-on-write's page copies, table writes


def check(engine: LLMEngine, target: str) -> None:
    programs = engine.compiled
    assert len(programs) == expected_programs(engine), sorted(programs)
    chip = Target.parse(target).chip
    assert engine.runner.compile_device.device_kind == chip.device_kind
    for name, compiled in programs.items():
        flops, bytes_accessed = program_cost(compiled)
        assert bytes_accessed > 0, name
        if name.startswith("forward"):
            assert flops > 0, name
    # On a GPU a conditional waits on the host for its predicate: no step program has
    # one (sampling's branches are the host's there).
    assert engine.runner.host_branches == (chip.platform != "tpu")
    if chip.platform != "tpu":
        for name, compiled in programs.items():
            assert "conditional(" not in compiled.as_text(), name
    # No program sorts the vocabulary for top-k or top-p, nor on a TPU for the top
    # logprobs (XLA:TPU took 3-21 s to compile each such sort; a GPU's lax.top_k is a
    # sort that compiles in about a second). (A TPU's scatters sort their indices.)
    vocab = engine.runner.config.model.vocab_size
    for name, compiled in programs.items():
        plain = name.startswith("sample B=") and "logprobs" not in name
        if plain or (chip.platform == "tpu" and name.startswith(("sample", "prompt logp"))):
            sorts = re.findall(r"^.* sort\(", compiled.as_text(), re.MULTILINE)
            assert not [s for s in sorts if re.search(rf"\[[\d,]*,{vocab}\]", s)], name
    kernel = "tpu_custom_call" if chip.platform == "tpu" else "__gpu$xla.gpu.triton"
    forward = programs["forward T=1"].as_text()
    assert kernel in forward  # the Pallas kernels, not the reference
    # The kept page tables are written in place: not reshaped, copied or transposed in
    # device memory (a TPU's tiled layout made a flattened scatter copy the whole table
    # each step). A copy into another memory space (`S(1)`: a TPU core's VMEM, where
    # XLA stages a table as small as these for the fusion that reads it) is that read,
    # not a second table in device memory.
    table = "s32[" + ",".join(map(str, engine.runner.page_table.shape)) + "]"
    layouts = re.findall(
        rf"{re.escape(table)}(\{{[^}}]*\}})? (?:reshape|copy|transpose)\(", forward
    )
    assert all("S(" in layout for layout in layouts), layouts
    if engine.runner.lora is not None:  # XLA's ragged dot, not the CPU's formulation
        text = programs["forward T=64 lora"].as_text()
        assert "lora_ragged" in text and "lora_dense" not in text
        assert "lora_ragged" not in programs["forward T=64"].as_text()  # no adapter: none


SMALL_CASES = [
    # (target, engine arguments)
    ("v5e", {}),
    ("v6e", {}),
    ("h100", {}),
    ("a100", {}),
    ("v5e", dict(quantization="int8", kv_cache_dtype="int8")),
    ("h100", dict(quantization="int8", kv_cache_dtype="fp8_e4m3")),
    ("v6e", dict(kv_cache_dtype="fp8_e5m2", dtype="float32")),
    ("a100", dict(kv_cache_dtype="int8", dtype="float32")),
    (
        "v5e",
        dict(
            speculative_config={
                "method": "draft_model",
                "model": "self",
                "num_speculative_tokens": 3,
            }
        ),
    ),
    (
        "h100",
        dict(
            speculative_config={"method": "ngram", "num_speculative_tokens": 4}, quantization="int8"
        ),
    ),
    ("v5e-4", dict(tensor_parallel_size=4)),
    ("v6e-8", dict(tensor_parallel_size=8, kv_cache_dtype="int8")),
    ("h100x4", dict(tensor_parallel_size=4, quantization="int8")),
    # Multi-LoRA: the projections' ragged_dot over token rows grouped by slot.
    ("v5e", dict(enable_lora=True, max_loras=4, max_lora_rank=16)),
    ("h100", dict(enable_lora=True, max_loras=4, quantization="int8")),
    ("v6e-4", dict(enable_lora=True, tensor_parallel_size=4)),
    ("h100x4", dict(enable_lora=True, tensor_parallel_size=4, max_lora_rank=32)),
]


@pytest.mark.parametrize(
    "target,args", SMALL_CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(SMALL_CASES)]
)
def test_small_model_warmup_compiles_for_the_target(model_dirs, target, args):
    engine = build(model_dirs["small"], target, **args)
    check(engine, target)


HYBRID_CASES = [
    ("v5e", {}),
    ("v6e-4", dict(tensor_parallel_size=4)),
    ("h100", dict(kv_cache_dtype="int8")),
]


@pytest.mark.parametrize(
    "target,args", HYBRID_CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(HYBRID_CASES)]
)
def test_hybrid_kv_warmup_compiles_for_the_target(model_dirs, target, args):
    engine = build(model_dirs["hybrid"], target, **args)
    runner = engine.runner
    windows = [g.window for g in runner.kv_groups]
    assert windows == [None, 128] and runner.layer_group == (1, 1, 0)
    # The windowed group's layers have fewer pages than the global one's.
    full, local = runner.group_pages
    assert local < full
    pages = [jax.tree.leaves(c)[0].shape[0] for c in runner.kv_caches]
    assert pages == [local, local, full]
    check(engine, target)


MLA_CASES = [
    ("v5e", {}),
    ("v6e", dict(kv_cache_dtype="int8")),
    ("h100", dict(kv_cache_dtype="fp8_e4m3")),
    ("a100", {}),
    ("v5e-4", dict(tensor_parallel_size=4)),
    ("h100x4", dict(tensor_parallel_size=4)),
]


@pytest.mark.parametrize(
    "target,args", MLA_CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(MLA_CASES)]
)
def test_latent_attention_warmup_compiles_for_the_target(model_dirs, target, args):
    """DeepSeek's absorbed attention: every head reads the one 576-lane KV head."""
    engine = build(model_dirs["mla"], target, **args)
    spec, layout = engine.runner.config.model, engine.runner.cache_layout
    assert (spec.num_kv_heads, spec.head_dim) == (1, 576)
    # One row a token, its key and its value: 576 values (640 lanes on a TPU), not 1,152.
    assert layout.shared_kv and layout.rows == 1
    assert layout.page_bytes(1, False) == 16 * (640 if target.startswith("v") else 576)
    check(engine, target)


REAL_CASES = [
    ("llama3_8b", "v6e-4", dict(tensor_parallel_size=4)),
    ("llama3_8b", "a100", {}),
    ("qwen25_7b", "h100", dict(quantization="int8")),
    ("qwen25_7b", "v5e-8", dict(tensor_parallel_size=8, kv_cache_dtype="int8")),
    ("gemma2_9b", "v5e-4", dict(tensor_parallel_size=4)),
    ("gemma2_9b", "h100", dict(kv_cache_dtype="fp8_e4m3")),
    ("mixtral_8x7b", "h100x8", dict(tensor_parallel_size=8)),
    ("mixtral_8x7b", "v6e-8", dict(tensor_parallel_size=8, quantization="int8")),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,target,args", REAL_CASES, ids=[f"{m}-{t}" for m, t, _ in REAL_CASES]
)
def test_real_size_warmup_compiles_for_the_target(model_dirs, model, target, args):
    engine = build(model_dirs[model], target, **REAL_STEP, **args)
    check(engine, target)


def test_a_compile_only_engine_runs_no_request(model_dirs):
    from jaxserve.sampling_params import SamplingParams

    engine = build(model_dirs["small"], "h100", max_num_batched_tokens=16, max_num_seqs=2)
    with pytest.raises(RuntimeError, match="compile for a target that is not here"):
        engine.add_request(GenerateRequest("a", [1, 2, 3], SamplingParams(max_tokens=2)))


def test_a_model_that_does_not_fit_the_chip_is_refused_naming_what(model_dirs, tmp_path):
    whole = tmp_path / "llama3_8b_whole"  # all 32 layers: ~8.0e9 parameters
    whole.mkdir()
    (whole / "config.json").write_text(json.dumps({"num_hidden_layers": 32, **REAL["llama3_8b"]}))
    with pytest.raises(
        ValueError, match=r"the weights need 29\.92 GiB per device and a v5e has 16"
    ):
        build(str(whole), "v5e", dtype="float32")
    # bfloat16: the weights fit (14.96 GiB), a KV cache in 90% of the chip does not.
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction=0\.9 .* holds 0 pages"):
        build(str(whole), "v5e", kv_cache_memory_fraction=0.9)


def test_preflight_cli_presets_are_the_config_files():
    import pathlib
    import tomllib

    from jaxserve.targets import DEVICE_PRESETS

    configs = pathlib.Path(__file__).resolve().parents[2] / "configs"
    for platform, name in (("tpu", "tpu"), ("cuda", "gpu")):
        assert DEVICE_PRESETS[platform] == tomllib.loads((configs / f"{name}.toml").read_text())


def test_preflight_reports_the_engines_figures(model_dirs):
    from jaxserve.preflight import preflight

    args = {"dtype": "bfloat16", "kv_cache_memory_fraction": 0.5, **STEP}
    path = model_dirs["small"]
    config = engine_config(path, ModelConfig.from_pretrained(path), **args)
    report = preflight(config, Target.parse("h100"), decode_batches=(1, 8, 64))
    # h100: JAX's 75% of 79.1 GiB; half of it for weights and KV.
    assert report.hbm_bytes == int(84_942_979_072 * 0.75)
    assert report.kv_pages == config.num_kv_pages((report.hbm_bytes, report.weight_bytes))
    assert [d.batch for d in report.decode] == [1, 8]  # 64 > max_num_seqs
    for d in report.decode:
        assert d.programs[:2] == (f"forward T={d.batch}", f"sample B={d.batch}")
        assert d.bytes_accessed == sum(d.parts) and d.min_bytes > report.weight_bytes * 0.9
        assert d.bytes_ratio >= 1.0  # a compiled step moves at least the minimum
    assert not any(report.kv_copies.values())
    text = report.format()
    assert f"--num_kv_pages={report.kv_pages}" in text and "GB by program" in text
    # the count it advises is the one it reports (it said N - 1 pages, then N)
    assert f"KV cache: {report.kv_pages} pages (num_kv_pages: " in text
    with pytest.raises(ValueError, match="tensor_parallel_size must be 4, got 1"):
        preflight(config, Target.parse("h100x4"))


def test_preflight_counts_the_draft_model(model_dirs):
    # The draft's weights once took no room in the KV pool's sizing (it was loaded
    # after the pool) nor in the report, and its proposals no part of a decode step.
    from jaxserve.preflight import preflight

    path = model_dirs["small"]
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    args = {"dtype": "bfloat16", "kv_cache_memory_fraction": 0.5, **STEP}
    config = engine_config(path, ModelConfig.from_pretrained(path), **args)
    plain = preflight(config, Target.parse("h100"), decode_batches=(2,))
    config = engine_config(path, ModelConfig.from_pretrained(path), speculative_config=spec, **args)
    report = preflight(config, Target.parse("h100"), decode_batches=(2,))
    assert report.draft_weight_bytes == plain.weight_bytes  # the same model as draft
    assert report.weight_bytes == 2 * plain.weight_bytes
    assert report.kv_pages == config.num_kv_pages((report.hbm_bytes, report.weight_bytes))
    (d,) = report.decode
    assert d.programs == (
        "forward T=8",  # 2 x (1 + 3) rows
        "sample B=8",
        "attention kernels",
        "draft propose k=3",
        "draft attention kernels",
    )
    # The target's weights once, the draft's once for each of its 3 steps.
    assert d.min_bytes > 4 * plain.weight_bytes * 0.9
    assert d.bytes_ratio >= 1.0
    assert "(draft " in report.format()


def test_kv_sized_copies_finds_a_whole_cache_copy():
    from jaxserve.preflight import kv_sized_copies

    hlo = (
        "%copy.12 = f32[2049,16,4,64]{3,2,1,0:T(4,128)} copy(%kv_caches_0_.1)\n"
        "%copy.13 = f32[16,4,64]{2,1,0} copy(%p)\n"
        "%t = bf16[64,4,16,2049]{3,2,1,0} transpose(%x), dimensions={3,2,1,0}\n"
    )
    found = kv_sized_copies(hlo, [(2049, 16, 4, 64)])
    assert len(found) == 2 and "copy.12" in found[0] and "transpose" in found[1]
