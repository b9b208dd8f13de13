"""Quantized checkpoint formats (jaxserve.quantized: formats and
config): each format's storage against its own tools -- the
compressed-tensors package (its compressors, and a small model it saved), transformers'
fp8 ops, and AutoAWQ's and AutoGPTQ's packing and dequantization as they wrote them,
typed out below in torch -- round trips for every group size, symmetry and desc_act,
the refusals, and which linears are quantized."""

import importlib.util
import json
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from jaxserve.quantized.formats import (
    AWQ_ORDER,
    FP8,
    QuantizedWeight,
    contiguous_groups,
    dequantize,
    encode,
    pack,
    quantize,
    read_quantization_config,
    unpack,
)

# Output and input features of the test linears: AutoAWQ and AutoGPTQ size their
# packed outputs as out // 32 * bits words, so OUT is a multiple of 32, as real linears are.
OUT, IN = 64, 256
needs_ct = pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None,
    reason="compressed-tensors is not installed (pip install -e '.[test]')",
)
GROUPS = (32, 64, 128, -1)


def fmt_of(**qc):
    return read_quantization_config({"quantization_config": qc})


def awq(group=128):
    return fmt_of(quant_method="awq", bits=4, group_size=group, version="gemm", zero_point=True)


def gptq(bits=4, group=128, sym=True, desc_act=False, checkpoint_format="gptq"):
    return fmt_of(
        quant_method="gptq",
        bits=bits,
        group_size=group,
        sym=sym,
        desc_act=desc_act,
        checkpoint_format=checkpoint_format,
    )


def ct_config(weights, input_activations=None, fmt="pack-quantized", **extra):
    group = {"targets": ["Linear"], "weights": weights, "input_activations": input_activations}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        **extra,
    }


def ct_int(bits=4, group=128, sym=True, actorder=None):
    strategy = "channel" if group == -1 else "group"
    weights = dict(num_bits=bits, type="int", symmetric=sym, strategy=strategy, dynamic=False)
    weights |= {"group_size": group} if group != -1 else {}
    weights |= {"actorder": actorder} if actorder else {}
    return fmt_of(**ct_config(weights))


def ct_fp8(strategy, block=None, activations=None):
    weights = dict(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False)
    weights |= {"block_structure": list(block)} if block else {}
    return fmt_of(**ct_config(weights, activations, fmt="float-quantized"))


def weight(rows=OUT, cols=IN, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)


def shuffled_g_idx(group, seed=1):
    g = IN if group == -1 else group
    return np.random.default_rng(seed).permutation(np.arange(IN) // g).astype(np.int32)


def fake_quant(w, bits, group, sym, g_idx=None, scale_dtype=np.float32):
    """Min-max quantize-dequantize, group by group (mask by mask): the weights each
    integer format's round trip must give."""
    g = w.shape[1] if group == -1 else group
    groups = g_idx if g_idx is not None else np.arange(w.shape[1]) // g
    top, out = 2**bits - 1, np.zeros_like(w)
    for k in np.unique(groups):
        x = w[:, groups == k]
        lo, hi = np.minimum(x.min(1, keepdims=True), 0), np.maximum(x.max(1, keepdims=True), 0)
        if sym:
            s = (np.maximum(-lo, hi) / (top / 2)).astype(scale_dtype).astype(np.float32)
            z = np.float32(2 ** (bits - 1))
        else:
            s = ((hi - lo) / top).astype(scale_dtype).astype(np.float32)
            z = np.clip(np.round(-lo / s), 0, top)
        out[:, groups == k] = (np.clip(np.round(x / s + z), 0, top) - z) * s
    return out


def assert_same(a: QuantizedWeight, b: QuantizedWeight):
    for name in QuantizedWeight._fields:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None, name
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), name
        else:
            assert x == y, name


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float8_e4m3fn:  # numpy has no fp8: the bytes, read by ml_dtypes
        return t.contiguous().view(torch.uint8).numpy().view(FP8)
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == FP8:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a))


# -- round trips ----------------------------------------------------------------------

