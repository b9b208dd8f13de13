"""4-bit checkpoints as users download them (AWQ GEMM, GPTQ, compressed-tensors W4A16),
served without a quantization argument: a tiny random Llama and Qwen2 whose linears are
packed in each format's storage (`jaxserve.quantized.formats.pack`) give the greedy
tokens, and first-step logprobs within 2e-2, of transformers running the dequantized
weights; LoRA adapters over them as PEFT's over the dequantized weights; and the
refusals (another quantization asked for, formats not served yet, a tensor-parallel
split inside a checkpoint's group)."""

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from engine_utils import SMALL_LLM, engine_config
from flax import nnx
from hf_models import BASE, check_like_reference, hf_greedy, tiny_causal_lms
from lora_utils import check_adapter_over_quantized
from safetensors.numpy import save_file

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import load_model
from jaxserve.config import ModelConfig
from jaxserve.quantized.formats import dequantize, pack, read_quantization_config, unpack
from jaxserve.quantized.served import checkpoint_format
from models.int4 import Int4Linear

PROMPTS = [[5, 17, 99, 3, 42, 8], [11, 60, 7, 21, 30, 2, 64, 90, 13, 1, 77]]
MAX_TOKENS = 8
SHAPES = dict(BASE, hidden_size=128, intermediate_size=256, tie_word_embeddings=False)


def awq(group):
    return dict(quant_method="awq", bits=4, group_size=group, version="gemm", zero_point=True)


def gptq(sym, desc_act, bits=4):
    return dict(quant_method="gptq", bits=bits, group_size=32, sym=sym, desc_act=desc_act)


def ct(strategy, sym):
    weights = dict(num_bits=4, type="int", symmetric=sym, strategy=strategy, dynamic=False)
    if strategy == "group":
        weights["group_size"] = 64
    return dict(
        quant_method="compressed-tensors",
        format="pack-quantized",
        quantization_status="compressed",
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        ignore=["lm_head"],
    )


# (case, architecture, quantization_config): the two models take turns.
CASES = [
    ("awq_g32", "LlamaForCausalLM", awq(32)),
    ("awq_g64", "Qwen2ForCausalLM", awq(64)),
    ("awq_g128", "LlamaForCausalLM", awq(128)),
    ("gptq_sym", "Qwen2ForCausalLM", gptq(True, False)),
    ("gptq_asym", "LlamaForCausalLM", gptq(False, False)),
    ("gptq_sym_desc_act", "LlamaForCausalLM", gptq(True, True)),
    ("gptq_asym_desc_act", "Qwen2ForCausalLM", gptq(False, True)),
    ("ct_group_sym", "LlamaForCausalLM", ct("group", True)),
    ("ct_group_asym", "Qwen2ForCausalLM", ct("group", False)),
    ("ct_channel_sym", "Qwen2ForCausalLM", ct("channel", True)),
    ("ct_channel_asym", "LlamaForCausalLM", ct("channel", False)),
]


@pytest.fixture(scope="module")
def float_models():
    """Architecture -> a tiny random transformers model (float32, untied LM head)."""
    return tiny_causal_lms(("LlamaForCausalLM", "Qwen2ForCausalLM"), SHAPES)


def write_checkpoint(path, model, qc: dict, seed: int = 0) -> dict:
    """`model` with its decoder linears in `qc`'s storage, written to `path`
    (model.safetensors, config.json); returns the dequantized state dict (what
    transformers runs for reference). desc_act: each linear's inputs in shuffled groups."""
    fmt = read_quantization_config({"quantization_config": qc})
    rs = np.random.RandomState(seed)
    tensors, reference = {}, {}
    for name, t in model.state_dict().items():
        w = t.numpy()
        module = name.removesuffix(".weight")
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            o, i = w.shape
            g_idx = None
            if fmt.desc_act:
                g_idx = rs.permutation(np.arange(i) // fmt.group_size).astype(np.int32)
            packed = pack(w, fmt, g_idx=g_idx)
            tensors.update({f"{module}.{k}": np.ascontiguousarray(v) for k, v in packed.items()})
            w = dequantize(unpack(packed, fmt, o, i))
        else:
            tensors[name] = np.ascontiguousarray(w)
        reference[name] = torch.from_numpy(w)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return reference


@pytest.fixture(scope="module")
def checkpoints(float_models, tmp_path_factory):
    """Case -> (directory, the transformers reference per prompt), written once."""
    out = {}
    for seed, (case, arch, qc) in enumerate(CASES):
        model = float_models[arch]
        path = tmp_path_factory.mktemp(case)
        reference = write_checkpoint(path, model, qc, seed)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        out[case] = (str(path), [hf_greedy(model, reference, p, MAX_TOKENS) for p in PROMPTS])
        model.load_state_dict(saved)
    return out


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_served_like_dequantized_weights(case, checkpoints):
    path, want = checkpoints[case]
    llm = LLM(model=path, skip_tokenizer_init=True, **SMALL_LLM)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    check_like_reference(outs, want, case)


@pytest.mark.parametrize("case", ["awq_g32", "gptq_asym_desc_act", "ct_group_sym"])
def test_lora_adapters_over_4bit_checkpoints_serve_as_peft_over_the_dequantized_weights(
    case, float_models, tmp_path
):
    """QLoRA-style serving: the base stays 4-bit (zero points, desc_act's input order,
    compressed-tensors' groups), the adapter in float beside it."""
    _, arch, qc = next(c for c in CASES if c[0] == case)
    base = copy.deepcopy(float_models[arch])
    reference = write_checkpoint(tmp_path / "ckpt", base, qc)
    base.load_state_dict(reference)
    check_adapter_over_quantized(str(tmp_path / "ckpt"), base, PROMPTS, MAX_TOKENS, tmp_path, case)


@pytest.mark.parametrize("case", ["awq_g64", "gptq_asym_desc_act", "ct_channel_asym"])
def test_loaded_layers(case, checkpoints):
    """Each decoder linear an `Int4Linear` of the checkpoint's groups (zero points where
    the format has them, an input order for desc_act); embedding and LM head float."""
    path, _ = checkpoints[case]
    config = ModelConfig.from_pretrained(path)
    model = load_model(path, config)
    layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Int4Linear)]
    assert len(layers) == 7 * SHAPES["num_hidden_layers"]
    fmt = checkpoint_format(config)
    for layer in layers:
        assert layer.kernel.dtype == jnp.int4
        assert layer.group_size == (fmt.group_size or layer.kernel.shape[1])
        assert (layer.zero is None) == fmt.symmetric
        assert (layer.perm is None) == (not fmt.desc_act)
    assert isinstance(model.lm_head, nnx.Linear) and isinstance(model.model.embed_tokens, nnx.Embed)


