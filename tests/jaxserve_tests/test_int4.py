"""4-bit weights (`quantization="int4"`, `models.int4.Int4Linear`): the layer against
a float layer of its dequantized codes, the engine against a float engine serving the
dequantized int4 weights, LoRA adapters over int4 weights as PEFT's over the
dequantized ones, `jaxserve convert --quantization=int4` and back, the weight bytes,
and the refusals (groups that do not divide a linear, a tensor-parallel split inside a
group)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from engine_utils import SMALL_LLM, engine_config, prompt_logits
from fake_devices import run_on_8_devices
from flax import nnx
from lora_utils import base_model, check_adapter_over_quantized

from jaxserve import LLM, SamplingParams
from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.checkpoint import convert, load_model, save_weights
from jaxserve.config import ModelConfig
from jaxserve.distributed import meshes
from jaxserve.runner.model_runner import ModelRunner
from models.int4 import Int4Linear, int4_dot_dequantized, int4_dot_grouped, int4_group_size
from models.layers import (
    QuantizedEmbed,
    QuantizedLinear,
    linear,
    lm_head_logits,
    without_cpu_kernels,
)
from models.moe import Int4Experts
from models.quantize import quantize_weights

DEMO = EMBEDDED_MODELS["demo-model"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(n: int = 4, seed: int = 0, vocab: int = 320) -> list[dict]:
    rs = np.random.RandomState(seed)
    return [{"prompt_token_ids": rs.randint(3, vocab, size=5 + 7 * i).tolist()} for i in range(n)]


def tokens(llm: LLM, requests: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY, use_tqdm=False)]


# ----------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------


def reference_weights(codes, scale, zero) -> np.ndarray:
    """(codes - zero) * scale [N, K] in float64, each group's values repeated over it
    (`zero`: [N, K / G], a number, or None for 0)."""
    group = codes.shape[1] // scale.shape[1]
    zero = np.broadcast_to(0 if zero is None else zero, scale.shape)
    codes = np.asarray(codes, np.float64)
    return (codes - np.repeat(zero, group, axis=1)) * np.repeat(scale, group, axis=1)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("unsigned", [False, True], ids=["int4", "uint8"])
def test_layer_equals_a_float_layer_of_its_dequantized_codes(group, asym, unsigned):
    """Given codes, scales, zero points and a bias (signed int4 codes, or the formats'
    unsigned [0, 15] in uint8), the layer computes what a float Linear whose kernel is
    (codes - zero) * scale computes (XLA's products: the CPU kernel's, which takes x in
    16-bit fixed point, are checked in test_cpu_matmul)."""
    rs = np.random.RandomState(group + 2 * asym + unsigned)
    n, k, t = 48, 256, 5
    low, high = (0, 16) if unsigned else (-8, 8)
    codes = rs.randint(low, high, size=(n, k))
    scale = rs.uniform(0.001, 0.02, size=(n, k // group)).astype(np.float32)
    zero = rs.randint(low, high, size=scale.shape) if asym else None
    bias = rs.normal(size=n).astype(np.float32)
    layer = Int4Linear(
        jnp.asarray(codes, jnp.uint8 if unsigned else jnp.int4),
        jnp.asarray(scale),
        None if zero is None else jnp.asarray(zero, jnp.uint8 if unsigned else jnp.int8),
        jnp.asarray(bias),
        axes=("mlp", "embed"),
    )
    without_cpu_kernels(layer)
    assert layer.kernel.dtype == jnp.int4 and layer.group_size == group
    shift = 8 if unsigned else 0  # unsigned codes without zeros are centred at 8
    w = reference_weights(codes, scale, shift if zero is None else zero)
    dense = linear(k, n, ("embed", "mlp"), bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dense.kernel[...] = jnp.asarray(w.T, jnp.float32)
    dense.bias[...] = jnp.asarray(bias)
    x = jnp.asarray(rs.normal(size=(t, k)), jnp.float32)
    want = np.asarray(x, np.float64) @ w.T + bias
    np.testing.assert_allclose(layer(x), dense(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer(x), want, rtol=1e-4, atol=1e-4)
    # Leading axes as the projections are called ([..., K]), and as an LM head (no bias).
    np.testing.assert_allclose(layer(x[None])[0], layer(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lm_head_logits(x, layer), want - bias, rtol=1e-4, atol=1e-4)
    # Both formulations of the product (the CPU takes the dequantized one; GPU and TPU
    # the grouped one for few rows), the grouped one padded as on a TPU too.
    args = (layer.kernel[...], layer.scale[...], None if zero is None else layer.zero[...])
    for got in (
        int4_dot_dequantized(x, *args),
        int4_dot_grouped(x, *args),
        int4_dot_grouped(x[:1], *args, min_rows=2),
    ):
        np.testing.assert_allclose(got, (want - bias)[: got.shape[0]], rtol=1e-4, atol=1e-4)


def test_bfloat16_layer_dequantizes_in_bfloat16():
    """In bfloat16 the weights are (codes - zero) * scale rounded once to bfloat16 (small
    integers are exact there), the dot accumulating in float32."""
    rs = np.random.RandomState(1)
    codes = rs.randint(-8, 8, size=(32, 128))
    scale = rs.uniform(0.01, 0.1, size=(32, 2)).astype(np.float32)
    zero = rs.randint(-8, 8, size=(32, 2))
    layer = Int4Linear(
        jnp.asarray(codes, jnp.int4),
        jnp.asarray(scale, jnp.bfloat16),
        jnp.asarray(zero, jnp.int8),
    )
    without_cpu_kernels(layer)
    w = jnp.asarray(reference_weights(codes, np.asarray(jnp.asarray(scale, jnp.bfloat16)), zero))
    w = w.astype(jnp.bfloat16).astype(jnp.float32)
    x = jnp.asarray(rs.normal(size=(3, 128)), jnp.bfloat16)
    want = x.astype(jnp.float32) @ w.T
    assert layer(x).dtype == jnp.bfloat16
    np.testing.assert_allclose(layer.product(x), want, rtol=1e-5, atol=1e-5)


def test_from_linear_quantizes_symmetrically_per_group_within_half_a_step():
    layer = linear(256, 40, ("embed", "mlp"), bias=False, dtype=jnp.float32, rngs=nnx.Rngs(3))
    q = Int4Linear.from_linear(layer)
    assert q.zero is None and q.group_size == 128 and q.scale.shape == (40, 2)
    assert q.kernel.get_metadata()["out_sharding"] == ("mlp", "embed")
    assert q.scale.get_metadata()["out_sharding"] == ("mlp", "embed")  # groups split as inputs
    codes = np.asarray(q.kernel[...]).astype(np.int8)
    assert codes.min() >= -7 and codes.max() <= 7 and {-7, 7} <= set(codes.ravel())
    w = np.asarray(layer.kernel[...]).T
    err = np.abs(reference_weights(codes, np.asarray(q.scale[...]), None) - w)
    step = np.repeat(np.asarray(q.scale[...]), 128, axis=1)
    assert (err <= step / 2 + 1e-7).all()


@pytest.mark.parametrize(
    "d_in,group", [(256, 128), (4864, 128), (96, 96), (64, 64), (2880, 120), (16, 16)]
)
def test_group_size_is_128_or_the_largest_divisor_under_it(d_in, group):
    assert int4_group_size(d_in) == group


def test_a_linear_without_a_group_divisor_is_refused_naming_its_path_and_size():
    class Block(nnx.Module):
        def __init__(self):
            self.up = linear(
                64, 32, ("embed", "mlp"), bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0)
            )
            self.odd = linear(
                262, 8, ("mlp", "embed"), bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0)
            )

    with pytest.raises(ValueError, match=r"odd: int4 quantizes groups of 128 inputs; 262 inputs"):
        quantize_weights(Block(), "int4")


@pytest.mark.parametrize(
    "scale_shape,zero_shape,match",
    [
        ((8, 3), None, r"int4 scales \(8, 3\) do not fit codes \(8, 64\)"),
        ((4, 2), None, r"int4 scales \(4, 2\) do not fit"),
        ((8, 2), (8, 4), r"int4 zero points \(8, 4\) differ from the scales' \(8, 2\)"),
    ],
)
def test_arrays_that_do_not_fit_are_refused_naming_their_shapes(scale_shape, zero_shape, match):
    codes = jnp.zeros((8, 64), jnp.int4)
    zero = None if zero_shape is None else jnp.zeros(zero_shape, jnp.int8)
    with pytest.raises(ValueError, match=match):
        Int4Linear(codes, jnp.ones(scale_shape, jnp.float32), zero)
    with pytest.raises(ValueError, match="int4 scales must be floating point"):
        Int4Linear(codes, jnp.ones((8, 2), jnp.int8))


# ----------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------


def dequantized_model_dir(model_dir: str, out: str) -> dict:
    """A float copy of `model_dir` whose weights are its int4 engine's, dequantized: the
    projections (codes * scale), an MoE layer's experts (the same), the embedding and
    LM head (int8 rows * scale). Returns how many of each quantized layer it found."""
    config = ModelConfig.from_pretrained(model_dir)
    quantized = load_model(model_dir, config, quantization="int4")
    model = load_model(model_dir, config)
    counts = {Int4Linear: 0, QuantizedLinear: 0, QuantizedEmbed: 0, Int4Experts: 0}
    modules = dict(nnx.iter_modules(model))
    for path, q in nnx.iter_modules(quantized):
        if type(q) in counts:
            counts[type(q)] += 1
        if isinstance(q, Int4Experts):
            for name, stack in zip(q.names, q.matrices(), strict=True):
                getattr(modules[path], name)[...] = stack.dequantize().astype(jnp.float32)
        elif isinstance(q, Int4Linear):
            w = reference_weights(np.asarray(q.kernel[...]), np.asarray(q.scale[...]), None)
            modules[path].kernel[...] = jnp.asarray(w.T, jnp.float32)
        elif isinstance(q, QuantizedLinear):  # the untied LM head
            w = np.asarray(q.kernel[...], np.float32) * np.asarray(q.scale[...])[:, None]
            modules[path].kernel[...] = jnp.asarray(w.T)
        elif isinstance(q, QuantizedEmbed):
            w = np.asarray(q.embedding[...], np.float32) * np.asarray(q.scale[...])[:, None]
            modules[path].embedding[...] = jnp.asarray(w)
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_weights(model, out)
    return counts


def logits_as_dequantized(model_dir: str, dense_dir: str, ids: list[int]) -> np.ndarray:
    """The int4 model's prompt logits for `ids` (on pages 1-7), checked within
    1e-4 of the float model's of its dequantized weights (`dense_dir`), both without
    the CPU kernels; returns them."""
    runners = [
        ModelRunner(engine_config(d, native_cpu_kernels=False, **q))
        for d, q in ((model_dir, dict(quantization="int4")), (dense_dir, {}))
    ]
    got, ref = (prompt_logits(r, ids, list(range(1, 8))) for r in runners)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    return got


@pytest.fixture(scope="module")
def dequantized_dir(tiny_model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("int4") / "float")
    counts = dequantized_model_dir(tiny_model_dir, out)
    layers = ModelConfig.from_pretrained(tiny_model_dir).num_layers
    assert counts == {
        Int4Linear: 7 * layers, QuantizedLinear: 1, QuantizedEmbed: 1, Int4Experts: 0
    }, counts  # fmt: skip
    return out


def test_int4_engine_equals_a_float_engine_of_its_dequantized_weights(
    tiny_model_dir, dequantized_dir
):
    """Greedy tokens (prefix caching and chunked prefill included) equal those of a
    float32 engine serving the dequantized weights, and the logits agree closely. The
    CPU's int8 few-row kernel (the LM head's) is off on both sides: it multiplies in
    16-bit fixed point, which would move near-tied logits."""
    kw = dict(native_cpu_kernels=False, max_num_batched_tokens=16)
    int4 = LLM(tiny_model_dir, **{**SMALL_LLM, **kw}, quantization="int4")
    dense = LLM(dequantized_dir, **{**SMALL_LLM, **kw})
    assert int4.config.quantization == "int4"
    requests = prompts()
    want = tokens(dense, requests)
    assert tokens(int4, requests) == want
    assert tokens(int4, requests) == want  # again: the prompts' pages from the cache
    int4.engine.pool.check_invariant()
    ids = requests[-1]["prompt_token_ids"]
    got = logits_as_dequantized(tiny_model_dir, dequantized_dir, ids)
    # ... and differ from the float model's, which the int4 rounding moved.
    plain = prompt_logits(ModelRunner(engine_config(tiny_model_dir)), ids, list(range(1, 8)))
    assert np.abs(plain - got).max() > 1e-3


@pytest.mark.parametrize("case", ["mixtral_top2_of_8", "qwen2_moe_shared_expert"])
def test_int4_moe_engine_equals_a_float_engine_of_its_dequantized_weights(
    case, hf_model_dir, tmp_path
):
    """An MoE model's experts are 4-bit too (`Int4Experts`; the routers stay float):
    greedy tokens and logits as a float engine serving the dequantized weights."""
    path, _ = hf_model_dir(case)
    dense_dir = str(tmp_path / "float")
    assert dequantized_model_dir(path, dense_dir)[Int4Experts] > 0
    kw = dict(native_cpu_kernels=False, max_num_batched_tokens=16)
    int4 = LLM(path, **{**SMALL_LLM, **kw}, quantization="int4", skip_tokenizer_init=True)
    dense = LLM(dense_dir, **{**SMALL_LLM, **kw}, skip_tokenizer_init=True)
    requests = prompts(vocab=ModelConfig.from_pretrained(path).vocab_size)
    assert tokens(int4, requests) == tokens(dense, requests)
    logits_as_dequantized(path, dense_dir, requests[-1]["prompt_token_ids"])


def test_int4_with_the_cpu_kernels_generates_and_stays_close(tiny_model_dir, dequantized_dir):
    """With the CPU kernels (the int8 LM head's few-row product), the first tokens still
    follow the dequantized float model's."""
    int4 = LLM(tiny_model_dir, **SMALL_LLM, quantization="int4")
    dense = LLM(dequantized_dir, **SMALL_LLM)
    requests = prompts(seed=1)
    got, want = tokens(int4, requests), tokens(dense, requests)
    assert all(len(g) == GREEDY.max_tokens for g in got)
    assert [g[:4] for g in got] == [w[:4] for w in want]


def test_linear_weights_take_about_an_eighth_of_float32():
    """The projections: half a byte a weight plus a float32 scale per 128 (an eighth of
    float32 and 3%); the whole demo model (its int8 embedding included) under a
    fifth. `meshes.total_bytes` (the start-up log, model info, KV sizing on a target)
    counts int4 as half a byte."""
    config = ModelConfig.from_pretrained(DEMO)
    dense = load_model(DEMO, config)
    int4 = load_model(DEMO, config, quantization="int4")

    def linear_bytes(model, kind):
        return sum(
            meshes.total_bytes(nnx.state(m))
            for _, m in nnx.iter_modules(model)
            if isinstance(m, kind) and m is not getattr(model, "lm_head", None)
        )

    f32, q4 = linear_bytes(dense, nnx.Linear), linear_bytes(int4, Int4Linear)
    assert q4 / f32 == pytest.approx((0.5 + 4 / 128) / 4)
    whole = meshes.total_bytes(nnx.state(int4)) / meshes.total_bytes(nnx.state(dense))
    assert 0.125 < whole < 0.2
    llm = LLM(DEMO, warmup=False, quantization="int4", max_num_seqs=4)
    assert llm.engine.model_info().weight_bytes == meshes.total_bytes(nnx.state(int4))


# ----------------------------------------------------------------------------
# jaxserve convert --quantization=int4
# ----------------------------------------------------------------------------


def test_convert_stores_int4_and_reloads_it(tiny_model_dir, tmp_path):
    out = convert(tiny_model_dir, str(tmp_path / "int4"), quantization="int4")
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {"quant_method": "jaxserve_int4", "group_size": 128}
    with open(os.path.join(out, "jaxserve_checkpoint.json")) as f:
        marker = json.load(f)
    stored = ocp.PyTreeCheckpointer().metadata(os.path.join(out, "orbax")).item_metadata.tree
    q_proj = "model.layers.0.self_attn.q_proj"
    assert stored[f"{q_proj}.kernel"].dtype == jnp.int4
    assert tuple(stored[f"{q_proj}.scale"].shape) == (64, 1)  # 64 inputs: one group
    assert stored["model.embed_tokens.embedding"].dtype == jnp.int8
    assert marker["quantization"] == "int4"
    config = ModelConfig.from_pretrained(out)
    assert config.quantization == "int4"
    restored = load_model(out, config)
    float_config = ModelConfig.from_pretrained(tiny_model_dir)
    loaded = load_model(tiny_model_dir, float_config, quantization="int4")
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(restored)),
        jax.tree_util.tree_leaves_with_path(nnx.state(loaded)),
        strict=True,
    ):
        assert a.dtype == b.dtype and bool((a == b).all()), jax.tree_util.keystr(path)
    assert marker["bytes"] == meshes.total_bytes(nnx.state(restored))
    requests = prompts(2)
    kw = dict(SMALL_LLM, native_cpu_kernels=False)
    want = tokens(LLM(tiny_model_dir, **kw, quantization="int4"), requests)
    llm = LLM(out, **kw)
    assert llm.config.quantization == "int4" and tokens(llm, requests) == want
    with pytest.raises(ValueError, match="stores its weights quantized as 'int4'"):
        LLM(out, **kw, quantization="int8")


