"""Speculative decoding's bookkeeping, through the engine with the mock runner.

The mock's next token is computable by hand, so an oracle proposer can propose
the true continuation with chosen tokens corrupted: every acceptance length
occurs, and outputs must stay exactly what they are without speculation.
"""

import random

import pytest
from mock_runner import expected_tokens
from test_scheduler import VOCAB, assert_exact, assert_idle, make_engine, params, random_requests

from jaxserve.config import SpeculativeConfig
from jaxserve.generate_request import GenerateRequest
from jaxserve.spec import NgramProposer


class OracleProposer:
    """Proposes the true next k tokens, each corrupted with probability `wrong`."""

    def __init__(self, k: int, wrong: float, seed: int = 0):
        self.k, self.wrong, self.rs = k, wrong, random.Random(seed)

    def propose(self, token_ids, limit=None):
        k = self.k if limit is None else min(self.k, limit)
        out = expected_tokens(list(token_ids), max(k, 0), VOCAB)
        return [(t + 1) % VOCAB if self.rs.random() < self.wrong else t for t in out]


def spec_engine(k, *, wrong=0.3, max_batch=8, **kw):
    engine = make_engine(
        speculative_config=dict(
            method="ngram", num_speculative_tokens=k, disable_by_batch_size=max_batch
        ),
        **kw,
    )
    engine.proposer = OracleProposer(k, wrong)
    return engine


def run_streamed(engine, requests):
    """Runs to the end; returns {id: final output} and checks that the streamed
    deltas of every sample add up to its final tokens."""
    for rid, (prompt, sp, kw) in requests.items():
        engine.add_request(GenerateRequest(rid, prompt, sp, **kw))
    done, streamed = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                streamed.setdefault((out.request_id, c.index), []).extend(c.delta_token_ids)
            if out.finished:
                done[out.request_id] = out
        engine.pool.check_invariant()
    assert_idle(engine)
    for rid, out in done.items():
        for c in out.outputs:
            assert streamed[(rid, c.index)] == c.token_ids, rid
    return done


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("budget", [8, 32])
def test_outputs_are_exact_with_every_acceptance_length(k, budget):
    reqs = random_requests(random.Random(k), 12, max_new=30)
    engine = spec_engine(k, budget=budget)
    done = run_streamed(engine, reqs)
    assert_exact(done, reqs)
    s = engine.stats()
    assert s.spec_decode_num_drafts > 0
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    per_pos = s.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == k and sum(per_pos) == s.spec_decode_num_accepted_tokens
    assert list(per_pos) == sorted(per_pos, reverse=True)  # position j needs 0..j-1 accepted
    # Every verifying step emits its accepted drafts plus one token.
    assert s.spec_decode_mean_acceptance_length > 1.0