def test_checkpoint_config(checkpoints):
    """The model's quantization is the checkpoint's; vLLM's names for it are accepted,
    another is refused naming both; a format name on a float checkpoint is refused."""
    awq_dir, _ = checkpoints["awq_g32"]
    assert engine_config(awq_dir).quantization == "awq"
    assert engine_config(awq_dir, quantization="awq").quantization == "awq"
    assert engine_config(awq_dir, quantization="awq_marlin").quantization == "awq"
    gptq_dir, _ = checkpoints["gptq_sym"]
    assert engine_config(gptq_dir, quantization="gptq_marlin").quantization == "gptq"
    ct_dir, _ = checkpoints["ct_group_sym"]
    c = engine_config(ct_dir, quantization="compressed-tensors")
    assert c.quantization == "compressed-tensors" and checkpoint_format(c.model).bits == 4
    for asked in ("int8", "int4", "gptq"):
        with pytest.raises(ValueError, match=f"quantization='{asked}', but .* as 'awq'"):
            engine_config(awq_dir, quantization=asked)


def test_format_name_on_float_checkpoint(hf_model_dir):
    path, _ = hf_model_dir("llama2_mha")
    with pytest.raises(ValueError, match="quantization='awq' reads a checkpoint stored in"):
        engine_config(path, quantization="awq")


@pytest.mark.parametrize(
    "qc, message",
    [
        (gptq(True, False, bits=8), r"'gptq', gptq, 8-bit weights\): not served yet"),
        (
            dict(
                ct("channel", True),
                config_groups={
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                    }
                },
            ),
            r"'compressed-tensors', compressed-tensors-int, 8-bit weights\): not served yet",
        ),
        (dict(quant_method="bitsandbytes"), "quant_method: 'bitsandbytes' is not served"),
    ],
)
def test_not_served_yet(qc, message, float_models, tmp_path):
    config = {
        **float_models["LlamaForCausalLM"].config.to_dict(),
        "architectures": ["LlamaForCausalLM"],
    }
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match=message):
        engine_config(str(tmp_path))


def test_tensor_parallel_split_inside_a_group(checkpoints):
    """The TP check takes the checkpoint's groups: channel-wise scales (one group of
    all inputs) cannot split a row-parallel linear; AWQ's groups of 32 can."""
    ct_dir, _ = checkpoints["ct_channel_sym"]
    with pytest.raises(ValueError, match=r"groups of \d+ inputs \(1 group\)"):
        engine_config(ct_dir, tensor_parallel_size=2)
    awq_dir, _ = checkpoints["awq_g32"]
    assert engine_config(awq_dir, tensor_parallel_size=2).parallel.tensor_parallel_size == 2


def test_new_weights_for_a_4bit_checkpoint_are_refused_and_it_serves_on(checkpoints):
    """update_weights on another tool's 4-bit checkpoint is refused before anything is
    read, naming why; the engine serves on with its weights (it used to fail deep in the
    conversion, which assumed jaxserve's own quantizations)."""
    path, want = checkpoints["awq_g64"]
    llm = LLM(model=path, skip_tokenizer_init=True, **SMALL_LLM)
    with pytest.raises(ValueError, match="quantized checkpoint's 4-bit codes"):
        llm.update_weights(path=path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want[0][0]
    llm.close()


def test_a_float_draft_behind_a_4bit_checkpoint_is_not_checked_as_4bit(
    checkpoints, float_models, tmp_path
):
    """A float draft model behind an AWQ target loads as it is (float), so the TP group
    check leaves it alone: it refused the pair, checking the draft as if quantized to
    int4 on the fly (its o_proj, one group of 128 inputs, cut in two)."""
    awq_dir, _ = checkpoints["awq_g32"]
    draft = tmp_path / "draft"
    float_models["LlamaForCausalLM"].save_pretrained(draft)
    spec = dict(method="draft_model", model=str(draft), num_speculative_tokens=2)
    config = engine_config(awq_dir, tensor_parallel_size=2, speculative_config=spec)
    assert config.speculative.draft is not None


@pytest.mark.parametrize("target", ["h100", "v5e"])
@pytest.mark.parametrize("case", ["awq_g64", "gptq_asym_desc_act"])
def test_checkpoint_steps_compile_for_a_gpu_and_a_tpu(case, target, checkpoints):
    """A 4-bit checkpoint's warm-up programs (zero points; desc_act's input order)
    compile deviceless for the target, the codes still int4 (s4) in the decode step."""
    from test_device_compile import build, check

    path, _ = checkpoints[case]
    engine = build(path, target, max_model_len=256)  # (the tiny models' positions)
    check(engine, target)
    assert "s4[" in engine.compiled["forward T=1"].as_text()
