"""Speculative decoding with a draft model: the embedded demo-model-tiny drafts for
demo-model (same tokenizer). Outputs unchanged, the draft's KV consistent after
rejections, no compilation after warm-up."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.llm import resolve_model_dir
from jaxserve.runner.draft import DraftRunner

PROMPTS = [
    "The function returns",
    "If the file does not exist,",
    "Return a list of",
    "This module provides",
    "Raise ValueError if the",
    "The default value is",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
BASE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, warmup=False)


def draft(k, **kw):
    return dict(
        speculative_config=dict(
            method="draft_model", model="demo-model-tiny", num_speculative_tokens=k, **kw
        )
    )


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**BASE, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "k, kw",
    [
        (3, {}),
        pytest.param(1, {}, marks=pytest.mark.slow),
        pytest.param(5, {}, marks=pytest.mark.slow),
        # chunked prefill, the draft catching up in chunks
        pytest.param(3, dict(max_num_batched_tokens=16, max_num_seqs=4), marks=pytest.mark.slow),
        (4, dict(debug_preemption_rate=0.3)),
        pytest.param(4, dict(num_kv_pages=20, block_size=8), marks=pytest.mark.slow),  # few pages
    ],
)
def test_greedy_output_is_unchanged_by_a_draft_model(reference, k, kw):
    llm = LLM(**{**BASE, **kw}, **draft(k))
    for _ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
    s = llm.engine.stats()
    assert 0 < s.spec_decode_num_accepted_tokens <= s.spec_decode_num_draft_tokens
    llm.engine.pool.check_invariant()
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_proposals_equal_the_draft_models_own_greedy_continuation(monkeypatch):
    """After any mix of acceptances and rejections, the draft's KV holds exactly the
    verified tokens: its proposals are what the draft model alone continues with."""
    records = []
    original = DraftRunner.propose

    def recording(self, wanted):
        snapshots = [list(seq.token_ids) for seq, _ in wanted]
        out = original(self, wanted)
        records.extend(zip(snapshots, out, strict=True))
        return out

    monkeypatch.setattr(DraftRunner, "propose", recording)
    llm = LLM(**BASE, **draft(4, disable_by_batch_size=8))
    llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    s = llm.engine.stats()
    assert s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens  # rejections
    alone = LLM("demo-model-tiny", **BASE, enable_prefix_caching=False)
    checked = records[:: max(1, len(records) // 12)]
    for tokens, proposal in checked:
        sp = SamplingParams(temperature=0.0, max_tokens=len(proposal), ignore_eos=True)
        got = alone.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)
        assert got[0].outputs[0].token_ids == proposal
    assert len(checked) >= 6


def test_seeded_sampling_is_the_same_alone_busy_or_without_speculation():
    llm = LLM(**BASE, **draft(3, disable_by_batch_size=2))
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=5, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.stats().spec_decode_num_drafts > 0
    busy = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)] * 4
    outs = llm.generate(PROMPTS[:5], [sp, *busy], use_tqdm=False)
    plain = LLM(**BASE).generate(PROMPTS[:1], sp, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone == plain[0].outputs[0].token_ids


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from hf_models import make_hf_model

    make_hf_model(tmp_path, "LlamaForCausalLM", dict(vocab_size=320))
    with pytest.raises(ValueError, match="speculative_config.model .* vocabulary of 320"):
        LLM(
            **BASE,
            speculative_config=dict(
                method="draft_model", model=str(tmp_path), num_speculative_tokens=2
            ),
        )
    assert resolve_model_dir("demo-model-tiny")  # the embedded draft resolves by name


@pytest.mark.slow
def test_no_compilation_after_warm_up_with_a_draft_model():
    llm = LLM(**{**BASE, "warmup": True}, compile_guard=True, **draft(3))
    compiled = llm.engine.runner.compiles.count
    settings = [
        GREEDY,
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, logprobs=2, seed=3),
        SamplingParams(temperature=1.0, n=2, max_tokens=20, presence_penalty=0.5),
    ]
    llm.generate(PROMPTS, [settings[i % 3] for i in range(len(PROMPTS))], use_tqdm=False)
    long_prompt = {"prompt_token_ids": list(range(5, 200))}  # catch-up in chunks
    llm.generate([long_prompt], GREEDY, use_tqdm=False)
    assert llm.engine.stats().spec_decode_num_drafts > 0
    assert llm.engine.runner.compiles.count == compiled


def test_the_kv_budget_pays_for_the_drafts_pages_too():
    from jaxserve.config import ModelConfig, engine_config

    target, tiny = resolve_model_dir("demo-model"), resolve_model_dir("demo-model-tiny")
    plain = engine_config(
        target, ModelConfig.from_pretrained(target), kv_cache_memory_bytes=1 << 24
    )
    spec = engine_config(
        target,
        ModelConfig.from_pretrained(target),
        kv_cache_memory_bytes=1 << 24,
        speculative_config=dict(method="draft_model", model=tiny, num_speculative_tokens=2),
    )
    d = ModelConfig.from_pretrained(tiny)
    draft_bytes = d.num_layers * 16 * 2 * d.num_kv_heads * d.head_dim * 4
    assert spec.kv_bytes_per_page() == plain.kv_bytes_per_page() + draft_bytes
    assert spec.num_kv_pages() < plain.num_kv_pages()