def test_all_accepted_runs_emit_k_plus_one_tokens_per_step():
    prompt = [3, 1, 4, 1, 5]
    engine = spec_engine(4, wrong=0.0)
    engine.add_request(GenerateRequest("a", prompt, params(21)))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    # The prompt's step samples 1 token; each later step accepts 4 drafts + 1.
    assert steps == 1 + 20 // 5
    assert_idle(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_and_prefix_caching_keep_outputs_exact(caching):
    rs = random.Random(2)
    reqs = random_requests(rs, 16, shared=[7] * 24, max_new=30)
    engine = spec_engine(3, debug_preemption_rate=0.3, enable_prefix_caching=caching)
    assert_exact(run_streamed(engine, reqs), reqs)
    assert engine.scheduler.num_preemptions >= 3
    # Requests that share the earlier ones' outputs hit pages the verified tokens
    # filled; the mock checks every page's contents against the true tokens.
    again = {
        f"again{rid}": (prompt + expected_tokens(prompt, sp.max_tokens, VOCAB)[:9], params(5), {})
        for rid, (prompt, sp, _) in list(reqs.items())[:6]
    }
    assert_exact(run_streamed(engine, again), again)


@pytest.mark.parametrize("num_pages", [7, 9, 13, 19])
def test_drafts_never_cause_a_preemption(num_pages):
    """Three requests on too few pages: speculating (every draft rejected, so drafts
    only ever take pages) preempts no more often than not speculating."""
    reqs = {r: ([t] * 4, params(20), {}) for r, t in (("a", 1), ("b", 2), ("c", 3))}

    def preemptions(engine):
        assert_exact(run_streamed(engine, reqs), reqs)
        return engine.scheduler.num_preemptions

    kw = dict(num_pages=num_pages, page_size=4, budget=64)
    assert preemptions(spec_engine(5, wrong=1.0, **kw)) == preemptions(make_engine(**kw))


def test_drafts_take_only_the_budget_the_real_tokens_left():
    """Budget 4, k = 3: one sequence's drafts must not stop another from decoding."""
    engine = spec_engine(3, wrong=0.0, budget=4, max_num_seqs=2)
    engine.add_request(GenerateRequest("a", [1, 2, 3], params(30)))
    engine.add_request(GenerateRequest("b", [4, 5, 6], params(30)))
    progress = []
    while engine.has_unfinished():
        progress.append({o.request_id for o in engine.step()})
    assert_idle(engine)
    # Once both prompts are in, every step advances both (until a, the faster, ends).
    assert all(p == {"a", "b"} for p in progress[1:8]), progress[:8]


def test_n_samples_each_verify_their_own_drafts():
    prompt = [9, 8, 7]
    engine = spec_engine(3)
    done = run_streamed(engine, {"n": (prompt, params(12, n=3), {})})
    want = expected_tokens(prompt, 12, VOCAB)
    assert [c.token_ids for c in done["n"].outputs] == [want] * 3


@pytest.mark.parametrize("at", [0, 1, 3])
def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(at):
    prompt = [2, 7, 1, 8]
    want = expected_tokens(prompt, 20, VOCAB)
    stop = want[6 + at]  # reached by a step that verifies several drafts
    assert stop not in want[: 6 + at]
    engine = spec_engine(4, wrong=0.0)
    done = run_streamed(engine, {"s": (prompt, params(20, stop_token_ids=[stop]), {})})
    c = done["s"].outputs[0]
    assert c.token_ids == want[: 7 + at]
    assert c.finish_reason == "stop" and c.stop_reason == stop


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 7])
def test_max_tokens_is_never_overshot(max_tokens):
    prompt = [1, 2, 3]
    engine = spec_engine(4, wrong=0.0)
    done = run_streamed(engine, {"m": (prompt, params(max_tokens), {})})
    assert done["m"].outputs[0].token_ids == expected_tokens(prompt, max_tokens, VOCAB)
    assert done["m"].outputs[0].finish_reason == "length"


def test_min_tokens_blocks_a_stop_token_on_every_verified_row():
    """Row j of a sequence samples its output token len(outputs) + j: the stop ids are
    blocked on exactly the rows still under min_tokens."""
    engine = spec_engine(4)
    sp = params(20, stop_token_ids=[7], min_tokens=5)
    engine.add_request(GenerateRequest("m", [4, 4, 4], sp))
    seq = engine.scheduler.waiting[0]
    seq.append(11)
    seq.append(12)  # two outputs so far
    rows = [engine.pipeline.sample_row(seq, (1, 2, 3, 4), j) for j in range(5)]
    assert [7 in r.blocked_ids for r in rows] == [True, True, True, False, False]
    assert [r.draft for r in rows] == [1, 2, 3, 4, -1]
    assert [r.length for r in rows] == [5, 6, 7, 8, 9]
    assert [list(r.more_ids) for r in rows] == [[], [1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size():
    reqs = random_requests(random.Random(4), 6, max_prompt=8, max_new=10)
    engine = spec_engine(3, max_batch=2, budget=64)
    original = engine.scheduler.schedule

    def checked():
        running = len(engine.scheduler.running)
        plan = original()
        assert running <= 2 or not any(s.draft for s in plan.scheduled)
        return plan

    engine.scheduler.schedule = checked
    assert_exact(run_streamed(engine, reqs), reqs)
    assert engine.stats().spec_decode_num_drafts > 0  # the last two did speculate


def test_config_is_validated_with_the_field_named():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.make({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.make({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.make({"method": "ngram", "num_speculative_tokens": 2, "k": 1})
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig.make({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.make(
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            }
        )


def test_ngram_proposes_what_followed_the_newest_longest_match():
    p = NgramProposer(min_n=1, max_n=3, k=3)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3, 6, 7, 1, 2, 3]) == [6, 7, 1]  # newest 1,2,3
    assert p.propose([5, 1, 2, 5, 1, 7, 1]) == [7, 1, 7]  # only "1" matches: newest
    assert p.propose([4, 5, 6]) == []
    assert p.propose([8, 8, 8, 8]) == [8, 8, 8]  # a loop carries on past the end
    assert p.propose([1, 2, 1, 2, 1], limit=2) == [2, 1]
    assert p.propose([1, 2, 1, 2, 1], limit=0) == []
