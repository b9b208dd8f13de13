"""Disaggregation in one process: a prefill engine computes the prompt and first
tokens, its pages move as bytes to a decode engine, which resumes the samples;
the outputs equal one engine's, and both pools return every page."""

import dataclasses

import pytest
from test_engine import make_llm

from jaxserve import SamplingParams
from jaxserve.generate_request import GenerateRequest, ResumedSample
from jaxserve.kv.transfer import KVTransferError

PROMPTS = [[5 + (i * 7 + j * 3) % 300 for j in range(n)] for i, n in enumerate((29, 8, 17, 40))]
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    "seeded_n3_logprobs": SamplingParams(
        temperature=1.0, seed=3, n=3, max_tokens=7, logprobs=2, ignore_eos=True
    ),
    "stop_string": SamplingParams(temperature=0.0, max_tokens=12, stop=["a", "e"]),
    "one_token": SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    single = make_llm(tiny_model_dir).engine
    prefill = make_llm(tiny_model_dir).engine
    decode = make_llm(tiny_model_dir, kv_offload_bytes=16 << 20).engine
    return single, prefill, decode


def finals(engine, prompt, params, **kw):
    engine.add_request(GenerateRequest("r", prompt, params, **kw))
    deltas, last = {}, None
    for out in iter_outputs(engine):
        for c in out.outputs:
            deltas.setdefault(c.index, []).extend(c.delta_token_ids)
        last = out
    for c in last.outputs:
        assert deltas[c.index] == c.token_ids  # the stream adds up to the final output
    return last


def iter_outputs(engine):
    while engine.has_unfinished():
        yield from engine.step()


def disaggregated(prefill, decode, prompt, params):
    first = finals(prefill, prompt, dataclasses.replace(params, max_tokens=1))
    pages = prefill.export_prefix(prompt)
    assert len(pages) == len(prompt) // 8
    assert decode.import_pages(pages) == len(pages)
    going_on = [c for c in first.outputs if c.finish_reason == "length" and params.max_tokens > 1]
    if not going_on:
        return first.outputs, first
    resume = [ResumedSample(c.index, c.token_ids, c.logprobs) for c in going_on]
    out = finals(decode, prompt, params, resume=resume)
    assert out.num_cached_tokens == len(pages) * 8  # the pushed pages, not recomputed
    done = {c.index: c for c in first.outputs if c not in going_on}
    done.update({c.index: c for c in out.outputs})
    return [done[i] for i in sorted(done)], out


def fields(c):
    return (c.token_ids, c.text, c.finish_reason, c.stop_reason)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_then_decode_equals_one_engine(engines, case):
    single, prefill, decode = engines
    params = CASES[case]
    for prompt in PROMPTS:
        want = finals(single, prompt, params).outputs
        got, _ = disaggregated(prefill, decode, prompt, params)
        assert [fields(c) for c in got] == [fields(c) for c in want]
        if params.logprobs:
            # The same tokens; logprobs within float noise (the decode engine computes the
            # prompt's last partial page in another chunk than one engine does).
            for g, w in zip(got, want, strict=True):
                assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
                for ge, we in zip(g.logprobs, w.logprobs, strict=True):
                    assert ge.keys() == we.keys()
                    assert list(ge.values()) == pytest.approx(list(we.values()), abs=1e-4)
    for engine in engines:
        engine.pool.check_invariant()
        assert engine.pool.num_free == engine.pool.capacity


def test_foreign_or_corrupt_pages_are_refused_and_none_kept(engines, hf_model_dir):
    _, prefill, decode = engines
    pages = pages_of(prefill)
    bad = bytearray(pages[1])
    bad[-40] ^= 1
    stores = decode.tier.stats.stores
    with pytest.raises(KVTransferError, match="checksum"):
        decode.import_pages([pages[0], bytes(bad)])
    other = make_llm(hf_model_dir("llama2_mha")[0], skip_tokenizer_init=True).engine
    with pytest.raises(KVTransferError, match="another model or layout"):
        decode.import_pages(pages_of(other))
    assert decode.tier.stats.stores == stores
    with pytest.raises(ValueError, match="no KV tier"):
        prefill.import_pages(pages)


def test_same_architecture_other_weights_is_another_model(engines):
    from jaxserve.runner import kv_io

    runner = engines[0].runner
    weights = list(runner.weights)
    weights[-1] = weights[-1] * 1.001
    assert kv_io.kv_layout(runner.config, weights).fingerprint != engines[0].kv_layout.fingerprint
    assert engines[1].kv_layout.fingerprint == engines[0].kv_layout.fingerprint


def pages_of(engine):
    prompt = list(range(3, 3 + 16))
    finals(engine, prompt, CASES["one_token"])
    return engine.export_prefix(prompt)


def test_bad_resume_names_the_field(engines):
    _, _, decode = engines
    params = SamplingParams(max_tokens=4, n=2)
    for resume, match in [
        ([ResumedSample(2, [5])], "distinct samples of n=2"),
        ([ResumedSample(0, [5]), ResumedSample(0, [6])], "distinct samples"),
        ([ResumedSample(0, [10**6])], r"resume.samples\[0\].token_ids"),
        ([ResumedSample(1, [5, 5, 5, 5])], "nothing is left to generate"),
    ]:
        with pytest.raises(ValueError, match=match):
            decode.add_request(GenerateRequest("bad", PROMPTS[0], params, resume=resume))
    assert not decode.has_unfinished()
