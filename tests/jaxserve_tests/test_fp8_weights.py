"""fp8 weights (`models.fp8.Fp8Linear`): fp8 checkpoints as users download them, served
without a quantization argument -- a tiny random Llama and Qwen2 saved in each fp8
variant (Hugging Face's block-wise `weight_scale_inv` 128x128, its per-tensor scale,
fbgemm's per channel, compressed-tensors float8 per channel (W8A8 with dynamic
activations, as the package itself writes it) and per block) give the greedy tokens,
and first-step logprobs within 2e-2, of transformers running the dequantized weights;
on-the-fly `quantization="fp8"`; LoRA adapters over them as PEFT's over the
dequantized weights; the layer against a float layer of its dequantized weights; the
refusals (another quantization asked for, static activation scales, update_weights, a
tensor-parallel split through a scale block, MoE experts); and the
warm-up programs compiled deviceless for an H100 and a v5e, the weights still e4m3."""

import copy
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from engine_utils import SMALL_LLM, engine_config
from flax import nnx
from hf_models import BASE, check_like_reference, hf_greedy, tiny_causal_lms
from lora_utils import check_adapter_over_quantized
from safetensors.torch import save_file

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import convert, load_model
from jaxserve.config import ModelConfig
from jaxserve.distributed import meshes
from jaxserve.quantized.formats import dequantize, pack, read_quantization_config, unpack
from models.fp8 import (
    Fp8Linear,
    dequantize_fp8,
    fp8_dot_blocked,
    fp8_dot_dequantized,
    quantize_fp8,
)
from models.layers import linear, lm_head_logits

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
PROMPTS = [[5, 17, 99, 3, 42, 8], [11, 60, 7, 21, 30, 2, 64, 90, 13, 1, 77]]
MAX_TOKENS = 8
# hidden 128 and intermediate 256: whole 128x128 blocks, two block columns in down_proj;
# k_proj and v_proj (2 KV heads of 32: 64 outputs) cut their one block row, as
# checkpoints do where the blocks do not divide a dimension.
SHAPES = dict(BASE, hidden_size=128, intermediate_size=256, tie_word_embeddings=False)


def hf_fp8(block=None, scheme="dynamic"):
    qc = dict(quant_method="fp8", activation_scheme=scheme, fmt="e4m3")
    return qc | ({"weight_block_size": list(block)} if block else {})


def ct_fp8(strategy, block=None, dynamic=True):
    weights = dict(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False)
    weights |= {"block_structure": list(block)} if block else {}
    acts = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=dynamic)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return dict(
        quant_method="compressed-tensors",
        format="float-quantized",
        quantization_status="compressed",
        config_groups={"group_0": group},
        ignore=["lm_head"],
    )


FBGEMM = dict(quant_method="fbgemm_fp8", activation_scale_ub=1200.0)

# (case, architecture, quantization_config): each variant for both models.
CASES = [
    ("block128_llama", "LlamaForCausalLM", hf_fp8((128, 128))),
    ("block128_qwen2", "Qwen2ForCausalLM", hf_fp8((128, 128))),
    ("tensor_llama", "LlamaForCausalLM", hf_fp8()),
    ("tensor_qwen2", "Qwen2ForCausalLM", hf_fp8()),
    ("channel_llama", "LlamaForCausalLM", FBGEMM),
    ("channel_qwen2", "Qwen2ForCausalLM", FBGEMM),
    ("ct_block_llama", "LlamaForCausalLM", ct_fp8("block", (128, 128))),
    ("ct_tensor_qwen2", "Qwen2ForCausalLM", ct_fp8("tensor")),
]
# Written by the compressed-tensors package itself: (case, architecture, preset scheme).
CT_CASES = [
    ("ctpkg_fp8_dynamic_qwen2", "Qwen2ForCausalLM", "FP8_DYNAMIC"),
    ("ctpkg_fp8_block_llama", "LlamaForCausalLM", "FP8_BLOCK"),
]
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == FP8:  # numpy has no fp8: the bytes, as torch's e4m3
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.fixture(scope="module")
def float_models():
    """Architecture -> a tiny random transformers model (float32, untied LM head)."""
    return tiny_causal_lms(("LlamaForCausalLM", "Qwen2ForCausalLM"), SHAPES)


