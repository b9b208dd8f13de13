"""`jaxserve.training.Policy`: the served model's dense, differentiable forward gives
the log-probabilities the engine computes, for every attention variant (GQA,
sliding windows with soft-capping, local/global layers, experts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import SMALL_LLM_IDS

from jaxserve import LLM, SamplingParams
from jaxserve.training import Policy

PROMPTS = [[1, 5, 9, 100, 31, 7, 8, 99, 17, 3, 120, 42], [4, 4, 4, 30, 12, 13, 14, 15, 16, 1, 2, 3]]


@pytest.mark.parametrize(
    "case",
    ["qwen2_14_to_2", "gemma2_window_softcap", "gemma3_local_global_rope", "mixtral_top2_of_8"],
)
def test_policy_logprobs_are_the_engines_prompt_logprobs(hf_model_dir, case):
    path, _ = hf_model_dir(case)
    with LLM(path, **{**SMALL_LLM_IDS, "max_num_batched_tokens": 8}) as llm:  # chunked
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
            use_tqdm=False,
        )
        policy = Policy.of(llm)
        got = np.asarray(jax.jit(policy.logprobs)(Policy.state_of(llm), jnp.array(PROMPTS)))
    for out, row in zip(outs, got, strict=True):
        engine = [
            lp[t] for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True)
        ]
        np.testing.assert_allclose(row, engine, atol=2e-4, rtol=1e-4)


def test_policy_gradients_are_finite_and_shaped_as_the_state(hf_model_dir):
    path, _ = hf_model_dir("llama2_mha")
    with LLM(path, **SMALL_LLM_IDS) as llm:
        policy, state = Policy.of(llm), Policy.state_of(llm)
        grads = jax.grad(lambda s: policy.logprobs(s, jnp.array(PROMPTS)).sum())(state)
    assert jax.tree.structure(grads) == jax.tree.structure(state)
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert sum(float(jnp.abs(g).sum()) > 0 for g in leaves) == len(leaves)
