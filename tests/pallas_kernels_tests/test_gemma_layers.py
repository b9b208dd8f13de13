"""Gemma's attention variants through the Pallas kernels: a model whose layers alternate a
sliding window with full attention, all soft-capped and scaled by query_pre_attn_scalar,
gives the reference backend's logits with each kernel (interpret mode), and its step
lowers for TPU and CUDA with each layer's variant."""

import numpy as np
import pytest
from engine_utils import engine_config
from test_kernels import lower_engine_step

from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner


def _logits(path, backend):
    runner = ModelRunner(engine_config(path, page_size=8, attention_backend=backend))
    rs = np.random.RandomState(0)
    # A prefill of 21 tokens (window 6: most keys out of the window) beside a decode at
    # position 30 and a chunk after cached pages: the mixed batch the engine sends.
    work = [
        SeqWork(rs.randint(3, 128, size=21).tolist(), 0, [5, 2, 9]),
        SeqWork(rs.randint(3, 128, size=1).tolist(), 30, [1, 3, 4, 6]),
        SeqWork(rs.randint(3, 128, size=7).tolist(), 9, [7, 8]),
    ]
    return np.asarray(runner.execute(runner.build(work, all_logits=True)))[: 21 + 1 + 7]


@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_gemma2_layers_through_the_kernels_equal_the_reference(backend, hf_model_dir):
    path, hf = hf_model_dir("gemma2_window_softcap")
    assert hf.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    want = _logits(path, "reference")
    np.testing.assert_allclose(_logits(path, backend), want, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("backend,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
def test_the_gemma2_step_lowers_with_the_pallas_backend(backend, platform):
    from jaxserve.config import ModelConfig

    head_dim = 256  # Gemma's
    config = ModelConfig.from_hf(
        dict(
            architectures=["Gemma2ForCausalLM"],
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=head_dim,
            query_pre_attn_scalar=144,
            sliding_window=32,
        )
    )
    assert config.sliding_windows == (32, None) and config.attn_logit_softcap == 50.0
    lower_engine_step(config, backend, platform)


def test_reference_decode_reads_no_page_before_the_window():
    """Decode rows of a sliding-window layer start at the first block any of them sees:
    pages wholly before every row's window are poisoned with NaN and must not be read
    (a masked NaN still poisons the softmax-weighted sum)."""
    from test_reference import dense_reference, make_case

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_jit

    q_lens, kv_lens, window, page = [1, 1], [40, 50], 8, 4
    q, kv, kvl, pi, cu, ns, dense_kv = make_case(
        q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=8, page_size=page,
        pages_per_seq=16, num_pages=48,
    )  # fmt: skip
    kv = np.asarray(kv).copy()
    first_seen = min(n - window for n in kv_lens)  # 32: positions 0..31 are never seen
    kv[np.asarray(pi)[:, : first_seen // page]] = np.nan
    got = np.asarray(
        ragged_paged_attention_jit(
            q, kv, kvl, pi, cu, ns, sm_scale=0.3, sliding_window=window, pages_per_block=1
        )
    )
    want = dense_reference(q, dense_kv, q_lens, kv_lens, sm_scale=0.3, sliding_window=window)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