def write_checkpoint(path, model, qc: dict) -> dict:
    """`model` with its decoder linears in `qc`'s fp8 storage (e4m3 weights, the scale
    tensor the format names), written to `path` as the formats' tools write it
    (safetensors F8_E4M3, config.json's quantization_config); returns the dequantized
    state dict (what transformers runs for reference)."""
    fmt = read_quantization_config({"quantization_config": qc})
    tensors, reference = {}, {}
    for name, t in model.state_dict().items():
        w = t.numpy()
        module = name.removesuffix(".weight")
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            packed = pack(w, fmt)
            tensors.update({f"{module}.{k}": to_torch(v) for k, v in packed.items()})
            w = dequantize(unpack(packed, fmt, *w.shape))
        else:
            tensors[name] = to_torch(w)
        reference[name] = torch.from_numpy(np.ascontiguousarray(w))
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return reference


def write_ct_checkpoint(path, model, scheme: str) -> dict:
    """`model` quantized and saved by compressed-tensors itself (its preset `scheme`,
    `calculate_qparams` per linear, ModelCompressor, save_pretrained); returns the
    state dict of its fake-quantized weights (the package's own dequantization)."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from test_quantized_formats import ct_qparams

    reference = {k: v.clone() for k, v in model.state_dict().items()}
    model = copy.deepcopy(model)
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[scheme])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            args = module.quantization_scheme.weights
            scale, zero = ct_qparams(module.weight.data, args)
            module.weight_scale.data = scale.reshape(module.weight_scale.shape)
            reference[f"{name}.weight"] = fake_quantize(module.weight.data, scale, zero, args)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return reference


@pytest.fixture(scope="module")
def checkpoints(float_models, tmp_path_factory):
    """Case -> (directory, the transformers reference per prompt), written once."""
    out = {}
    for case, arch, qc in CASES + CT_CASES:
        model = float_models[arch]
        path = tmp_path_factory.mktemp(case)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        if isinstance(qc, str):
            reference = write_ct_checkpoint(path, model, qc)
        else:
            reference = write_checkpoint(path, model, qc)
        out[case] = (str(path), [hf_greedy(model, reference, p, MAX_TOKENS) for p in PROMPTS])
        model.load_state_dict(saved)
    return out


def check_served(llm: LLM, want, case: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    check_like_reference(outs, want, case)


# ----------------------------------------------------------------------------
# Checkpoints served as transformers serves their dequantized weights
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c[0] for c in CASES + CT_CASES])
def test_served_like_dequantized_weights(case, checkpoints):
    path, want = checkpoints[case]
    llm = LLM(model=path, skip_tokenizer_init=True, **SMALL_LLM)
    check_served(llm, want, case)
    llm.close()


@pytest.mark.parametrize(
    "case, block",
    [
        ("block128_qwen2", {"q_proj": (128, 128), "down_proj": (128, 128)}),
        ("tensor_llama", {"q_proj": (128, 128), "down_proj": (128, 256)}),
        ("channel_qwen2", {"q_proj": (1, 128), "down_proj": (1, 256)}),
        ("ctpkg_fp8_dynamic_qwen2", {"q_proj": (1, 128), "down_proj": (1, 256)}),
        ("ctpkg_fp8_block_llama", {"k_proj": (128, 128), "down_proj": (128, 128)}),
    ],
)
def test_loaded_layers_keep_e4m3_weights(case, block, checkpoints):
    """Each decoder linear an `Fp8Linear` of the checkpoint's scale blocks, its weights
    e4m3 (a byte a weight, as `meshes.total_bytes` counts them); the embedding and LM
    head float; the weights exactly the stored bytes."""
    path, _ = checkpoints[case]
    config = ModelConfig.from_pretrained(path)
    model = load_model(path, config)
    layers = {p: m for p, m in nnx.iter_modules(model) if isinstance(m, Fp8Linear)}
    assert len(layers) == 7 * SHAPES["num_hidden_layers"]
    for p, layer in layers.items():
        assert layer.kernel.dtype == jnp.float8_e4m3fn and layer.scale.dtype == jnp.float32
        if p[-1] in block:
            assert layer.block == block[p[-1]], p
        n, k = layer.kernel.shape
        assert meshes.total_bytes([layer.kernel[...], layer.scale[...]]) == n * k + 4 * (
            layer.scale.size
        )
    assert isinstance(model.lm_head, nnx.Linear) and isinstance(model.model.embed_tokens, nnx.Embed)
    from safetensors import safe_open

    k_proj = "model.layers.1.self_attn.k_proj"
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        stored = f.get_tensor(f"{k_proj}.weight").view(torch.uint8).numpy()
    got = np.asarray(model.model.layers[1].self_attn.k_proj.kernel[...]).view(np.uint8)
    np.testing.assert_array_equal(got, stored)


def test_on_the_fly_fp8_is_fbgemms_per_channel_quantization(float_models, checkpoints, tmp_path):
    """quantization="fp8" on a float checkpoint: its projections e4m3 with a scale per
    output channel (max|w| / 448, as fbgemm's and vLLM's), the embedding and LM head
    float: the e4m3 weights of the fbgemm checkpoint of that model (the scales within an
    ulp: XLA multiplies by 1 / 448 where numpy divides, which moves the odd weight on a
    rounding boundary by one e4m3 step), and the same tokens."""
    float_models["Qwen2ForCausalLM"].save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(str(tmp_path))
    model = load_model(str(tmp_path), config, quantization="fp8")
    path, want = checkpoints["channel_qwen2"]
    stored = load_model(path, ModelConfig.from_pretrained(path))
    mine = nnx.to_flat_state(nnx.state(model, nnx.Param))
    theirs = nnx.to_flat_state(nnx.state(stored, nnx.Param))
    assert [p for p, _ in mine] == [p for p, _ in theirs]
    for (p, a), (_, b) in zip(mine, theirs, strict=True):
        a, b = np.asarray(a[...]), np.asarray(b[...])
        assert a.dtype == b.dtype, p
        if p[-1] == "scale":
            np.testing.assert_allclose(a, b, rtol=2e-7, err_msg=str(p))
        elif a.dtype == FP8:
            same = a.view(np.uint8) == b.view(np.uint8)
            assert same.mean() > 0.999, (p, same.mean())
            a, b = a.astype(np.float32), b.astype(np.float32)
            np.testing.assert_allclose(a, b, rtol=2.0**-3, atol=2.0**-9, err_msg=str(p))
        else:
            np.testing.assert_array_equal(a, b, err_msg=str(p))
    assert isinstance(model.lm_head, nnx.Linear)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, quantization="fp8", **SMALL_LLM)
    assert llm.config.quantization == "fp8"
    check_served(llm, want, "on-the-fly fp8")
    llm.close()


def test_convert_stores_fp8_and_reloads_it(float_models, tmp_path):
    """`jaxserve convert --quantization=fp8`: an orbax directory of e4m3 projections
    with their per-channel scales (the embedding and LM head float), which loads to
    the on-the-fly fp8 model's arrays bit for bit and serves its tokens."""
    hf_dir = str(tmp_path / "hf")
    float_models["Qwen2ForCausalLM"].save_pretrained(hf_dir)
    out = convert(hf_dir, str(tmp_path / "fp8"), quantization="fp8")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {"quant_method": "jaxserve_fp8"}
    stored = ocp.PyTreeCheckpointer().metadata(os.path.join(out, "orbax")).item_metadata.tree
    q_proj = "model.layers.0.self_attn.q_proj"
    assert stored[f"{q_proj}.kernel"].dtype == FP8
    assert stored["model.embed_tokens.embedding"].dtype == np.float32
    config = ModelConfig.from_pretrained(out)
    assert config.quantization == "fp8"
    restored = nnx.to_flat_state(nnx.state(load_model(out, config), nnx.Param))
    float_config = ModelConfig.from_pretrained(hf_dir)
    loaded = load_model(hf_dir, float_config, quantization="fp8")
    loaded = nnx.to_flat_state(nnx.state(loaded, nnx.Param))
    assert [p for p, _ in restored] == [p for p, _ in loaded]
    for (p, a), (_, b) in zip(restored, loaded, strict=True):
        a, b = np.asarray(a[...]), np.asarray(b[...])
        assert a.dtype == b.dtype, p
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=str(p))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i, 17, 40 + i, 9]} for i in range(3)]

    def served(llm):
        with llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = served(LLM(hf_dir, skip_tokenizer_init=True, quantization="fp8", **SMALL_LLM))
    llm = LLM(out, skip_tokenizer_init=True, **SMALL_LLM)
    assert llm.config.quantization == "fp8"
    assert served(llm) == want
    with pytest.raises(ValueError, match="stores its weights quantized as 'fp8'"):
        LLM(out, skip_tokenizer_init=True, quantization="int8", **SMALL_LLM)


