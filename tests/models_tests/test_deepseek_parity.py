"""DeepSeek-V2/V3 (`models.deepseek`) against transformers on the same random weights.

Small odd configs cover: q_lora_rank and none; v_head_dim (20) != qk_nope_head_dim
(24); V3's grouped sigmoid routing with the score-correction bias, shared experts and
a dense first layer; V2's softmax routing, greedy (V2-Lite's shape) and
group-limited; rope dimensions in pairs and in halves; YaRN with mscale !=
mscale_all_dim (the softmax scale and the cos/sin scale both move). For each: the
prompt's logits, computed in the absorbed form over the paged cache, within
atol 2e-4 / rtol 1e-4 of transformers' (float32; measured ~2e-6), and `LLM`'s greedy
tokens equal to transformers' `generate` with chunked prefill (a prompt longer than
the step's budget, two requests at once) and again with every prompt's full pages
in the prefix cache.

One engine per config, shared by the module's tests (module-scoped fixture).
"""

import importlib
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from engine_utils import engine_config, prompt_logits

from jaxserve.config import ModelConfig
from jaxserve.llm import LLM
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from models.moe import route_grouped

PAGE = 8
LATENT, ROPE = 32, 16  # kv_lora_rank, qk_rope_head_dim: the cache's one KV head is 48 wide
BASE = dict(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    kv_lora_rank=LATENT,
    qk_rope_head_dim=ROPE,
    qk_nope_head_dim=24,
    v_head_dim=20,
    n_routed_experts=8,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
CASES = {
    # V3 as released, small: q_lora_rank; 3 of 8 experts from 2 of 4 groups, chosen
    # with the correction bias and weighed without it, renormalised, times 2.5; one
    # shared expert; layer 0 dense; rope in pairs.
    "v3_grouped_routing": (
        "DeepseekV3ForCausalLM",
        dict(
            q_lora_rank=48,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
    # V3 without q_lora_rank, 6 heads, 3 layers, rope in halves, YaRN (4x over 64
    # positions; mscale != mscale_all_dim), weights not renormalised, 2 shared experts.
    "v3_yarn_no_q_lora": (
        "DeepseekV3ForCausalLM",
        dict(
            q_lora_rank=None,
            hidden_size=96,
            num_attention_heads=6,
            num_hidden_layers=3,
            rope_interleave=False,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        ),
    ),
    # V2-Lite's shape: no q_lora_rank, softmax top-6 of 64 greedy, unnormalised, two
    # shared experts, the first layer dense (here 3 of 8).
    "v2_lite": (
        "DeepseekV2ForCausalLM",
        dict(
            q_lora_rank=None,
            num_experts_per_tok=3,
            n_shared_experts=2,
            topk_method="greedy",
        ),
    ),
    # V2: q_lora_rank, group-limited greedy (2 of 4 groups), routed_scaling_factor,
    # biases on q_a_proj, kv_a_proj_with_mqa and o_proj.
    "v2_group_limited": (
        "DeepseekV2ForCausalLM",
        dict(
            q_lora_rank=40,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            n_shared_experts=1,
            topk_method="group_limited_greedy",
            routed_scaling_factor=4.0,
            attention_bias=True,
        ),
    ),
}
MAX_BATCHED = 32  # the step's token budget
# Logits: shorter than a page, and several pages with a partial last one.
LOGITS_PROMPT_LENS = (5, 21)
# Generation: two requests, the second longer than the budget (chunked prefill).
PROMPT_LENS = (13, 45)
MAX_TOKENS = 16


def make_deepseek(path: str, arch: str, overrides: dict, *, seed: int = 0):
    """A random transformers DeepSeek model, its norms, biases and V3's expert score
    correction (a buffer) perturbed so that they matter, saved HF-style."""
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**{**BASE, **overrides})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)._from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, LLM) of one config."""
    arch, overrides = CASES[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_deepseek(path, arch, overrides)
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        block_size=PAGE,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=MAX_BATCHED,
        num_kv_pages=64,
        # The file's runtime is its compilations, four models' worth: one forward
        # program (every step padded to the budget), and sampling programs without
        # what greedy rows do not use (the host leaves it out).
        min_token_bucket=MAX_BATCHED,
        sampling_branches="host",
        warmup=False,
        compilation_cache_dir=None,
    )
    yield request.param, hf, llm
    llm.close()


def _prompts(lens: tuple[int, ...], seed: int) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [rs.randint(3, BASE["vocab_size"], size=n).tolist() for n in lens]


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_prompt_logits_match_transformers(case):
    name, hf, llm = case
    runner = llm.engine.runner
    for ids in _prompts(LOGITS_PROMPT_LENS, 0):
        ours = prompt_logits(runner, ids, list(range(1, 1 + -(-len(ids) // PAGE))))
        np.testing.assert_allclose(
            ours, _hf_logits(hf, ids), atol=2e-4, rtol=1e-4, err_msg=f"{name}, {len(ids)} tokens"
        )
    # Those pages were written outside the engine's page pool: forget what it cached.
    assert llm.reset_prefix_cache()


def test_greedy_tokens_match_transformers_with_chunks_and_prefix_hits(case):
    name, hf, llm = case
    prompts = _prompts(PROMPT_LENS, 1)
    theirs = []
    for p in prompts:
        with torch.no_grad():
            # No EOS: it neither ends the output nor is suppressed (as ignore_eos).
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        theirs.append(out[0, len(p) :].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    for run in ("cold", "prefix hits"):
        outs = llm.generate(requests, params, use_tqdm=False)
        ours = [list(o.outputs[0].token_ids) for o in outs]
        assert ours == theirs, f"{name} ({run})"
        cached = [o.num_cached_tokens for o in outs]
        if run == "prefix hits":  # every full page of each prompt but the last token's
            assert cached == [(len(p) - 1) // PAGE * PAGE for p in prompts], cached


ROUTERS = {
    "v3_grouped": ("DeepseekV3ForCausalLM", dict(n_group=4, topk_group=2, num_experts_per_tok=4)),
    "v3_unnormalised": (
        "DeepseekV3ForCausalLM",
        dict(n_group=2, topk_group=1, num_experts_per_tok=3, norm_topk_prob=False),
    ),
    "v2_greedy": ("DeepseekV2ForCausalLM", dict(topk_method="greedy", num_experts_per_tok=3)),
    "v2_group_limited": (
        "DeepseekV2ForCausalLM",
        dict(
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            num_experts_per_tok=5,
            routed_scaling_factor=16.0,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_routing_matches_transformers_router(name):
    """`route_grouped` on transformers' router logits, 256 tokens over 16 experts: the
    same experts (as sets: torch's topk is unordered) with the same weights, the
    config read as `ModelConfig.from_hf` reads config.json."""
    arch, fields = ROUTERS[name]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        **{**BASE, "n_routed_experts": 16, **fields}
    )
    family = arch.removesuffix("ForCausalLM")  # DeepseekV3
    package = family.lower().replace("v", "_v")  # deepseek_v3
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    router = getattr(module, f"{family}TopkRouter")(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(std=0.3)
        logits, their_weights, their_ids = router(torch.randn(256, config.hidden_size))
    moe = ModelConfig.from_hf({**config.to_dict(), "architectures": [arch]}).moe
    bias = getattr(router, "e_score_correction_bias", None)
    ids, weights = route_grouped(
        jnp.asarray(logits.numpy()),
        moe.top_k,
        topk_method=moe.topk_method,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=moe.routed_scaling_factor,
        correction_bias=None if bias is None else jnp.asarray(bias.numpy()),
    )
    ours = np.argsort(np.asarray(ids), axis=-1)
    theirs = np.argsort(their_ids.numpy(), axis=-1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(ids), ours, -1),
        np.take_along_axis(their_ids.numpy(), theirs, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), ours, -1),
        np.take_along_axis(their_weights.numpy(), theirs, -1),
        rtol=1e-6,
    )


def test_kv_bytes_per_token_are_the_latents(tmp_path_factory):
    """The engine sizes its pool by layers x (kv_lora_rank + qk_rope_head_dim) x bytes
    per token: one row of the latent and the rope key, the key and the value at once
    (a shared cache; its first version stored a V row beside it, twice the minimum),
    a tiny fraction of the expanded heads' K and V. A quantized cache adds one float32
    scale a row."""
    arch, overrides = CASES["v3_grouped_routing"]
    path = str(tmp_path_factory.mktemp("kv_bytes"))
    make_deepseek(path, arch, overrides)
    m = ModelConfig.from_pretrained(path)
    assert (m.num_kv_heads, m.head_dim) == (1, LATENT + ROPE)
    per_token = BASE["num_hidden_layers"] * (LATENT + ROPE) * 4  # float32
    budget = 40 * PAGE * per_token + 100
    config = engine_config(path, page_size=PAGE, num_pages=None, kv_cache_memory_bytes=budget)
    assert config.kv_bytes_per_page() == PAGE * per_token
    assert config.num_kv_pages() == 40
    int8 = engine_config(path, page_size=PAGE, kv_cache_dtype="int8")
    assert int8.kv_bytes_per_page() == PAGE * BASE["num_hidden_layers"] * (LATENT + ROPE + 4)
    expanded = BASE["num_hidden_layers"] * 2 * 4 * (24 + ROPE) * 4  # 4 heads' K, V of 40
    assert per_token < expanded


# Quantized weights and KV against float32 transformers: the largest logit error as a
# fraction of the largest |logit|, and the share of positions whose top token agrees.
# Measured without experts (layers all dense: a random router's near-ties move tokens
# to other experts and hide the attention's error), 2-core AMD EPYC, 2026-11-30, v3 /
# v3 YaRN configs: int8 weights 0.025 / 0.038, int8 KV 0.012 / 0.022, fp8 weights
# 0.094 / 0.153, fp8 KV 0.055 / 0.082 (a Llama of the same size: 0.025, 0.012, 0.082,
# 0.041). Weights and KV together, here: int8 0.031 (top-1 0.96), fp8 0.114 (1.0).
QUANTIZED = {"int8": (0.1, 0.9), "fp8": (0.25, 0.85)}
WEIGHT_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}


@pytest.mark.parametrize("method", sorted(QUANTIZED))
def test_quantized_weights_and_latent_cache_stay_close(method, tmp_path_factory):
    arch, overrides = CASES["v3_grouped_routing"]
    path = str(tmp_path_factory.mktemp(f"quantized_{method}"))
    hf = make_deepseek(path, arch, {**overrides, "first_k_dense_replace": 2})
    runner = ModelRunner(
        engine_config(path, page_size=PAGE, quantization=method, kv_cache_dtype=method)
    )
    assert WEIGHT_DTYPES[method] in {str(w.dtype) for w in runner.weights}
    errors, agree = [], []
    for ids in _prompts(LOGITS_PROMPT_LENS, 0):
        ours = prompt_logits(runner, ids, list(range(1, 1 + -(-len(ids) // PAGE))))
        theirs = _hf_logits(hf, ids)
        errors.append(np.abs(ours - theirs).max() / np.abs(theirs).max())
        agree.extend(ours.argmax(-1) == theirs.argmax(-1))
    print(f"{method}: max relative error {max(errors):.4f}, top-1 {np.mean(agree):.3f}")
    bound, top1 = QUANTIZED[method]
    assert max(errors) < bound and np.mean(agree) >= top1, (max(errors), np.mean(agree))


def _refusal(path: str, **kw) -> str:
    with pytest.raises(ValueError) as e:
        engine_config(path, page_size=PAGE, **kw)
    return str(e.value)


def test_what_is_not_served_is_refused_at_start_up(tmp_path_factory):
    arch, overrides = CASES["v2_lite"]
    path = str(tmp_path_factory.mktemp("refused"))
    make_deepseek(path, arch, overrides)
    assert "enable_lora" in _refusal(path, enable_lora=True)
    assert "quantization='int4'" in _refusal(path, quantization="int4")
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        hf = json.load(f)
    for field, value in (
        ("norm_topk_prob", True),  # transformers' V2 ignores it; DeepSeek's code does not
        ("moe_layer_freq", 2),
        ("topk_method", "noaux_tc"),
        ("scoring_func", "sigmoid"),
    ):
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf({**hf, field: value})
    v3 = {**hf, "architectures": ["DeepseekV3ForCausalLM"], "topk_method": "group_limited_greedy"}
    with pytest.raises(ValueError, match="topk_method"):
        ModelConfig.from_hf(v3)
    # DeepSeek-V3's own checkpoint: fp8 blocks.
    fp8 = dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128])
    with open(config_file, "w") as f:
        json.dump({**hf, "quantization_config": fp8}, f)
    assert "quantized checkpoint" in _refusal(path)
