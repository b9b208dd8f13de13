"""The paged, chunked path computes exactly what a dense (unpaged) forward computes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import engine_config, prompt_logits

from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner
from pallas_kernels import backends

PAGE = 8


def _dense_attention(
    queries, keys, values, kv_cache, md, *, sm_scale, sliding_window=None, soft_cap=None
):
    """Plain causal attention over this step's own tokens: one whole sequence, no pages."""
    del md
    t, n, _ = queries.shape
    k_heads = keys.shape[1]
    k = jnp.repeat(keys, n // k_heads, axis=1)
    v = jnp.repeat(values, n // k_heads, axis=1)
    s = jnp.einsum("qnh,knh->nqk", queries, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    s = jnp.where(mask[None], s, -jnp.inf)
    return jnp.einsum("nqk,knh->qnh", jax.nn.softmax(s, axis=-1), v), kv_cache


@dataclasses.dataclass(frozen=True)
class _DenseBackend(backends.AttentionBackend):
    def __call__(self, queries, keys, values, kv_cache, md, **kw):
        return _dense_attention(queries, keys, values, kv_cache, md, **kw)


@pytest.fixture
def dense_backend(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "dense", _DenseBackend("dense", None, None))
    return "dense"


@pytest.mark.parametrize(
    "case",
    [
        "mistral_sliding_window",
        "qwen2_14_to_2",
        "llama2_mha",
        "gemma2_window_softcap",  # local and global layers, soft-caps
        "qwen3_moe_top3_of_16",  # experts: each chunk routes differently
    ],
)
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_on_scrambled_pages_equals_dense(case, chunk, hf_model_dir, dense_backend):
    path, _ = hf_model_dir(case)
    prompt = np.random.RandomState(3).randint(3, 128, size=37).tolist()

    dense = ModelRunner(engine_config(path, page_size=PAGE, attention_backend=dense_backend))
    # A dense runner sees the whole prompt in one step: pad-free token count.
    want = prompt_logits(dense, prompt, list(range(1, 6)))

    runner = ModelRunner(engine_config(path, page_size=PAGE))
    pages = [41, 7, 23, 2, 60]  # scrambled physical order
    got = []
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        batch = runner.build([SeqWork(ids, start, pages)], all_logits=True)
        got.append(np.asarray(runner.execute(batch))[: len(ids)])
    np.testing.assert_allclose(np.concatenate(got), want, atol=2e-5, rtol=1e-5)
