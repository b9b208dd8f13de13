"""Asynchronous scheduling: step N+1 is dispatched before step N's tokens are back.

The mock runner's tokens are computable by hand, so the mock tests assert exact
outputs and the order of dispatches and fetches; the tiny real model checks that
asynchronous outputs equal synchronous ones field by field. (Every scheduler test
in test_scheduler.py also runs asynchronously.)
"""

import pytest
from mock_runner import MockRunner, expected_tokens
from test_engine import make_llm, shared_prefix_prompts
from test_scheduler import VOCAB, assert_idle, make_engine, params, run

from jaxserve import SamplingParams
from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import StructuredOutputsParams


def record_calls(engine) -> list[str]:
    """Logs the runner's dispatches ("d") and fetches ("f") in order."""
    calls, runner = [], engine.runner
    dispatch, fetch = runner.dispatch, runner.fetch
    runner.dispatch = lambda *a: calls.append("d") or dispatch(*a)
    runner.fetch = lambda pending: calls.append("f") or fetch(pending)
    return calls


def test_the_next_step_is_dispatched_before_the_last_ones_tokens_are_fetched():
    engine = make_engine(async_scheduling=True)
    calls = record_calls(engine)
    done = run(engine, {"a": ([1, 2, 3], params(5), {})})
    assert done["a"].outputs[0].token_ids == expected_tokens([1, 2, 3], 5, VOCAB)
    # One prefill and four decodes, each dispatched before the one before is fetched;
    # none past max_tokens (the fifth token's step is never dispatched).
    assert "".join(calls) == "dd" + "fd" * 3 + "ff"


def test_penalties_read_the_token_in_flight_on_the_device():
    # (the mock ignores penalties; it checks the history rows the sampler gets)
    engine = make_engine(async_scheduling=True)
    calls = record_calls(engine)
    prompt = [4, 5]
    done = run(engine, {"p": (prompt, params(6, presence_penalty=0.5), {})})
    assert done["p"].outputs[0].token_ids == expected_tokens(prompt, 6, VOCAB)
    assert "dd" in "".join(calls)


@pytest.mark.parametrize("at", [0, 1, 3])
def test_a_stop_token_discards_the_token_in_flight(at):
    prompt = [7, 8, 9]
    want = expected_tokens(prompt, 10, VOCAB)
    sp = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[want[at]])
    outs = {}
    for mode in (False, True):
        engine = make_engine(async_scheduling=mode)
        engine.add_request(GenerateRequest("other", [1, 2], params(12)))
        outs[mode] = run(engine, {"s": (prompt, sp, {})})
        assert_idle(engine)
    for mode in (False, True):
        c = outs[mode]["s"].outputs[0]
        assert c.token_ids == want[: at + 1] and c.finish_reason == "stop"
        assert c.stop_reason == want[at]
        assert outs[mode]["other"].outputs[0].token_ids == expected_tokens([1, 2], 12, VOCAB)


def test_abort_while_its_step_is_in_flight():
    engine = make_engine(async_scheduling=True)
    engine.add_request(GenerateRequest("a", list(range(1, 30)), params(50)))
    engine.add_request(GenerateRequest("b", [1, 2, 3], params(6)))
    streamed = {"a": [], "b": []}
    for _ in range(3):
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].delta_token_ids
    assert engine.pipeline.inflight is not None and streamed["a"]
    assert engine.abort("a") and not engine.abort("a")
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "b"  # nothing of "a" after its abort
            streamed["b"] += out.outputs[0].delta_token_ids
    assert streamed["a"] == expected_tokens(list(range(1, 30)), len(streamed["a"]), VOCAB)
    assert streamed["b"] == expected_tokens([1, 2, 3], 6, VOCAB)
    assert_idle(engine)


def test_async_scheduling_with_speculative_decoding_runs_synchronously():
    engine = make_engine(
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    calls = record_calls(engine)
    done = run(engine, {"a": ([1, 2, 1, 2, 1, 2], params(6), {})})
    assert done["a"].outputs[0].token_ids == expected_tokens([1, 2, 1, 2, 1, 2], 6, VOCAB)
    assert "dd" not in "".join(calls)


@pytest.mark.parametrize(
    "accelerator, spec, overlapped",
    [(False, None, False), (True, None, True), (True, "ngram", False)],
    ids=["cpu", "accelerator", "accelerator-speculating"],
)
def test_async_scheduling_is_on_by_default_on_an_accelerator(
    accelerator, spec, overlapped, monkeypatch
):
    """async_scheduling unset: on for a GPU or TPU runner (measured 1.3-1.45x on an
    H200, benchmarks/README.md), off on the CPU and with speculative decoding."""
    monkeypatch.setattr(MockRunner, "accelerator", accelerator)
    kw = {"speculative_config": {"method": spec, "num_speculative_tokens": 2}} if spec else {}
    engine = make_engine(async_scheduling=None, **kw)
    calls = record_calls(engine)
    done = run(engine, {"a": ([1, 2, 1, 2, 1, 2], params(6), {})})
    assert done["a"].outputs[0].token_ids == expected_tokens([1, 2, 1, 2, 1, 2], 6, VOCAB)
    assert ("dd" in "".join(calls)) == overlapped


# ------------------------------------------------------------- the tiny real model


def mixed_params(tokenizer):
    """One request of each kind the engine treats differently after a step."""
    stop_text = tokenizer.decode([40, 41])
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            seed=3,
            n=2,
            max_tokens=9,
            logprobs=2,
            frequency_penalty=0.7,
            presence_penalty=0.3,
            ignore_eos=True,
        ),
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            seed=5,
            max_tokens=20,
            min_tokens=4,
            stop_token_ids=list(range(100, 200)),
        ),
        SamplingParams(temperature=0, max_tokens=7, prompt_logprobs=2, logit_bias={9: 3.0}),
        SamplingParams(temperature=0.7, seed=11, max_tokens=16, stop=[stop_text, "a"]),
        SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.5, ignore_eos=True),
    ]


