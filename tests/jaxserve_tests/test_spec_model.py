"""Speculative decoding with a real (tiny) model: greedy outputs unchanged, seeds
reproducible, no compilation after warm-up, and the rejection rule exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import make_hf_model
from test_engine import make_llm, shared_prefix_prompts

from jaxserve import SamplingParams
from jaxserve.runner import sampler
from jaxserve.runner.input_batch import SampleRow, build_sampling


def ngram(k, **kw):
    return dict(speculative_config=dict(method="ngram", num_speculative_tokens=k, **kw))


def repetitive_prompts(seed=0):
    """Prompts that quote themselves, so n-gram lookup has something to propose."""
    rs = np.random.RandomState(seed)
    out = []
    for n in (5, 9, 14, 20):
        span = rs.randint(3, 320, size=n).tolist()
        out.append({"prompt_token_ids": span + [7] + span + [7] + span[: n // 2]})
    return out + shared_prefix_prompts(seed)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    outs = llm.generate(repetitive_prompts(), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "k, kw",
    [
        (1, {}),
        (3, {}),
        (5, {}),
        (3, dict(max_num_batched_tokens=16, max_num_seqs=4)),  # chunked prefill
        (3, dict(debug_preemption_rate=0.3)),
        (5, dict(num_kv_pages=14)),  # short of pages: drafts dropped, then preemption
    ],
)
def test_greedy_output_is_unchanged_by_speculation(tiny_model_dir, reference, k, kw):
    llm = make_llm(tiny_model_dir, **ngram(k), **kw)
    for _ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(repetitive_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
    s = llm.engine.stats()
    assert s.spec_decode_num_accepted_tokens > 0
    llm.engine.pool.check_invariant()
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_seeded_sampling_is_the_same_alone_busy_or_without_speculation(tiny_model_dir):
    """Alone the request speculates; in the busy batch (more than 2 running) it does
    not; without speculation it never does: the same tokens all three ways."""
    llm = make_llm(tiny_model_dir, **ngram(3, disable_by_batch_size=2))
    prompts = repetitive_prompts(1)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=11, ignore_eos=True)
    alone = llm.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.stats().spec_decode_num_drafts > 0
    busy = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * (len(prompts) - 1)
    outs = llm.generate(prompts, [sp, *busy], use_tqdm=False)
    plain = make_llm(tiny_model_dir).generate(prompts[:1], sp, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone == plain[0].outputs[0].token_ids


@pytest.mark.slow
def test_no_compilation_after_warm_up_with_speculation(tiny_model_dir):
    llm = make_llm(
        tiny_model_dir,
        warmup=True,
        compile_guard=True,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        **ngram(3),
    )
    compiled = llm.engine.runner.compiles.count
    settings = [
        GREEDY,
        SamplingParams(temperature=0.7, top_k=5, max_tokens=12, logprobs=2, seed=3),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, n=2, max_tokens=9),
    ]
    prompts = repetitive_prompts(2)
    llm.generate(prompts, [settings[i % 3] for i in range(len(prompts))], use_tqdm=False)
    assert llm.engine.stats().spec_decode_num_drafts > 0
    assert llm.engine.runner.compiles.count == compiled


def test_logprobs_and_stop_strings_with_speculation(tiny_model_dir):
    plain = make_llm(tiny_model_dir)
    spec = make_llm(tiny_model_dir, **ngram(4))
    prompts = repetitive_prompts(3)
    text = plain.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3, stop=[stop])
    want = plain.generate(prompts, sp, use_tqdm=False)
    got = spec.generate(prompts, sp, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason)
        for lw, lg in zip(w.logprobs, g.logprobs, strict=True):
            assert lw.keys() == lg.keys()
            np.testing.assert_allclose(list(lg.values()), list(lw.values()), atol=1e-4)
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0


# ------------------------------------------------------------ the rejection rule


def broken_always_accept(x, draft, noise):
    tokens, _ = sampler.verify(x, draft, noise)
    return jnp.where(draft >= 0, draft, tokens), draft >= 0


def broken_draft_not_excluded(x, draft, noise):
    """Accepts with probability p(draft) (a uniform from the noise of the last token),
    but on rejection draws from p itself, the draft included: p(draft) comes out high."""
    uniform = jnp.exp(-jnp.exp(-noise[:, -1]))  # the Gumbel CDF of a Gumbel: uniform
    p_draft = jnp.take_along_axis(jax.nn.softmax(x, -1), jnp.maximum(draft, 0)[:, None], -1)
    accepted = (draft >= 0) & (uniform < p_draft[:, 0])
    drawn = jnp.argmax(x + jnp.roll(noise, 1, axis=0), axis=-1)  # noise the uniform left
    return jnp.where(accepted, draft, drawn).astype(jnp.int32), accepted


def chi_square_p_value(counts, probs):
    """Pearson's test of observed counts against probabilities (bins with p > 0)."""
    from scipy import stats

    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    expected = probs[keep] * counts.sum()
    return stats.chisquare(counts[keep], expected).pvalue


