"""Pausing generation (`LLMEngine.pause_generation`, `jaxserve.engine.lifecycle`) on the
mock engine, whose tokens are computable by hand: each mode with requests in flight,
requests added while paused, under synchronous and asynchronous scheduling."""

import pytest
from mock_runner import expected_tokens
from test_scheduler import (
    VOCAB,
    assert_idle,
    make_engine,
    params,
    scheduling,  # noqa: F401  (every test, sync and async scheduling)
)

from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import ParamError

PROMPTS = {"a": [5, 6, 7], "b": [11, 12, 13, 14, 15, 16, 17, 18, 19], "c": [3]}
MAX_TOKENS = 12


def started(engine, steps=3):
    """The engine with PROMPTS in flight after `steps` steps; every output so far."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(GenerateRequest(rid, prompt, params(MAX_TOKENS)))
    outs = []
    for _ in range(steps):
        outs += engine.step()
    return outs


def run_all(engine) -> dict:
    """Steps until nothing is left; each request's final output."""
    finals = {}
    engine.run(lambda out: finals.__setitem__(out.request_id, out) if out.finished else None)
    return finals


def test_abort_ends_the_requests_in_flight_at_once_saying_paused():
    engine = make_engine()
    partial = started(engine)
    assert partial and all(not o.finished for o in partial)
    engine.pause_generation("abort")
    assert engine.is_paused and engine.has_unfinished()  # (their final outputs)
    steps = engine.runner.steps
    finals = engine.step()
    assert engine.runner.steps == steps  # nothing computed
    assert sorted(o.request_id for o in finals) == sorted(PROMPTS)
    for out in finals:
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "abort" and c.stop_reason == "paused"
        want = expected_tokens(PROMPTS[out.request_id], MAX_TOKENS, VOCAB)
        assert c.token_ids == want[: len(c.token_ids)] and len(c.token_ids) < MAX_TOKENS
    assert not engine.has_unfinished() and engine.step() == []
    assert_idle(engine)  # every page back in the pool
    engine.resume_generation()
    assert not engine.is_paused and not engine.has_unfinished()


def test_wait_runs_the_requests_in_flight_to_their_end_and_starts_no_new_one():
    engine = make_engine()
    started(engine, steps=1)
    engine.pause_generation("wait")
    engine.add_request(GenerateRequest("new", [9, 9], params(5)))
    finals = run_all(engine)  # returns once drained: the new request is held
    assert sorted(finals) == sorted(PROMPTS)
    for rid, out in finals.items():
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == expected_tokens(PROMPTS[rid], MAX_TOKENS, VOCAB)
    assert engine.is_paused and not engine.has_unfinished()
    assert list(engine.requests) == ["new"] and not engine.scheduler.waiting
    engine.resume_generation()
    finals = run_all(engine)
    assert finals["new"].outputs[0].token_ids == expected_tokens([9, 9], 5, VOCAB)
    assert_idle(engine)


def test_keep_freezes_the_requests_in_flight_and_resume_continues_them_exactly():
    engine = make_engine()
    before = started(engine)
    engine.pause_generation("keep")
    frozen = engine.step()  # a step in flight (async scheduling) is applied at the pause
    pages = {rid: [list(s.pages) for s in r.seqs] for rid, r in engine.requests.items()}
    assert engine.scheduler.running and all(p for ps in pages.values() for p in ps)
    steps = engine.runner.steps
    for _ in range(5):
        assert not engine.has_unfinished() and engine.step() == []
    assert engine.runner.steps == steps  # frozen: nothing stepped, nothing freed
    assert {rid: [list(s.pages) for s in r.seqs] for rid, r in engine.requests.items()} == pages
    engine.add_request(GenerateRequest("new", [4, 4, 4], params(3)))  # held
    assert not engine.has_unfinished()
    engine.resume_generation()
    streamed: dict[str, list[int]] = {}
    for out in [*before, *frozen]:
        streamed.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
    finals = {}

    def keep(out):
        streamed.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        if out.finished:
            finals[out.request_id] = out

    engine.run(keep)
    for rid, prompt in PROMPTS.items():
        want = expected_tokens(prompt, MAX_TOKENS, VOCAB)
        assert finals[rid].outputs[0].token_ids == want == streamed[rid]  # none lost, none twice
        assert finals[rid].outputs[0].finish_reason == "length"
    assert finals["new"].outputs[0].token_ids == expected_tokens([4, 4, 4], 3, VOCAB)
    assert engine.scheduler.num_preemptions == 0  # their KV was kept, not recomputed
    assert_idle(engine)


def test_a_request_held_by_a_pause_can_be_aborted():
    engine = make_engine()
    engine.pause_generation("keep")
    engine.add_request(GenerateRequest("held", [1, 2], params(4)))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(GenerateRequest("held", [1, 2], params(4)))
    assert engine.abort("held") and not engine.requests
    engine.resume_generation()
    assert not engine.has_unfinished()
    assert_idle(engine)


def test_pausing_again_changes_the_mode():
    engine = make_engine()
    started(engine)
    engine.pause_generation("keep")
    engine.step()
    engine.pause_generation("abort")  # the kept requests end now
    finals = engine.step()
    assert {o.request_id for o in finals} == set(PROMPTS)
    assert all(o.outputs[0].stop_reason == "paused" for o in finals)
    assert_idle(engine)


def test_a_bad_mode_is_refused_naming_the_field():
    engine = make_engine()
    with pytest.raises(ParamError, match=r"mode must be one of \['abort', 'wait', 'keep'\]") as e:
        engine.pause_generation("stop")
    assert e.value.field == "mode" and not engine.is_paused


def test_pause_wait_s_is_checked_naming_it():
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="pause_wait_s must be >= 0 seconds"):
            make_engine(pause_wait_s=bad)
    assert make_engine(pause_wait_s=0).config.pause_wait_s == 0