INT_CASES = (
    [(f"awq-g{g}", awq(g), False) for g in GROUPS]
    + [
        (f"gptq{b}-g{g}-{'sym' if s else 'asym'}{'-desc' if d else ''}", gptq(b, g, s, d), d)
        for b in (4, 8)
        for g in GROUPS
        for s in (True, False)
        for d in (False, True)
        if not (d and g == -1)
    ]
    + [(f"gptq_v2-{s}", gptq(4, 64, s, True, "gptq_v2"), True) for s in (True, False)]
    + [
        (f"ct{b}-g{g}-{'sym' if s else 'asym'}", ct_int(b, g, s), False)
        for b in (4, 8)
        for g in GROUPS
        for s in (True, False)
    ]
    + [(f"ct-actorder-{s}", ct_int(4, 64, s, "group"), True) for s in (True, False)]
)


@pytest.mark.parametrize("fmt,shuffle", [c[1:] for c in INT_CASES], ids=[c[0] for c in INT_CASES])
def test_integer_round_trip(fmt, shuffle):
    """pack -> unpack gives back exactly what quantize made, re-encodes to the same
    bytes, and dequantizes to the min-max fake-quantization of the float weights."""
    w = weight()
    g_idx = shuffled_g_idx(fmt.group_size or -1) if shuffle else None
    stored = pack(w, fmt, g_idx=g_idx)
    assert set(fmt.tensors) <= set(stored) <= set(fmt.tensors + fmt.optional_tensors)
    qw = unpack(stored, fmt, OUT, IN)
    assert_same(qw, quantize(w, fmt, g_idx=g_idx))
    again = encode(qw, fmt)
    assert all(np.array_equal(again[k], stored[k]) for k in stored)
    if shuffle and fmt.group_size is not None:
        assert np.array_equal(qw.g_idx, g_idx)
    scale_dtype = np.float16 if fmt.method in ("awq", "gptq") else np.float32
    expected = fake_quant(w, fmt.bits, fmt.group_size or -1, fmt.symmetric, g_idx, scale_dtype)
    np.testing.assert_allclose(dequantize(qw), expected, rtol=1e-6, atol=1e-6)


FP8_CASES = [
    ("fp8-block", fmt_of(quant_method="fp8", weight_block_size=[128, 128]), (OUT, IN)),
    ("fp8-block-partial", fmt_of(quant_method="fp8", weight_block_size=[128, 128]), (200, 300)),
    ("fp8-block-ct", ct_fp8("block", (64, 32)), (OUT, IN)),
    ("fp8-tensor", fmt_of(quant_method="fp8", activation_scheme="static"), (OUT, IN)),
    ("fp8-channel-fbgemm", fmt_of(quant_method="fbgemm_fp8"), (OUT, IN)),
    ("fp8-channel-ct", ct_fp8("channel"), (OUT, IN)),
    ("fp8-tensor-ct", ct_fp8("tensor"), (OUT, IN)),
]


