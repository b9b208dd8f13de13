"""Tensor parallelism through the engine (`LLM(tensor_parallel_size=N)`) on 8 fake CPU
devices: greedy tokens, logprobs and seeded samples equal one device's
(`tp_engine_check.py` runs in a subprocess)."""

import pytest
from fake_devices import run_on_8_devices
from hf_models import CASES, make_hf_model

# (architecture case, config overrides, TP sizes, scenario): every registered
# architecture under TP; the odd shapes under every size and every feature.
QWEN_ODD = dict(vocab_size=131)  # a vocabulary no TP size divides (the LM head replicated)
RUNS = [
    # 14 query / 2 KV heads: fewer KV heads than 4 and 8, the KV cache replicated.
    ("qwen2_14_to_2", QWEN_ODD, "2,4,8", "basic"),
    ("qwen2_14_to_2", QWEN_ODD, "4", "stress"),
    ("qwen2_14_to_2", QWEN_ODD, "8", "ngram"),
    # 4 KV heads: split over 2 and 4, replicated over 8.
    ("llama2_mha", {}, "2,8", "stress"),
    ("llama2_mha", {}, "4", "draft"),
    ("llama2_mha", {}, "2", "async_tier"),
    ("qwen2_14_to_2", QWEN_ODD, "4", "async_tier_int8"),
    ("llama2_mha", {}, "4", "async_tier_int8"),
    ("llama2_mha", {}, "2", "guard"),
    # int8 weights: the vocabulary (tied, 131 rows) replicated, the projections split.
    ("qwen2_14_to_2", QWEN_ODD, "2,4", "int8,int8_orbax"),
    ("llama2_mha", {}, "4", "int8"),
    ("llama3_gqa_rope_scaling", {}, "2", "basic"),
    ("mistral_sliding_window", {}, "2", "basic"),
    ("qwen3_head_dim_mismatch", {}, "2", "basic"),
    ("gemma2_window_softcap", {}, "2", "basic"),
    ("gemma3_local_global_rope", {}, "2", "basic"),
    ("mixtral_top2_of_8", {}, "4", "basic"),
    # int4 experts split 4 a device (expert parallelism); o_proj's 256 inputs in 2 groups.
    ("mixtral_top2_of_8", dict(hidden_size=256), "2", "int4"),
    ("qwen3_moe_top3_of_16", {}, "4", "basic"),
    ("qwen2_moe_shared_expert", {}, "2", "basic"),
    # Latent attention: the heads split, the one-row shared cache replicated.
    ("deepseek_v3_mla", {}, "2", "stress"),
    ("deepseek_v3_mla", {}, "4", "async_tier_int8"),
]


@pytest.mark.sharded
@pytest.mark.slow
@pytest.mark.parametrize(
    "case,overrides,tps,scenario", RUNS, ids=[f"{r[0]}-{r[3]}-tp{r[2]}" for r in RUNS]
)
def test_tensor_parallel_engine_equals_one_device(case, overrides, tps, scenario, tmp_path):
    arch, base = CASES[case]
    make_hf_model(tmp_path, arch, {**base, **overrides})
    stdout = run_on_8_devices("tp_engine_check.py", tmp_path, tps, scenario)
    for name in scenario.split(","):
        for tp in tps.split(","):
            assert f"{name} tp={tp}: " in stdout, stdout
