"""The engine with a real (tiny) model: batch invariance, seeds, logprobs, streaming, compiles."""

import pickle

import numpy as np
import pytest
from engine_utils import SMALL_LLM, prompt_logits

from jaxserve import LLM, Logprob, RequestOutputKind, SamplingParams
from jaxserve.generate_request import GenerateRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_llm(path, **kw):
    return LLM(path, **{**SMALL_LLM, **kw})


def shared_prefix_prompts(seed=0):
    rs = np.random.RandomState(seed)
    system = rs.randint(3, 320, size=21).tolist()  # diverges inside the third page
    return [
        {"prompt_token_ids": system[:k] + rs.randint(3, 320, size=m).tolist()}
        for k, m in ((21, 5), (21, 9), (13, 7), (4, 30), (0, 3), (21, 1))
    ]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt's greedy output computed alone, without cache or chunking."""
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    return [
        llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for p in shared_prefix_prompts()
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=16, max_num_seqs=4),
        dict(max_num_batched_tokens=4, max_num_seqs=4, min_token_bucket=4),
        dict(max_num_batched_tokens=1, max_num_seqs=1, min_token_bucket=1),
        dict(debug_preemption_rate=0.3),
        dict(num_kv_pages=12),  # too few pages for all: real preemption
    ],
)
def test_greedy_is_identical_alone_or_in_a_busy_batch(tiny_model_dir, reference, kw):
    llm = make_llm(tiny_model_dir, **kw)
    prompts = shared_prefix_prompts()
    # Twice: the second round hits the prefix cache (partially, mid-page) when it is on.
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
    llm.engine.pool.check_invariant()
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_prefix_cache_reports_cached_tokens(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompts = shared_prefix_prompts()
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    out = llm.generate(prompts[1:2], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 16  # two full pages of the shared 21-token prefix


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    seeded = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True
    )
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids == alone
    others = shared_prefix_prompts(1)
    busy = llm.generate(
        [*others[:3], prompt, *others[3:]],
        [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)] * 3
        + [seeded]
        + [
            SamplingParams(
                temperature=0.5, min_p=0.1, max_tokens=5, ignore_eos=True, presence_penalty=1.0
            )
        ]
        * 3,
        use_tqdm=False,
    )
    assert busy[3].outputs[0].token_ids == alone
    preempting = make_llm(tiny_model_dir, debug_preemption_rate=0.4)
    out = preempting.generate([*others, prompt], [GREEDY] * len(others) + [seeded], use_tqdm=False)
    assert out[-1].outputs[0].token_ids == alone


def test_n_samples_differ_and_share_the_prompt(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    out = llm.generate(
        [{"prompt_token_ids": list(range(3, 40))}],
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(samples) == 3 and len(set(samples)) > 1
    # One prefill: the siblings fork the first sample's pages (copy-on-write) and each
    # computes only the last prompt token, for its own first draw.
    assert llm.engine.stats().prompt_tokens == 37 + 2


def test_logprobs_match_the_model(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompt = [5, 17, 60, 2, 99, 31]
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    logits = prompt_logits(llm.engine.runner, prompt, [40])[-1]
    raw = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    first = out.logprobs[0]
    assert out.token_ids[0] in first and 3 <= len(first) <= 4
    assert first[out.token_ids[0]] == pytest.approx(raw.max(), abs=1e-4)
    for t, lp in first.items():
        assert lp == pytest.approx(raw[t], abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)), abs=1e-5
    )


def test_logprobs_are_vllms_logprob_objects(tiny_model_dir):
    """Generated and prompt logprobs are vLLM's `Logprob`s (`.logprob`, `.rank`,
    `.decoded_token`; ported code reads them) and still the numbers: the top k ranked
    1..k, the token's own rank how many values are at least its own (they were plain
    floats, without ranks)."""
    llm = make_llm(tiny_model_dir)
    prompt = np.random.RandomState(3).randint(3, 320, size=12).tolist()
    sp = SamplingParams(
        temperature=2.0, seed=1, max_tokens=8, logprobs=2, prompt_logprobs=2, ignore_eos=True
    )
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    sample = out.outputs[0]
    ids = prompt + sample.token_ids
    logits = prompt_logits(llm.engine.runner, ids, [40, 41, 42])
    raw = logits - logits.max(-1, keepdims=True)
    raw -= np.log(np.exp(raw).sum(-1, keepdims=True))
    entries = [*out.prompt_logprobs[1:], *sample.logprobs]  # position i predicts ids[i + 1]
    outside_top = 0
    for i, entry in enumerate(entries):
        token, row = ids[i + 1], raw[i]
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        own = entry[token]
        assert own.logprob == float(own) == pytest.approx(row[token], abs=1e-4)
        # vLLM's rank: how many values are at least the token's (1: the highest).
        assert (row > row[token] + 1e-4).sum() < own.rank <= (row >= row[token] - 1e-4).sum()
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:2]
        assert [lp.rank for lp in top] == [1, 2] and top[0] >= top[1]
        outside_top += own.rank > 2
        assert own.decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
    assert outside_top > 0  # (a temperature of 2: some tokens ranked past the top 2)
    # Copied or pickled (Ray, multiprocessing): the same value, rank and text.
    again = pickle.loads(pickle.dumps(sample.logprobs))
    assert [{t: (lp, lp.rank, lp.decoded_token) for t, lp in e.items()} for e in again] == [
        {t: (lp, lp.rank, lp.decoded_token) for t, lp in e.items()} for e in sample.logprobs
    ]