def test_convert_stores_int4_moe_experts_and_reloads_them(hf_model_dir, tmp_path):
    """A Mixtral's experts stored as int4 codes and group scales; reloaded, every array
    equals the on-the-fly int4 model's and the engine serves the same tokens."""
    path, _ = hf_model_dir("mixtral_top2_of_8")
    out = convert(path, str(tmp_path / "int4"), quantization="int4")
    stored = ocp.PyTreeCheckpointer().metadata(os.path.join(out, "orbax")).item_metadata.tree
    experts = "model.layers.0.block_sparse_moe.experts"
    assert stored[f"{experts}.w1"].dtype == jnp.int4
    assert tuple(stored[f"{experts}.w2_scale"].shape) == (8, 1, 64)  # 40 inputs: one group
    restored = load_model(out, ModelConfig.from_pretrained(out))
    loaded = load_model(path, ModelConfig.from_pretrained(path), quantization="int4")
    for (p, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(restored)),
        jax.tree_util.tree_leaves_with_path(nnx.state(loaded)),
        strict=True,
    ):
        assert a.dtype == b.dtype and bool((a == b).all()), jax.tree_util.keystr(p)
    requests = prompts(2, vocab=ModelConfig.from_pretrained(path).vocab_size)
    kw = dict(SMALL_LLM, native_cpu_kernels=False, skip_tokenizer_init=True)
    want = tokens(LLM(path, **kw, quantization="int4"), requests)
    assert tokens(LLM(out, **kw), requests) == want


