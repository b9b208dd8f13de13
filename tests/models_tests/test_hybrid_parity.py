"""A hybrid KV cache on real models: Gemma 2 and Gemma 3 shaped checkpoints with small
windows (8 and 16 tokens, pages of 4 and 8), generating several windows past the
window, with chunked prefill, prefix caching and random preemption on.

The greedy tokens match transformers' on the same weights, and are the same tokens
as the engine's with every layer's pages kept (`disable_hybrid_kv_cache_manager`):
a freed page's table entry is the null page, which only masked positions read.
While the sequences run, the windowed group's pool gets its pages back.
"""

import numpy as np
import pytest
import torch
from engine_utils import engine_config, prompt_logits
from hf_models import BASE, make_hf_model
from test_hf_parity import _hf_logits, check_outputs_close

from jaxserve.config import kv_groups as kvg
from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams

CASES = {
    # Gemma 2: local and global layers alternate; window 8 over pages of 4.
    "gemma2": (
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
        ),
        4,
    ),
    # Gemma 3: five local layers, then a global one; window 16 over pages of 8.
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
                full_attention=dict(rope_type="default", rope_theta=5000.0),
            ),
        ),
        8,
    ),
}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for name, (arch, overrides, _) in CASES.items():
        path = tmp_path_factory.mktemp(name)
        made[name] = (str(path), make_hf_model(path, arch, overrides))
    return made


def _prompts(vocab: int) -> list[list[int]]:
    """Five prompts of 21 to 45 tokens, three sharing a 24-token prefix (prefix hits)."""
    rs = np.random.RandomState(7)
    shared = rs.randint(3, vocab, size=24).tolist()
    own = [rs.randint(3, vocab, size=n).tolist() for n in (21, 9, 14, 45, 30)]
    return [own[0], shared + own[1], shared + own[2], own[3], shared + own[4]]


def _engine(path: str, page: int, **kw) -> LLMEngine:
    config = engine_config(
        path,
        page_size=page,
        num_pages=48,  # every group's: a few sequences' worth, so preemption bites
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=16,  # chunked prefill
        debug_preemption_rate=0.05,
        **kw,
    )
    return LLMEngine(config)


def _generate(engine: LLMEngine, prompts, on_step=None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), p, params))
    done = {}
    kv = engine.scheduler.kv
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        kv.check_invariant(engine.scheduler.running)
        if on_step is not None:
            on_step(engine)
    for pool in kv.pools:
        pool.check_invariant()
        assert pool.num_free == pool.capacity
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_hybrid_greedy_matches_transformers_and_frees_pages(case, checkpoints):
    path, hf = checkpoints[case]
    page = CASES[case][2]
    window = CASES[case][1]["sliding_window"]
    prompts = _prompts(BASE["vocab_size"])

    engine = _engine(path, page)
    kv = engine.scheduler.kv
    assert [kv.windows[g] for g in range(len(kv.pools))] == [None, window]
    per_seq = kvg.peak_pages(window, page, engine.config.pages_per_seq, chunk=16)
    mid = []

    def on_step(engine):
        running = engine.scheduler.running
        used = kv.pools[1].capacity - kv.pools[1].num_free
        assert used <= per_seq * len(running)  # a window and a chunk each, at most
        for seq in running:
            if seq.num_computed >= 3 * window:  # well past the window: pages gone back
                table = seq.group_pages[0]
                mid.append((seq.num_computed, table.count(0), len(table)))
                assert table.count(0) >= (seq.num_computed - window) // page - 1

    ours = _generate(engine, prompts, on_step)
    assert mid, "no sequence ran three windows past its start"
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_hits > 0
    # Again, now mostly from the prefix cache (windowed hits take the window only).
    again = _generate(engine, prompts)
    assert again == ours

    # Every page kept: the same tokens.
    dense = _engine(path, page, disable_hybrid_kv_cache_manager=True)
    assert len(dense.scheduler.kv.pools) == 1
    assert _generate(dense, prompts) == ours

    # Logits of a whole prefix in one step, where the outputs part at a near tie.
    runner = ModelRunner(engine_config(path, page_size=page, max_num_batched_tokens=128))
    for prompt, out in zip(prompts, ours, strict=True):
        with torch.no_grad():
            theirs = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        pages = list(range(1, 1 + -(-(len(prompt) + MAX_TOKENS) // page)))
        check_outputs_close(
            out,
            theirs,
            lambda ids, pages=pages: prompt_logits(runner, ids, pages),
            lambda ids: _hf_logits(hf, ids),
            prompt,
        )