def test_streamed_deltas_add_up_to_the_final_output(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    text = "The quick brown fox"
    engine.add_request(
        GenerateRequest(
            "s",
            llm.tokenizer.encode(text),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        )
    )
    deltas, ids, final = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            ids += out.outputs[0].delta_token_ids
            final = out
    assert "".join(deltas) == final.outputs[0].text and ids == final.outputs[0].token_ids


def test_output_kinds_cumulative_delta_and_final_only(tiny_model_dir):
    """vLLM's RequestOutputKind: CUMULATIVE outputs hold everything so far each step,
    DELTA only what is new (no copy of what came before), FINAL_ONLY one output at
    the end; the three end the same. `LLM.generate` asks for FINAL_ONLY."""
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    prompt = llm.tokenizer.encode("The quick brown fox")
    outs = {kind: [] for kind in RequestOutputKind}
    for kind in RequestOutputKind:
        params = SamplingParams(
            n=2,
            temperature=0.8,
            seed=3,
            max_tokens=12,
            logprobs=2,
            ignore_eos=True,
            output_kind=kind,
        )
        engine.add_request(GenerateRequest(kind.name, prompt, params))
    while engine.has_unfinished():
        for out in engine.step():
            outs[RequestOutputKind[out.request_id]].append(out)
    cumulative, delta, final = (outs[k] for k in RequestOutputKind)
    assert len(cumulative) >= 12 and len(delta) == len(cumulative)
    assert len(final) == 1 and final[0].finished
    for i in range(2):
        want = cumulative[-1].outputs[i]
        assert want.text and len(want.token_ids) == 12 and len(want.logprobs) == 12
        pieces = [o.outputs[i] for o in delta]
        assert [t for c in pieces for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in pieces) == want.text
        assert [lp for c in pieces for lp in c.logprobs] == want.logprobs
        assert all(c.token_ids == c.delta_token_ids for c in pieces)
        got = final[0].outputs[i]
        assert (got.token_ids, got.text, got.logprobs) == (
            want.token_ids,
            want.text,
            want.logprobs,
        )
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=2)
    # generate's requests make no output before their last
    seen, step = [], engine.step

    def spy():
        outputs = step()
        seen.extend(outputs)
        return outputs

    engine.step = spy
    try:
        llm.generate([{"prompt_token_ids": prompt}] * 3, GREEDY, use_tqdm=False)
    finally:
        del engine.step
    assert len(seen) == 3 and all(o.finished for o in seen)


def test_stop_string_cuts_the_output(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompt = "The quick brown fox"
    free = (
        llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    stop = free[6:8]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free[: free.index(stop)]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_compilation_after_warm_up(tiny_model_dir, async_scheduling):
    llm = make_llm(
        tiny_model_dir,
        warmup=True,
        compile_guard=True,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
    )
    compiled = llm.engine.runner.compiles.count
    rs = np.random.RandomState(5)
    prompts = [
        {"prompt_token_ids": rs.randint(3, 320, size=n).tolist()}
        for n in (1, 2, 7, 8, 9, 16, 31, 33, 60, 100)
    ]
    settings = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(
            temperature=0.7, top_k=5, top_p=0.8, max_tokens=6, logprobs=2, prompt_logprobs=3
        ),
        SamplingParams(temperature=1.0, min_p=0.2, n=3, max_tokens=4, seed=1),
        SamplingParams(
            temperature=0,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logit_bias={4: 2.0},
            min_tokens=2,
            max_tokens=5,
            stop=["ab"],
        ),
    ]
    for i in range(3):
        batch = prompts[i::2]
        llm.generate(batch, [settings[(i + j) % 4] for j in range(len(batch))], use_tqdm=False)
    assert llm.engine.runner.compiles.count == compiled


@pytest.mark.parametrize("budget", [64, 8])
def test_prompt_logprobs_match_the_model(tiny_model_dir, budget):
    prompt = np.random.RandomState(9).randint(3, 320, size=21).tolist()
    logits = prompt_logits(make_llm(tiny_model_dir).engine.runner, prompt, [40, 41, 42])
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=budget, min_token_bucket=8)
    raw = logits - logits.max(-1, keepdims=True)
    raw -= np.log(np.exp(raw).sum(-1, keepdims=True))
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for _ in range(2):  # the second time the prompt is cached: logprobs must not be skipped
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for i in range(1, len(prompt)):
            assert lps[i][prompt[i]] == pytest.approx(raw[i - 1, prompt[i]], abs=1e-4)
            top2 = np.argsort(raw[i - 1])[-2:]
            assert set(top2.tolist()) <= set(lps[i])