# ----------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, block",
    [
        ((256, 384), (128, 128)),  # whole blocks, three block columns
        ((200, 300), (128, 128)),  # cut blocks (the grid is ceil(N / R) x ceil(K / C))
        ((96, 256), (1, 256)),  # per channel
        ((96, 256), (96, 256)),  # per tensor
    ],
    ids=["block", "cut-block", "channel", "tensor"],
)
def test_layer_equals_a_float_layer_of_its_dequantized_weights(shape, block):
    """Given e4m3 weights, a scale grid and a bias, the layer computes what a float
    Linear whose kernel is weights * scale computes, in both formulations of the product
    (the blocked one: GPU and TPU decode steps; padded to two rows as on a TPU)."""
    rs = np.random.RandomState(sum(shape) + block[0])
    (n, k), (r, c), t = shape, block, 5
    codes = rs.normal(scale=100, size=shape).clip(-448, 448).astype(FP8)
    grid = rs.uniform(1e-4, 1e-2, size=(-(-n // r), -(-k // c))).astype(np.float32)
    bias = rs.normal(size=n).astype(np.float32)
    layer = Fp8Linear(jnp.asarray(codes), jnp.asarray(grid), block, jnp.asarray(bias))
    w = codes.astype(np.float64) * np.repeat(np.repeat(grid, r, 0)[:n], c, 1)[:, :k]
    dense = linear(k, n, ("embed", "mlp"), bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dense.kernel[...] = jnp.asarray(w.T, jnp.float32)
    dense.bias[...] = jnp.asarray(bias)
    x = jnp.asarray(rs.normal(size=(t, k)), jnp.float32)
    want = np.asarray(x, np.float64) @ w.T
    np.testing.assert_allclose(layer(x), dense(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer(x), want + bias, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer(x[None])[0], layer(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lm_head_logits(x, layer), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        dequantize_fp8(layer.kernel[...], layer.scale[...], block), w, rtol=1e-6
    )
    args = (layer.kernel[...], layer.scale[...], block)
    forms = [fp8_dot_dequantized(x, *args)]
    if k % c == 0:
        forms += [fp8_dot_blocked(x, *args), fp8_dot_blocked(x[:1], *args, min_rows=2)]
    for got in forms:
        np.testing.assert_allclose(got, want[: got.shape[0]], rtol=1e-4, atol=1e-4)


def test_bfloat16_layer_rounds_the_dequantized_weights_once():
    rs = np.random.RandomState(3)
    codes = rs.normal(scale=50, size=(64, 256)).astype(FP8)
    grid = rs.uniform(1e-3, 1e-2, size=(1, 2)).astype(np.float32)
    layer = Fp8Linear(jnp.asarray(codes), jnp.asarray(grid), (128, 128))
    x = jnp.asarray(rs.normal(size=(3, 256)), jnp.bfloat16)
    w = jnp.asarray(codes.astype(np.float32) * np.repeat(grid, 128, 1)).astype(jnp.bfloat16)
    assert layer(x).dtype == jnp.bfloat16
    want = x.astype(jnp.float32) @ w.astype(jnp.float32).T
    np.testing.assert_allclose(layer.product(x), want, rtol=1e-5, atol=1e-5)


def test_quantize_fp8_per_channel_within_half_an_e4m3_step():
    rs = np.random.RandomState(4)
    w = jnp.asarray(rs.normal(size=(32, 64)), jnp.float32)
    codes, scale = quantize_fp8(w)
    assert codes.dtype == jnp.float8_e4m3fn and scale.shape == (32, 1)
    assert np.all(np.abs(np.asarray(codes, np.float32)).max(axis=1) == 448)
    back = np.asarray(codes, np.float32) * np.asarray(scale)
    # e4m3: 3 mantissa bits, a relative step of 2^-3 at most; subnormals below 2^-6.
    bound = np.maximum(np.abs(np.asarray(w)) * 2.0**-4, 2.0**-10 * np.asarray(scale))
    assert np.all(np.abs(back - np.asarray(w)) <= bound + 1e-7)


@pytest.mark.parametrize(
    "codes, grid, block, match",
    [
        (np.zeros((8, 16), np.float32), np.ones((1, 1)), (8, 16), "must be float8_e4m3fn"),
        (np.zeros((8, 16), FP8), np.ones((2, 1)), (8, 16), r"want \(1, 1\)"),
        (np.zeros((8, 16), FP8), np.ones((1, 1), np.int32), (8, 16), "floating point"),
        (np.zeros((8, 16), FP8), np.ones((1, 1)), (0, 16), "not \\(output rows"),
    ],
)
def test_arrays_that_do_not_fit_are_refused(codes, grid, block, match):
    with pytest.raises(ValueError, match=match):
        Fp8Linear(jnp.asarray(codes), jnp.asarray(grid), block)


# ----------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------


def test_quantization_names(checkpoints, hf_model_dir):
    """The model's quantization is the checkpoint's; vLLM's name for it is accepted,
    another is refused naming both."""
    block_dir, _ = checkpoints["block128_llama"]
    assert engine_config(block_dir).quantization == "fp8"
    assert engine_config(block_dir, quantization="fp8").quantization == "fp8"
    fbgemm_dir, _ = checkpoints["channel_llama"]
    assert engine_config(fbgemm_dir, quantization="fbgemm_fp8").quantization == "fbgemm_fp8"
    ct_dir, _ = checkpoints["ct_block_llama"]
    assert engine_config(ct_dir, quantization="compressed-tensors").fp8_weights
    for asked in ("int8", "int4", "awq", "fbgemm_fp8"):
        with pytest.raises(ValueError, match=f"quantization='{asked}', but .* as 'fp8'"):
            engine_config(block_dir, quantization=asked)
    with pytest.raises(ValueError, match="quantization='fp8', but .* as 'compressed-tensors'"):
        engine_config(ct_dir, quantization="fp8")
    path, _ = hf_model_dir("llama2_mha")  # a float checkpoint: "fp8" quantizes it
    assert engine_config(path, quantization="fp8").fp8_weights
    with pytest.raises(ValueError, match="quantization='fbgemm_fp8' reads a checkpoint"):
        engine_config(path, quantization="fbgemm_fp8")


@pytest.mark.parametrize(
    "qc, message",
    [
        (hf_fp8((128, 128), "static"), r"quantization_config\.activation_scheme: 'static'"),
        (hf_fp8(None, "static"), r"quantization_config\.activation_scheme: 'static'"),
        (
            ct_fp8("channel", dynamic=False),
            r"config_groups\.group_0\.input_activations\.dynamic: False",
        ),
        (dict(hf_fp8(), fmt="e5m2"), "fmt: 'e5m2' is not served"),
    ],
    ids=["hf-block-static", "hf-tensor-static", "ct-static", "e5m2"],
)
def test_static_activation_scales_are_refused_naming_the_field(qc, message, tmp_path):
    config = dict(SHAPES, architectures=["LlamaForCausalLM"], quantization_config=qc)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        engine_config(str(tmp_path))


@pytest.mark.parametrize("case", ["block128_llama", "channel_qwen2"])
def test_lora_adapters_over_fp8_checkpoints_serve_as_peft_over_the_dequantized_weights(
    case, float_models, tmp_path
):
    """QLoRA-style serving: the base stays e4m3 (blocks, channels), the adapter in float
    beside it."""
    _, arch, qc = next(c for c in CASES if c[0] == case)
    base = copy.deepcopy(float_models[arch])
    reference = write_checkpoint(tmp_path / "ckpt", base, qc)
    base.load_state_dict(reference)
    check_adapter_over_quantized(str(tmp_path / "ckpt"), base, PROMPTS, MAX_TOKENS, tmp_path, case)


def test_moe_is_refused(hf_model_dir, tmp_path):
    moe_dir, _ = hf_model_dir("mixtral_top2_of_8")
    with open(f"{moe_dir}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = hf_fp8((128, 128))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'fp8', fp8-block, 8-bit .* quantized MoE experts"):
        engine_config(str(tmp_path))


def test_tensor_parallel_split_through_a_block_is_refused_naming_it(checkpoints):
    """128x128 blocks: down_proj's 256 inputs split 4 ways (64 a device) cut its blocks,
    refused naming the block size; 2 ways (128 a device) do not. Per-channel scales
    multiply each output after the sum over its inputs: any split of them is served."""
    block_dir, _ = checkpoints["block128_llama"]
    match = (
        r"quantization='fp8' with tensor_parallel_size=4: model\.layers\.0\.mlp\.down_proj "
        r"splits its 256 inputs 4 ways, 64 a device, across its fp8 scale blocks of "
        r"128x128 weights \(weight_block_size \[128, 128\]"
    )
    with pytest.raises(ValueError, match=match):
        engine_config(block_dir, tensor_parallel_size=4)
    assert engine_config(block_dir, tensor_parallel_size=2).parallel.tensor_parallel_size == 2
    channel_dir, _ = checkpoints["channel_llama"]
    assert engine_config(channel_dir, tensor_parallel_size=4).parallel.tensor_parallel_size == 4


def test_new_weights_for_an_fp8_checkpoint_are_refused_and_it_serves_on(checkpoints):
    path, want = checkpoints["tensor_qwen2"]
    llm = LLM(model=path, skip_tokenizer_init=True, **SMALL_LLM)
    with pytest.raises(ValueError, match="quantized checkpoint's 4-bit codes \\(or fp8 weights"):
        llm.update_weights(path=path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want[0][0]
    llm.close()


# ----------------------------------------------------------------------------
# Deviceless compiles
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target,args",
    [("h100", {}), ("v5e", {}), ("a100", LORA), ("v6e", LORA)],
    ids=["h100", "v5e", "a100-lora", "v6e-lora"],
)
def test_fp8_steps_compile_for_a_gpu_and_a_tpu(target, args, tmp_path):
    """An fp8 block checkpoint's warm-up programs (only its config.json is read)
    compile deviceless for the target, with LoRA adapters too, the weights still e4m3
    (f8e4m3fn) in the compiled decode step: they reach the device a byte a weight. On
    the H100 the decode step reads about half bfloat16's bytes (XLA's cost model: the
    codes converted inside the matmuls, each block column's partial sums scaled)."""
    from test_device_compile import SMALL, build, check

    from jaxserve.preflight import program_cost

    config = dict(SMALL, num_hidden_layers=2, quantization_config=hf_fp8((128, 128)))
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = build(str(tmp_path), target, **args)
    check(engine, target)
    decode = engine.compiled["forward T=1"]
    assert "f8e4m3fn[" in decode.as_text()
    if target == "h100":
        (tmp_path / "bf16").mkdir()
        del config["quantization_config"]
        (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
        bf16 = build(str(tmp_path / "bf16"), target).compiled["forward T=1"]
        assert program_cost(decode)[1] < 0.65 * program_cost(bf16)[1]  # measured 0.53


@pytest.mark.sharded
@pytest.mark.slow
def test_tensor_parallel_fp8_engines_equal_one_device(checkpoints):
    from fake_devices import run_on_8_devices

    stdout = run_on_8_devices(
        "fp8_tp_check.py", checkpoints["block128_llama"][0], checkpoints["channel_llama"][0]
    )
    for line in ("block tp=2", "channel tp=2", "channel tp=4"):
        assert f"fp8 {line}: greedy tokens equal one device's" in stdout, stdout
