"""How much int8 weights and int8 / fp8 KV caches change the demo model: perplexity
on its held-out validation text, and greedy agreement with float32.

Bounds were set from measurement (2-core AMD EPYC, 2026-11-23); the measured
values are beside each bound.
"""

import functools

import numpy as np
import pytest
from engine_utils import demo_validation_ids, engine_config, prompt_logits

from jaxserve import LLM, SamplingParams
from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.runner.model_runner import ModelRunner

WINDOW, NUM_WINDOWS = 128, 8  # the training script's eval windows, 1,024 tokens
SETTINGS = {
    "w-int8": dict(quantization="int8"),
    "kv-int8": dict(kv_cache_dtype="int8"),
    "kv-fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
    "kv-fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
    "w-int8+kv-int8": dict(quantization="int8", kv_cache_dtype="int8"),
}


@functools.cache
def _validation_ids() -> list[int]:
    return demo_validation_ids(WINDOW * NUM_WINDOWS + 64 * 32)


def perplexity(**quant) -> float:
    ids = _validation_ids()
    path = EMBEDDED_MODELS["demo-model"]
    runner = ModelRunner(
        engine_config(path, page_size=16, num_pages=16, max_model_len=WINDOW, **quant)
    )
    nll = []
    for w in range(NUM_WINDOWS):
        window = ids[w * WINDOW : (w + 1) * WINDOW]
        logits = prompt_logits(runner, window, list(range(1, WINDOW // 16 + 1)))[:-1]
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll.extend(-logp[np.arange(WINDOW - 1), window[1:]])
    return float(np.exp(np.mean(nll)))


@functools.cache
def _float32_perplexity() -> float:
    return perplexity()


# Measured ratio to float32 (perplexity 48.33 on these 1,024 tokens): int8 weights
# 1.0009, int8 KV 0.9997, fp8 e4m3 KV 0.9982, fp8 e5m2 KV 1.0016, int8 weights + KV
# 1.0017. Bound: 2% (the issue's).
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_perplexity_within_two_percent_of_float32(name):
    base = _float32_perplexity()
    assert 40 < base < 80  # the demo model's (58.3 over the whole validation split)
    ratio = perplexity(**SETTINGS[name]) / base
    assert abs(ratio - 1) < 0.02, f"{name}: perplexity ratio {ratio:.4f}"


# Of 16 prompts (32 validation tokens each): the share whose first 32 greedy tokens
# equal float32's, and the mean index of the first differing token (32: none).
# Measured: int8 KV 0.875 / 31.3, int8 weights 0.50 / 24.4, int8 weights + KV
# 0.69 / 28.8, fp8 e4m3 KV 0.56 / 24.9, fp8 e5m2 KV (two mantissa bits) 0.19 / 19.1.
# A 4M-parameter model's top two logits are often close, and one flipped token
# changes the rest of the run, so the bounds sit a little below the measurements.
AGREEMENT_BOUNDS = {  # name: (share of prompts, mean first differing token)
    "kv-int8": (0.75, 28),
    "w-int8": (0.4, 20),
    "w-int8+kv-int8": (0.5, 22),
    "kv-fp8_e4m3": (0.4, 20),
    "kv-fp8_e5m2": (0.1, 14),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(AGREEMENT_BOUNDS))
def test_greedy_agreement_over_32_tokens(name):
    want, got = _greedy(), _greedy(**SETTINGS[name])
    same = np.mean([a == b for a, b in zip(want, got, strict=True)])
    first_diff = np.mean(
        [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 32)
            for a, b in zip(want, got, strict=True)
        ]
    )
    min_same, min_first_diff = AGREEMENT_BOUNDS[name]
    assert same >= min_same and first_diff >= min_first_diff, (name, same, first_diff)


@functools.cache
def _greedy(**quant) -> list[list[int]]:
    """First 32 greedy tokens after each of 16 prompts of 32 validation tokens."""
    ids = _validation_ids()[WINDOW * NUM_WINDOWS :]
    prompts = [{"prompt_token_ids": ids[i * 64 : i * 64 + 32]} for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(max_model_len=128, max_num_seqs=16, warmup=False, **quant)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