@pytest.mark.parametrize(
    "rule, exact",
    [(sampler.verify, True), (broken_always_accept, False), (broken_draft_not_excluded, False)],
)
@pytest.mark.parametrize("draft", [0, 3, 5])
def test_the_emitted_token_is_distributed_as_the_target(rule, exact, draft):
    n, v = 20000, 6
    probs = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    x = jnp.asarray(np.broadcast_to(np.log(probs), (n, v)), jnp.float32)
    noise = jax.random.gumbel(jax.random.key(0), (n, v))
    tokens, accepted = jax.jit(rule)(x, jnp.full(n, draft, jnp.int32), noise)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    p = chi_square_p_value(np.bincount(tokens, minlength=v), probs)
    assert (p > 1e-3) == exact, (np.bincount(tokens, minlength=v), p)
    if exact:  # accepted with probability p(draft); rejected rows emit another token
        assert abs(accepted.mean() - probs[draft]) < 4 * (probs[draft] / n) ** 0.5 + 1e-3
        assert (tokens[~accepted] != draft).all() and (tokens[accepted] == draft).all()


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=3),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.2, presence_penalty=1.0),
        dict(temperature=0.0),
    ],
)
def test_a_row_with_a_draft_emits_the_token_it_would_without(params):
    """Through the whole sampler (processing, per-row keys): a row verifying a draft
    emits exactly the token the same row draws without one, and accepts the draft
    when that token is it. So a seeded request's tokens do not depend on whether a
    step speculated."""
    n, v = 2000, 24
    logits = np.random.RandomState(0).randn(v).astype(np.float32)
    sp = SamplingParams(**params)
    draft = int(np.argsort(logits)[-2])

    def run(d):
        rows = [SampleRow(sp, [1, 2, 2], 1, seed, draft=d) for seed in range(n)]
        md = build_sampling(rows, seq_bucket=n, history_len=4, max_bias=1, vocab_size=v)
        out = jax.jit(sampler.sample)(np.broadcast_to(logits, (n, v)).copy(), md)
        return np.asarray(out.token_ids), np.asarray(out.accepted)

    plain, never = run(-1)
    drafted, accepted = run(draft)
    np.testing.assert_array_equal(drafted, plain)
    assert not never.any()
    np.testing.assert_array_equal(accepted, drafted == draft)
    assert 0 < accepted.sum() < n or params["temperature"] == 0.0


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab24")
    make_hf_model(path, "LlamaForCausalLM", dict(vocab_size=24), seed=3)  # >= 20 top logprobs
    return str(path)


class FixedProposer:
    """Proposes the same token k times: deterministic proposals (q one-hot), as n-gram
    lookup makes, but of a token the model often samples, so that many are
    accepted and many rejected."""

    def __init__(self, token, k):
        self.token, self.k = token, k

    def propose(self, token_ids, limit=None):
        return [self.token] * min(self.k, self.k if limit is None else limit)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize(
    "params", [dict(temperature=1.0), dict(temperature=1.0, top_k=6, top_p=0.9)]
)
def test_engine_output_distribution_is_unchanged_by_speculation(
    small_vocab_model, params, broken, monkeypatch
):
    """Tokens at positions that verified drafts, over many seeds (different ones with
    and without speculation, so the samples are independent): one distribution
    (two-sample chi-square). With a broken rule (the draft not excluded on
    rejection) the same test fails."""
    from scipy import stats

    prompt = {"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}
    n, last = 400, 4  # output positions 1..last verify drafts: their tokens, pooled

    def counts(seeds, **kw):
        llm = make_llm(
            small_vocab_model, max_num_seqs=32, num_kv_pages=256, skip_tokenizer_init=True, **kw
        )
        if kw:
            llm.engine.proposer = FixedProposer(0, 3)
        sps = [
            SamplingParams(max_tokens=last + 1, seed=s, ignore_eos=True, **params) for s in seeds
        ]
        outs = llm.generate([prompt] * n, sps, use_tqdm=False)
        tokens = [t for o in outs for t in o.outputs[0].token_ids[1:]]
        return np.bincount(tokens, minlength=24), llm

    plain, _ = counts(range(n))
    if broken:
        monkeypatch.setattr(sampler, "verify", broken_draft_not_excluded)
        jax.clear_caches()  # the sampler's traces hold the real rule
    spec, llm = counts(range(n, 2 * n), **ngram(3, disable_by_batch_size=64))
    s = llm.engine.stats()
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    keep = (plain + spec) > 0
    p = stats.chi2_contingency(np.stack([plain[keep], spec[keep]])).pvalue
    assert (p > 1e-3) != broken, (plain, spec, p)
    if broken:
        jax.clear_caches()


def test_constrained_requests_do_not_speculate_beside_ones_that_do(tiny_model_dir, reference):
    from jaxserve.sampling_params import StructuredOutputsParams

    llm = make_llm(tiny_model_dir, **ngram(3))
    choice = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        structured_outputs=StructuredOutputsParams(choice=["alpha beta", "gamma"]),
    )
    prompts = repetitive_prompts()
    outs = llm.generate(
        prompts + prompts[:2], [GREEDY] * len(prompts) + [choice] * 2, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs[: len(prompts)]] == reference
    assert all(o.outputs[0].text in ("alpha beta", "gamma") for o in outs[len(prompts) :])
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