def generate(llm, prompts, sps):
    """Every output field, and the engine back at rest (no pages, no step in flight)."""
    outs = llm.generate(prompts, sps, use_tqdm=False)
    engine = llm.engine
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity
    assert engine.pipeline.inflight is None and not engine.scheduler.running
    return [
        (
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs],
            o.num_cached_tokens,
            [c.logprobs for c in o.outputs] + [o.prompt_logprobs],
        )
        for o in outs
    ]


def assert_same(a, b):
    """Tokens, text and finish exactly; logprobs to float noise (a different batch
    around a sequence rounds its matmuls differently)."""
    assert [out[:2] for out in a] == [out[:2] for out in b]
    for x, y in zip(a, b, strict=True):
        for lx, ly in zip(x[2], y[2], strict=True):
            assert (lx is None) == (ly is None)
            for ex, ey in zip(lx or [], ly or [], strict=True):
                assert (ex is None) == (ey is None)
                assert ex is None or ex == pytest.approx(ey, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=8, max_num_seqs=4, min_token_bucket=8),  # chunked prefill
        dict(num_kv_pages=12),  # too few pages for all: real preemption
        dict(debug_preemption_rate=0.3),
    ],
)
def test_async_outputs_equal_sync_outputs(tiny_model_dir, kw):
    prompts = shared_prefix_prompts(2)
    results = {}
    for mode in (False, True):
        llm = make_llm(tiny_model_dir, async_scheduling=mode, **kw)
        sps = mixed_params(llm.tokenizer)
        # Twice: the second round hits the prefix cache (when it is on).
        results[mode] = [generate(llm, prompts, sps) for _ in range(2)]
    for a, b in zip(results[True], results[False], strict=True):
        assert_same(a, b)
    finish = {c[2] for out in results[True][0] for c in out[0]}
    assert finish == {"length", "stop"}


def test_streams_with_aborts_mid_stream_match_sync(tiny_model_dir):
    prompts = [p["prompt_token_ids"] for p in shared_prefix_prompts(3)]
    sp = SamplingParams(temperature=0.9, seed=2, max_tokens=14, ignore_eos=True)
    streams = {}
    for mode in (False, True):
        engine = make_llm(tiny_model_dir, async_scheduling=mode).engine
        for i, p in enumerate(prompts):
            engine.add_request(GenerateRequest(str(i), p, sp))
        got = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.outputs[0].delta_token_ids
                if out.request_id in "02" and len(got[out.request_id]) >= 3:
                    engine.abort(out.request_id)  # (its next step may already run)
        engine.pool.check_invariant()
        assert engine.pool.num_free == engine.pool.capacity
        streams[mode] = got
    for rid in "02":  # nothing streamed after the abort, in either mode
        assert streams[True][rid] == streams[False][rid] and len(streams[True][rid]) == 3
    for rid in "1345":
        assert streams[True][rid] == streams[False][rid] and len(streams[True][rid]) == 14


def test_structured_output_beside_async_requests(tiny_model_dir):
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    sps = [
        SamplingParams(
            temperature=0,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        ),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),  # done first
    ]
    results = {}
    for mode in (False, True):
        llm = make_llm(tiny_model_dir, async_scheduling=mode)
        calls = record_calls(llm.engine)
        results[mode] = generate(llm, prompts, sps)
        # The grammar's bitmask needs the last token: every step waits for the one before.
        assert "dd" not in "".join(calls)
    assert_same(results[True], results[False])
    assert results[True][0][0][0][1] in ("yes", "no")


def test_async_scheduling_is_a_typed_engine_argument(tiny_model_dir):
    llm = make_llm(tiny_model_dir, async_scheduling=True)
    assert llm.engine.config.scheduler.async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling must be a bool or None, got 'yes'"):
        make_llm(tiny_model_dir, async_scheduling="yes")