# ----------------------------------------------------------------------------
# Refusals, and tensor parallelism
# ----------------------------------------------------------------------------


def test_a_tensor_parallel_split_inside_a_group_is_refused_naming_both(tiny_model_dir):
    """The tiny model's down_proj has 96 inputs, one group of 96: split 2 ways, each
    device would hold half a group. The demo model's down_proj (768 inputs, 6 groups
    of 128) splits over 2 devices, not 4."""
    match = (
        r"quantization='int4' with tensor_parallel_size=2: model\.layers\.0\.mlp\."
        r"down_proj splits its 96 inputs 2 ways, 48 a device, across its groups of 96 "
        r"inputs \(1 group\)"
    )
    with pytest.raises(ValueError, match=match):
        engine_config(tiny_model_dir, quantization="int4", tensor_parallel_size=2)
    engine_config(DEMO, quantization="int4", tensor_parallel_size=2)
    four_ways = r"down_proj splits its 768 inputs 4 ways, 192 a device, .* \(6 groups\).* divides 6"
    with pytest.raises(ValueError, match=four_ways):
        engine_config(DEMO, quantization="int4", tensor_parallel_size=4)
    engine_config(DEMO, quantization="int8", tensor_parallel_size=4)  # per channel: any split


def test_lora_adapters_over_int4_weights_serve_as_peft_over_the_dequantized_weights(
    tiny_model_dir, dequantized_dir, tmp_path
):
    """QLoRA-style serving of on-the-fly int4 weights (int8 embedding and LM head), the
    CPU's few-row kernels off on both sides as above."""
    base = base_model(dequantized_dir)
    ids = [[5, 17, 99, 3, 42, 8], [11, 60, 7, 21, 30, 2, 64, 90, 13, 1, 77]]
    check_adapter_over_quantized(
        tiny_model_dir, base, ids, 8, tmp_path, "int4", quantization="int4",
        native_cpu_kernels=False,
    )  # fmt: skip