@pytest.mark.parametrize("fmt,shape", [c[1:] for c in FP8_CASES], ids=[c[0] for c in FP8_CASES])
def test_fp8_round_trip(fmt, shape):
    """Each fp8 weight is within half an e4m3 step of the float weight (3 mantissa bits:
    a relative 2^-4), every scale max|w| / 448 over its block, channel or tensor."""
    w = weight(*shape)
    stored = pack(w, fmt)
    assert set(stored) == set(fmt.tensors)
    qw = unpack(stored, fmt, *shape)
    assert_same(qw, quantize(w, fmt))
    assert qw.q.dtype == FP8 and qw.zeros is None
    scales = qw.scales[:, np.arange(shape[1]) // qw.group_size]
    assert np.abs(w).max() / 448 == pytest.approx(scales.max(), rel=1e-6)
    err = np.abs(dequantize(qw) - w)
    assert np.all(
        err <= np.abs(w) * 2.0**-4 + scales * 2.0**-9 * 1.0001
    )  # 2^-9: e4m3's subnormal step


# -- the formats' own code ------------------------------------------------------------


def autoawq_pack(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM.from_linear packing of codes [rows, cols] (int32)."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = torch.zeros((codes.shape[0], codes.shape[1] // 8), dtype=torch.int32)
    for col in range(codes.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= codes[:, col * 8 + order_map[i]] << (i * 4)
    return packed


def autoawq_dequantize(qweight, qzeros, scales, group_size):
    """AutoAWQ's dequantize_gemm (awq/utils/packing_utils.py): unpack_awq, then
    reverse_awq_order with AWQ_REVERSE_ORDER -> [IN, OUT]."""
    shifts = torch.arange(0, 32, 4)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    reverse = torch.arange(iweights.shape[-1], dtype=torch.int32).view(-1, 8)
    reverse = reverse[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    iweights = torch.bitwise_and(iweights[:, reverse], 15)
    izeros = torch.bitwise_and(izeros[:, reverse], 15)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweights - izeros) * scales


@pytest.mark.parametrize("group", GROUPS)
def test_awq_against_autoawq(group):
    """Our storage is AutoAWQ's packing of the same codes, and AutoAWQ's dequantization
    of it is ours (its fp16 scales read as float32)."""
    fmt = awq(group)
    qw = quantize(weight(), fmt)
    stored = encode(qw, fmt)
    zeros = torch.from_numpy(qw.zeros.T.astype(np.int32))
    assert np.array_equal(
        autoawq_pack(torch.from_numpy(qw.q.T.astype(np.int32))), stored["qweight"]
    )
    assert np.array_equal(autoawq_pack(zeros), stored["qzeros"])
    qweight, qzeros = torch.from_numpy(stored["qweight"]), torch.from_numpy(stored["qzeros"])
    scales = torch.from_numpy(stored["scales"]).float()
    reference = autoawq_dequantize(qweight, qzeros, scales, IN if group == -1 else group)
    assert np.array_equal(reference.numpy().T, dequantize(unpack(stored, fmt, OUT, IN)))


def test_awq_nibble_order():
    """A word's nibbles, low to high, hold its eight output channels in the order
    0 2 4 6 1 3 5 7."""
    fmt = awq(-1)
    codes = np.tile(np.arange(8, dtype=np.uint8)[:, None], (1, 8))  # output o has code o
    qw = QuantizedWeight(codes, np.ones((8, 1), np.float32), np.zeros((8, 1), np.uint8), 8, 4)
    stored = encode(qw, fmt)
    assert list(AWQ_ORDER) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert stored["qweight"].view(np.uint32)[0, 0] == 0x75316420
    assert np.array_equal(unpack(stored, fmt, 8, 8).q, codes)


def autogptq_pack(codes: np.ndarray, zeros: np.ndarray, bits: int):
    """AutoGPTQ's QuantLinear.pack (qlinear_cuda_old) of codes [OUT, IN] and zero points
    [OUT, G]: qweight packed along IN, qzeros along OUT, each zero minus one (v1)."""
    intweight = codes.T.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    zeros = zeros.T.astype(np.int64) - 1  # no zero is 0 here: AutoGPTQ would OR in -1
    zeros = zeros.astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return qweight.astype(np.int32), qzeros.astype(np.int32)


def autogptq_dequantize(qweight, qzeros, scales, g_idx, bits):
    """AutoGPTQ's QuantLinear (qlinear_cuda) torch path with g_idx -> [IN, OUT]."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(
        torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)
    ).to(torch.int16 if bits == 8 else torch.int8)
    zeros = zeros + 1
    zeros = torch.bitwise_and(zeros, (2**bits) - 1)
    zeros = zeros.reshape(scales.shape)
    weight = torch.bitwise_right_shift(
        torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)
    ).to(torch.int16 if bits == 8 else torch.int8)
    weight = torch.bitwise_and(weight, (2**bits) - 1)
    weight = weight.reshape(-1, weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_against_autogptq(bits, sym, desc_act):
    fmt = gptq(bits, 64, sym, desc_act)
    g_idx = shuffled_g_idx(64) if desc_act else None
    qw = quantize(weight(), fmt, g_idx=g_idx)
    stored = encode(qw, fmt)
    zeros = qw.zeros if qw.zeros is not None else np.full(qw.scales.shape, 2 ** (bits - 1))
    qweight, qzeros = autogptq_pack(qw.q, zeros, bits)
    assert np.array_equal(qweight, stored["qweight"])
    assert np.array_equal(qzeros, stored["qzeros"])
    reference = autogptq_dequantize(
        *(torch.from_numpy(stored[k]) for k in ("qweight", "qzeros")),
        torch.from_numpy(stored["scales"]).float(),
        torch.from_numpy(stored["g_idx"]),
        bits,
    )
    assert np.array_equal(reference.numpy().T, dequantize(unpack(stored, fmt, OUT, IN)))


def test_gptq_zero_point_storage():
    """v1 stores each zero minus one, v2 the zero; symmetric GPTQ's zeros are all 8
    (7s in v1) and unpack to None; v1's stored 15 is the zero 0, not 16."""
    w = weight()
    for checkpoint_format, word in (("gptq", 0x77777777), ("gptq_v2", 0x88888888)):
        fmt = gptq(4, 64, True, checkpoint_format=checkpoint_format)
        stored = pack(w, fmt)
        assert np.all(stored["qzeros"].view(np.uint32) == word)
        assert unpack(stored, fmt, OUT, IN).zeros is None
    fmt = gptq(4, 64, False)
    w[:, :64] = np.abs(w[:, :64])  # group 0 is all positive: its zero is 0
    qw = quantize(w, fmt)
    assert np.all(qw.zeros[:, 0] == 0)
    stored = encode(qw, fmt)
    assert np.all(stored["qzeros"][0].view(np.uint32) == 0xFFFFFFFF)
    assert_same(unpack(stored, fmt, OUT, IN), qw)


def ct_args(fmt):
    from compressed_tensors.quantization import QuantizationArgs

    kind = "float" if fmt.method.startswith("fp8") else "int"
    strategy = fmt.method.removeprefix("fp8-") if kind == "float" else None
    strategy = strategy or ("group" if fmt.group_size else "channel")
    return QuantizationArgs(
        num_bits=fmt.bits,
        type=kind,
        symmetric=fmt.symmetric,
        strategy=strategy,
        group_size=fmt.group_size,
        block_structure=list(fmt.block_size or ()) or None,
    )


def ct_qparams(w: torch.Tensor, args):
    """compressed-tensors' scales and zero points of w, from its calculate_qparams over
    the strategy's min and max (what llm-compressor's min-max observer hands it)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.strategy == "group":
        x = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = x.amin(-1), x.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    else:
        (bo, bi), (o, i) = args.block_structure, w.shape
        padded = torch.zeros((-(-o // bo) * bo, -(-i // bi) * bi))
        padded[:o, :i] = w
        x = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
        lo, hi = x.amin((1, 3)), x.amax((1, 3))
    return calculate_qparams(lo, hi, args)


CT_CASES = [
    (f"int{b}-g{g}-{'sym' if s else 'asym'}", ct_int(b, g, s), (OUT, IN))
    for b in (4, 8)
    for g in GROUPS
    for s in (True, False)
] + [
    ("fp8-tensor", ct_fp8("tensor"), (OUT, IN)),
    ("fp8-channel", ct_fp8("channel"), (OUT, IN)),
    ("fp8-block", ct_fp8("block", (128, 128)), (200, 300)),
]


@needs_ct
@pytest.mark.parametrize("fmt,shape", [c[1:] for c in CT_CASES], ids=[c[0] for c in CT_CASES])
def test_compressed_tensors_against_package(fmt, shape):
    """Our scales, zero points and storage are compressed-tensors' own (its
    calculate_qparams, then its compressor), and its decompressor reads ours back as we
    do."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    w = weight(*shape)
    args = ct_args(fmt)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    scale, zero = ct_qparams(torch.from_numpy(w), args)
    qw = quantize(w, fmt)
    compressor = BaseCompressor.get_value_from_registry(ct_storage(fmt))
    state = {"weight": torch.from_numpy(w), "weight_scale": scale, "weight_zero_point": zero}
    theirs = {k: to_numpy(v) for k, v in compressor.compress(state, scheme).items()}
    ours = encode(qw, fmt)
    assert set(theirs) == set(ours)
    for name, array in ours.items():
        assert theirs[name].dtype == array.dtype, name
        assert np.array_equal(theirs[name].view(np.uint8), array.view(np.uint8)), name
    decompressed = compressor.decompress({k: to_torch(v) for k, v in ours.items()}, scheme)
    np.testing.assert_array_equal(
        decompressed["weight"].numpy(), dequantize(unpack(ours, fmt, *shape))
    )


def ct_storage(fmt):
    return "pack-quantized" if fmt.method == "compressed-tensors-int" else "naive-quantized"


def small_llama(scheme_name: str, tmp_path):
    """A one-layer Llama quantized and saved by compressed-tensors itself (its preset
    scheme, calculate_qparams per linear, ModelCompressor), and each linear's expected
    weights: its fake quantization by compressed-tensors before compression."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    model = LlamaForCausalLM(config).float()
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[scheme_name])
    groups = {"group_0": scheme}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=["lm_head"]))
    expected = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            args = module.quantization_scheme.weights
            scale, zero = ct_qparams(module.weight.data, args)
            module.weight_scale.data = scale.reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape)
            expected[name] = fake_quantize(module.weight.data, scale, zero, args).numpy()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(tmp_path)
    compressor.update_config(tmp_path)
    return expected


@needs_ct
@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_checkpoint_saved_by_compressed_tensors(scheme, tmp_path):
    """A checkpoint as compressed-tensors writes it: its config.json reads, exactly the
    linears it quantized are `is_quantized` and store `tensors`, and each dequantizes
    to compressed-tensors' own fake quantization of the float weights."""
    from safetensors import safe_open

    expected = small_llama(scheme, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    fmt = read_quantization_config(config)
    assert (fmt.activations is None) == (not scheme.startswith("FP8"))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {k: to_numpy(f.get_tensor(k)) for k in f.keys()}  # noqa: SIM118
    assert not fmt.is_quantized("lm_head") and "lm_head.weight" in tensors
    for name, want in expected.items():
        assert fmt.is_quantized(name)
        local = {
            k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(f"{name}.")
        }
        assert set(local) == set(fmt.tensors), name
        qw = unpack(local, fmt, *want.shape)
        np.testing.assert_allclose(dequantize(qw), want, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
def test_fp8_block_against_transformers(shape):
    """transformers' fine-grained fp8 (Fp8Quantize / Fp8Dequantize): its storage reads
    back through ours to its own dequantization, and ours is its quantization up to the
    rounding of w * (448 / amax) against w / (amax / 448)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    quantizer = types.SimpleNamespace(quantization_config=FineGrainedFP8Config())
    fmt = read_quantization_config({"quantization_config": quantizer.quantization_config.to_dict()})
    assert fmt.method == "fp8-block" and fmt.block_size == (128, 128)
    w = weight(*shape)
    ours = pack(w, fmt)
    if shape[0] % 128 == 0 and shape[1] % 128 == 0:  # transformers quantizes whole blocks only
        theirs = Fp8Quantize(quantizer).convert({"x.weight": torch.from_numpy(w)})
        theirs = {k.removeprefix("x."): to_numpy(v) for k, v in theirs.items()}
        reference = Fp8Dequantize(quantizer)._dequantize_one(
            to_torch(theirs["weight"]), to_torch(theirs["weight_scale_inv"]), torch.float32
        )
        assert np.array_equal(dequantize(unpack(theirs, fmt, *shape)), reference.numpy())
        np.testing.assert_allclose(ours["weight_scale_inv"], theirs["weight_scale_inv"], rtol=1e-6)
        same = ours["weight"].view(np.uint8) == theirs["weight"].view(np.uint8)
        assert same.mean() > 0.999
    np.testing.assert_allclose(dequantize(unpack(ours, fmt, *shape)), w, rtol=2.0**-4, atol=1e-3)


# -- the config, which linears, the errors ---------------------------------------------


def test_no_quantization_config():
    assert read_quantization_config({"architectures": ["LlamaForCausalLM"]}) is None
    assert read_quantization_config({"quantization_config": None}) is None


def test_formats_read():
    f = awq(64)
    assert (f.method, f.bits, f.group_size, f.symmetric) == ("awq", 4, 64, False)
    assert f.tensors == ("qweight", "qzeros", "scales") and not f.desc_act
    f = gptq(8, -1, False, True, "gptq_v2")
    assert (f.method, f.bits, f.group_size, f.symmetric, f.desc_act) == (
        "gptq",
        8,
        None,
        False,
        True,
    )
    assert f.tensors == ("qweight", "qzeros", "scales", "g_idx") and not f.zeros_minus_one
    assert gptq().optional_tensors == ("g_idx",) and gptq().zeros_minus_one
    f = ct_int(4, 128, False, "group")
    assert (f.method, f.bits, f.group_size, f.symmetric, f.desc_act) == (
        "compressed-tensors-int",
        4,
        128,
        False,
        True,
    )
    assert f.tensors == (
        "weight_packed",
        "weight_scale",
        "weight_shape",
        "weight_zero_point",
        "weight_g_idx",
    )
    assert ct_int(8, -1).group_size is None and "weight_zero_point" not in ct_int(4).tensors
    f = ct_fp8("block", (128, 128), {"type": "float", "num_bits": 8, "dynamic": True})
    assert (f.method, f.block_size, f.tensors, f.activations) == (
        "fp8-block",
        (128, 128),
        ("weight", "weight_scale"),
        "fp8-dynamic",
    )
    f = fmt_of(
        quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128]
    )
    assert (f.method, f.tensors, f.activations) == (
        "fp8-block",
        ("weight", "weight_scale_inv"),
        "fp8-dynamic",
    )
    f = fmt_of(quant_method="fp8", activation_scheme="static")
    assert (f.method, f.tensors, f.activations) == (
        "fp8-tensor",
        ("weight", "weight_scale"),
        "fp8-static",
    )
    assert fmt_of(quant_method="fbgemm_fp8", activation_scale_ub=1200.0).method == "fp8-channel"
    old = {"compression_config": ct_config({"num_bits": 4, "type": "int", "strategy": "channel"})}
    assert read_quantization_config(old).method == "compressed-tensors-int"


def test_which_linears_are_quantized():
    f = fmt_of(
        quant_method="awq",
        bits=4,
        group_size=128,
        version="gemm",
        modules_to_not_convert=["visual", "mlp.gate"],
    )
    assert f.is_quantized("model.layers.0.mlp.gate_proj")
    assert f.is_quantized("model.layers.0.self_attn.q_proj")
    assert not f.is_quantized("model.layers.0.mlp.gate")  # an MoE router
    assert not f.is_quantized("visual.blocks.0.attn.qkv")
    assert not f.is_quantized("lm_head")
    f = fmt_of(
        quant_method="gptq",
        bits=4,
        group_size=128,
        lm_head=True,
        modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj"], ["mlp.down_proj"]],
    )
    assert f.is_quantized("model.layers.3.self_attn.k_proj") and f.is_quantized("lm_head")
    assert f.is_quantized("model.layers.3.mlp.down_proj")
    assert not f.is_quantized("model.layers.3.self_attn.v_proj")
    assert not f.is_quantized("model.layers.3.self_attn.xq_proj")
    assert not gptq().is_quantized("lm_head") and gptq().is_quantized("model.layers.0.mlp.up_proj")
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
    qc = ct_config(weights, ignore=["lm_head", "re:.*mlp\\.gate$"])
    f = fmt_of(**qc)
    assert f.is_quantized("model.layers.0.mlp.gate_proj") and not f.is_quantized("lm_head")
    assert not f.is_quantized("model.layers.0.mlp.gate")
    qc["config_groups"]["group_0"]["targets"] = ["re:.*self_attn\\..*"]
    f = fmt_of(**qc)
    assert f.is_quantized("model.layers.0.self_attn.o_proj")
    assert not f.is_quantized("model.layers.0.mlp.up_proj")


CT_W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
INT8_TOKENS = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True}
FP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
OUTPUT_QUANT = {"targets": ["Linear"], "weights": CT_W4, "output_activations": {"num_bits": 8}}
TWO_SCHEMES = {
    "a": {"targets": ["re:.*q_proj"], "weights": CT_W4},
    "b": {"targets": ["re:.*k_proj"], "weights": CT_W4 | {"group_size": 64}},
}
GROUP_0 = "config_groups.group_0"
# (what, quantization_config, the error's start after "quantization_config.")
REFUSED = [
    ("bitsandbytes", {"quant_method": "bitsandbytes"}, "quant_method: 'bitsandbytes'"),
    ("awq-gemv", {"quant_method": "awq", "version": "gemv"}, "version: 'gemv'"),
    ("awq-gemv-fast", {"quant_method": "awq", "version": "GEMV_FAST"}, "version: 'GEMV_FAST'"),
    ("awq-3bit", {"quant_method": "awq", "bits": 3}, "bits: 3"),
    ("awq-no-zeros", {"quant_method": "awq", "zero_point": False}, "zero_point: False"),
    ("gptq-3bit", {"quant_method": "gptq", "bits": 3}, "bits: 3"),
    ("gptq-2bit", {"quant_method": "gptq", "bits": 2}, "bits: 2"),
    ("gptq-group-0", {"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size: 0"),
    (
        "gptq-group-str",
        {"quant_method": "gptq", "bits": 4, "group_size": "128"},
        "group_size: '128'",
    ),
    (
        "gptq-marlin",
        {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
        "checkpoint_format: 'marlin'",
    ),
    (
        "gptq-is-marlin",
        {"quant_method": "gptq", "bits": 4, "is_marlin_format": True},
        "is_marlin_format: True",
    ),
    (
        "gptq-dynamic",
        {"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*down": {}}},
        "dynamic: {'-:.*down': {}}",
    ),
    ("ct-w4a8-int", ct_config(CT_W4, INT8_TOKENS), f"{GROUP_0}.input_activations.type: 'int'"),
    ("ct-fp4-acts", ct_config(CT_W4, FP4), f"{GROUP_0}.input_activations.num_bits: 4"),
    ("ct-nvfp4", ct_config(FP4, fmt="nvfp4-pack-quantized"), f"{GROUP_0}.weights.num_bits: 4"),
    ("ct-3bit", ct_config(CT_W4 | {"num_bits": 3}), f"{GROUP_0}.weights.num_bits: 3"),
    (
        "ct-int-tensor",
        ct_config(CT_W4 | {"strategy": "tensor"}),
        f"{GROUP_0}.weights.strategy: 'tensor'",
    ),
    ("ct-actorder", ct_config(CT_W4 | {"actorder": "up"}), f"{GROUP_0}.weights.actorder: 'up'"),
    ("ct-marlin-24", ct_config(CT_W4, fmt="marlin-24"), "format: 'marlin-24'"),
    ("ct-naive-int", ct_config(CT_W4, fmt="naive-quantized"), "format: 'naive-quantized'"),
    ("ct-frozen", ct_config(CT_W4, quantization_status="frozen"), "quantization_status: 'frozen'"),
    (
        "ct-transform",
        ct_config(CT_W4, transform_config={"config_groups": {}}),
        "transform_config: ",
    ),
    ("ct-sparsity", ct_config(CT_W4, sparsity_config={"format": "dense"}), "sparsity_config: "),
    (
        "ct-lookahead",
        ct_config(CT_W4, ignore=["re:.*(?!gate)"]),
        "ignore: 're:.*(?!gate)' is not a regular expression RE2 reads",
    ),
    (
        "ct-output-acts",
        ct_config(CT_W4) | {"config_groups": {"group_0": OUTPUT_QUANT}},
        f"{GROUP_0}.output_activations: ",
    ),
    (
        "ct-two-schemes",
        ct_config(CT_W4) | {"config_groups": TWO_SCHEMES},
        "config_groups: 2 different weight schemes (quantization_config.config_groups.a, "
        "quantization_config.config_groups.b)",
    ),
    ("fp8-e5m2", {"quant_method": "fp8", "fmt": "e5m2"}, "fmt: 'e5m2'"),
    (
        "fp8-acts",
        {"quant_method": "fp8", "activation_scheme": "token"},
        "activation_scheme: 'token'",
    ),
    (
        "fp8-block-1d",
        {"quant_method": "fp8", "weight_block_size": [128]},
        "weight_block_size: [128]",
    ),
    ("fp8-fp4-experts", {"quant_method": "fp8", "expert_dtype": "fp4"}, "expert_dtype: 'fp4'"),
    (
        "fp8-embeddings",
        {"quant_method": "fp8", "modules_to_convert": ["embed_tokens"]},
        "modules_to_convert: ['embed_tokens']",
    ),
]


@pytest.mark.parametrize("qc,message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused(qc, message):
    """Each unsupported variant stops the start-up naming the field and its value."""
    with pytest.raises(ValueError, match=re.escape(f"quantization_config.{message}")):
        read_quantization_config({"quantization_config": qc})


def test_refused_outside_quantization_config():
    with pytest.raises(ValueError, match=re.escape("quantization_config: 'awq' is not an object")):
        read_quantization_config({"quantization_config": "awq"})
    with pytest.raises(ValueError, match=re.escape("compression_config.quant_method: 'sparseml'")):
        read_quantization_config({"compression_config": {"quant_method": "sparseml"}})


def test_unpack_refuses_what_the_format_does_not_store():
    w = weight()
    stored = pack(w, gptq(4, 64))
    with pytest.raises(
        ValueError, match=re.escape("gptq linear [64, 256]: tensor 'qzeros' is missing")
    ):
        unpack({k: v for k, v in stored.items() if k != "qzeros"}, gptq(4, 64), OUT, IN)
    with pytest.raises(
        ValueError, match=re.escape("qweight is int32 [32, 64], expected int32 [32, 40]")
    ):
        unpack(stored, gptq(4, 64), 40, IN)
    with pytest.raises(ValueError, match="desc_act is off"):  # a scattered g_idx, desc_act false
        unpack(stored | {"g_idx": shuffled_g_idx(64)}, gptq(4, 64), OUT, IN)
    with pytest.raises(ValueError, match="g_idx is missing"):
        unpack(
            {k: v for k, v in stored.items() if k != "g_idx"}, gptq(4, 64, desc_act=True), OUT, IN
        )
    stored = pack(w, ct_int(4, 128))
    with pytest.raises(
        ValueError, match=re.escape("weight_shape is [64, 256], expected [64, 128]")
    ):
        unpack(stored, ct_int(4, 128), OUT, 128)
    fmt = fmt_of(quant_method="fbgemm_fp8")
    stored = pack(w, fmt)
    with pytest.raises(
        ValueError, match=re.escape("weight is float32 [64, 256], expected float8_e4m3fn")
    ):
        unpack(stored | {"weight": w}, fmt, OUT, IN)
    with pytest.raises(ValueError, match=re.escape("256 input features are not a multiple of 96")):
        unpack(pack(weight(OUT, 288), awq(96)), awq(96), OUT, IN)


def test_contiguous_groups():
    """A desc_act weight with its inputs sorted by group: the same products, groups of
    consecutive inputs, for kernels that take those."""
    fmt = gptq(4, 32, False, True)
    qw = unpack(pack(weight(), fmt, g_idx=shuffled_g_idx(32)), fmt, OUT, IN)
    grouped, perm = contiguous_groups(qw)
    assert grouped.g_idx is None and perm is not None
    assert np.array_equal(dequantize(grouped), dequantize(qw)[:, perm])
    x = np.random.default_rng(2).normal(size=(3, IN)).astype(np.float32)
    np.testing.assert_allclose(
        x[:, perm] @ dequantize(grouped).T, x @ dequantize(qw).T, rtol=1e-5, atol=1e-4
    )
    assert contiguous_groups(grouped) == (grouped, None)


def test_import_without_jax_or_torch(tmp_path):
    """The format modules import numpy, ml_dtypes and RE2 only (the package's
    __init__, which loads models, is bypassed here)."""
    import jaxserve

    root = jaxserve.__path__[0]
    code = f"""
import sys, types
for name, path in (("jaxserve", {root!r}), ("jaxserve.checkpoint", {root!r} + "/checkpoint")):
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
import jaxserve.quantized.formats
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "torch", "flax"))
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