@pytest.mark.sharded
@pytest.mark.slow
def test_tensor_parallel_int4_engine_equals_one_device():
    stdout = run_on_8_devices("int4_tp_check.py", DEMO)
    assert "int4 tp=2: greedy tokens equal one device's" in stdout, stdout


@pytest.mark.parametrize(
    "target,args",
    [
        ("h100", {}),
        ("a100", {}),
        ("v5e", {}),
        ("v6e", {}),
        ("h100x2", dict(tensor_parallel_size=2)),
        ("a100", dict(enable_lora=True, max_loras=2, max_lora_rank=8)),
        ("v5e", dict(enable_lora=True, max_loras=2, max_lora_rank=8)),
    ],
    ids=["h100", "a100", "v5e", "v6e", "h100x2", "a100-lora", "v5e-lora"],
)
def test_int4_steps_compile_for_a_gpu_and_a_tpu(tmp_path, target, args):
    """Every warm-up program of a small int4 engine (with LoRA adapters too) compiles
    for the target (Triton and XLA:GPU, Mosaic and XLA:TPU), the weights still int4
    (s4) in the compiled decode step: they reach the device packed. On the GPU the
    decode step reads fewer bytes than bfloat16's (the grouped product: the codes go
    into the matmuls as they are)."""
    from test_device_compile import SMALL, build, check

    from jaxserve.preflight import program_cost

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, **SMALL}))
    engine = build(str(tmp_path), target, quantization="int4", **args)
    check(engine, target)
    decode = engine.compiled["forward T=1"]
    assert "s4[" in decode.as_text()
    if target == "h100":
        bf16 = build(str(tmp_path), target).compiled["forward T=1"]
        assert program_cost(decode)[1] < 0.4 * program_cost(bf16)[1]  # measured 0.30


@pytest.mark.parametrize(
    "target,args", [("v5e", {}), ("h100x2", dict(tensor_parallel_size=2))], ids=["v5e", "h100x2"]
)
def test_int4_moe_steps_compile_for_a_gpu_and_a_tpu(tmp_path, target, args):
    """A small Mixtral's int4 warm-up programs (experts split over two H100s: expert
    parallelism) compile for the target, the experts' codes still s4 in the decode
    step."""
    from test_device_compile import SMALL, build, check

    config = dict(
        SMALL,
        architectures=["MixtralForCausalLM"],
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = build(str(tmp_path), target, quantization="int4", **args)
    check(engine, target)
    experts = f"s4[{8 // engine.config.parallel.tensor_parallel_size},256,512]"
    assert experts in engine.compiled["forward T=1"].as_text()
