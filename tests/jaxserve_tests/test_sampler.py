"""The on-device sampler against numpy references on synthetic logits."""

import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve.runner.input_batch import (
    WARM_BRANCHES,
    SampleBranches,
    SampleRow,
    build_sampling,
    covering,
)
from jaxserve.runner.sampler import _top_ids_by_passes, _top_k_top_p, argmax, sample
from jaxserve.sampling_params import SamplingParams

V = 50


def run(logits, rows, *, history_len=16):
    md = build_sampling(
        rows,
        seq_bucket=len(logits),
        history_len=history_len,
        max_bias=8,
        vocab_size=logits.shape[1],
    )
    return jax.tree.map(np.asarray, jax.jit(sample)(np.asarray(logits, np.float32), md))


def row(seed=0, tokens=(1, 2, 3), num_prompt=3, blocked=(), **params):
    return SampleRow(SamplingParams(**params), list(tokens), num_prompt, seed, blocked)


def test_greedy_and_tiny_temperatures_agree():
    rs = np.random.RandomState(0)
    logits = rs.randn(4, V) * 3
    out = run(
        logits,
        [
            row(temperature=0.0),
            row(temperature=1e-6),
            row(temperature=1e-4),
            row(temperature=0.0, top_k=1),
        ],
    )
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_penalties_follow_vllm_semantics():
    rs = np.random.RandomState(1)
    logits = rs.randn(1, V).astype(np.float32) * 2
    tokens, num_prompt = [4, 9, 9, 17, 17, 17], 2  # prompt 4, 9; outputs 9, 17, 17, 17
    out = run(
        logits,
        [
            row(
                tokens=tokens,
                num_prompt=num_prompt,
                temperature=0.0,
                repetition_penalty=1.7,
                frequency_penalty=0.4,
                presence_penalty=0.3,
            )
        ],
    )
    want = logits[0].copy()
    for t in set(tokens):  # repetition: prompt and outputs
        want[t] = want[t] / 1.7 if want[t] > 0 else want[t] * 1.7
    counts = np.bincount(tokens[num_prompt:], minlength=V)  # frequency/presence: outputs only
    want -= 0.4 * counts + 0.3 * (counts > 0)
    assert out.token_ids[0] == want.argmax()
    # Make the penalties decide the outcome: token 17 is the raw argmax.
    logits[0, 17] = logits[0].max() + 0.5
    out = run(
        logits, [row(tokens=tokens, num_prompt=num_prompt, temperature=0.0, frequency_penalty=2.0)]
    )
    assert out.token_ids[0] != 17


def test_logit_bias_and_blocked_tokens():
    logits = np.zeros((2, V), np.float32)
    logits[:, 7] = 5.0
    out = run(
        logits, [row(temperature=0.0, logit_bias={3: 100.0}), row(temperature=0.0, blocked=(7,))]
    )
    assert out.token_ids[0] == 3 and out.token_ids[1] != 7


def test_any_number_of_blocked_tokens_through_the_bitmask():
    """min_tokens may block hundreds of stop ids: the bitmask has no cap, and it
    clears exactly the blocked bits (word edges 31/32, the last partial word)."""
    v = 100  # 4 words, the last one partial
    rs = np.random.RandomState(5)
    logits = rs.randn(3, v).astype(np.float32)
    blocked = [t for t in range(v) if t not in (5, 33, 99)]  # 97 ids, more than any old cap
    out = run(
        logits,
        [
            row(temperature=0.0, blocked=blocked),
            row(temperature=0.0, blocked=(31, 32, 63, 64, int(logits[1].argmax()))),
            row(temperature=0.0),  # unmasked neighbour
        ],
    )
    assert out.token_ids[0] == max((5, 33, 99), key=lambda t: logits[0, t])
    second = logits[1].copy()
    second[[31, 32, 63, 64, logits[1].argmax()]] = -np.inf
    assert out.token_ids[1] == second.argmax()
    assert out.token_ids[2] == logits[2].argmax()
    md = build_sampling(
        [row(blocked=(0, 31, 32, 99, 500))], seq_bucket=1, history_len=1, max_bias=1, vocab_size=v
    )
    bits = np.unpackbits(md.allowed.view(np.uint8), bitorder="little")[:v]
    assert np.flatnonzero(bits == 0).tolist() == [0, 31, 32, 99]  # 500: outside the vocabulary


@pytest.mark.parametrize(
    "kw", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3), dict(top_k=5, top_p=0.8, min_p=0.05)]
)
def test_draws_stay_inside_the_allowed_set(kw):
    rs = np.random.RandomState(2)
    logits = (rs.randn(1, V) * 2).astype(np.float32)
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    allowed = set(order.tolist())
    if "top_k" in kw:
        allowed &= set(order[: kw["top_k"]].tolist())
    if "top_p" in kw:  # the nucleus of what top-k kept, renormalized (vLLM's)
        kept = probs[order] * np.isin(order, list(allowed))
        kept /= kept.sum()
        before = np.cumsum(kept) - kept
        allowed &= set(order[before < kw["top_p"]].tolist())
    if "min_p" in kw:
        allowed &= set(np.flatnonzero(probs >= kw["min_p"] * probs.max()).tolist())
    seen = set()
    batch = np.repeat(logits, 16, axis=0)
    for start in range(0, 96, 16):
        out = run(batch, [row(seed=s, temperature=1.0, **kw) for s in range(start, start + 16)])
        seen |= set(out.token_ids.tolist())
    assert seen <= allowed and len(seen) > 1


def test_top_p_takes_the_nucleus_of_what_top_k_kept():
    """vLLM applies top-k, renormalizes, then top-p. Probabilities .4, .3, .2, .1:
    top_k=2 keeps .4 and .3, renormalized .57 and .43, and top_p=0.5 keeps the first
    alone (the nucleus of the whole distribution, .4 + .3, would keep the second too)."""
    logits = np.full((1, V), -1e9, np.float32)
    logits[0, :4] = np.log([0.4, 0.3, 0.2, 0.1])
    out = run(np.repeat(logits, 32, 0), [row(seed=s, top_k=2, top_p=0.5) for s in range(32)])
    assert set(out.token_ids.tolist()) == {0}


_cut = jax.jit(lambda x, k, p: _top_k_top_p(x, SimpleNamespace(top_k=k, top_p=p)))


def _cut_reference(x, top_k, top_p):
    """top-k, then the top-p nucleus of what it kept, by a float64 sort (-inf: cut)."""
    out = x.copy()
    for r, row_ in enumerate(x.astype(np.float64)):
        ordered = np.sort(row_)[::-1]
        k = min(top_k[r], len(row_)) if top_k[r] > 0 else len(row_)
        in_k = ordered >= ordered[k - 1]
        e = np.where(in_k, np.exp(ordered - ordered[0]), 0.0)
        p = e / e.sum()
        keep = in_k & ((np.cumsum(p) - p < top_p[r]) if top_p[r] < 1.0 else True)
        out[r] = np.where(row_ < ordered[keep].min(), -np.inf, x[r])
    return out


def test_top_k_top_p_selects_as_a_sort_would():
    """The radix select (no sort of the vocabulary) keeps what a float64 sort keeps:
    ties at the k-th value and at the nucleus' edge kept, -inf entries, -0.0 beside
    0.0, top_k past the vocabulary."""
    rs = np.random.default_rng(0)
    for trial in range(60):
        v = int(rs.choice([7, 64, 1000]))
        x = (rs.normal(size=(8, v)) * rs.choice([0.1, 1.0, 10.0])).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)  # ties
        if trial % 5 == 0:
            x[:, : v // 3] = -np.inf
        if trial % 4 == 0:
            x[0, :2] = [-0.0, 0.0]
        top_k = rs.integers(0, v + 3, 8).astype(np.int32)
        top_p = rs.uniform(0.05, 1.0, 8).astype(np.float32)
        top_k[::3], top_p[::4] = 0, 1.0
        got = np.asarray(_cut(x, top_k, top_p))
        np.testing.assert_array_equal(got, _cut_reference(x, top_k, top_p), err_msg=str(trial))


def test_top_p_of_one_keeps_the_whole_top_k():
    """top_p=1 cuts nothing. A sort-and-cumsum nucleus cut the tail of top-k once the
    float mass above it rounded to 1 (1 of 200 kept here)."""
    x = np.concatenate([[30.0], np.linspace(0.0, -5.0, 299)]).astype(np.float32)[None]
    kept = np.isfinite(np.asarray(_cut(x, np.array([200], np.int32), np.array([1.0], np.float32))))
    assert kept.sum() == 200 and kept[0, :200].all()


def test_top_ids_are_lax_top_k_without_a_sort():
    """The passes a TPU takes (a GPU and a CPU take lax.top_k): ties (the lowest index
    first), -inf entries, -0.0 below 0.0, as lax.top_k."""
    rs = np.random.default_rng(1)
    top = jax.jit(_top_ids_by_passes, static_argnums=1)
    for trial in range(30):
        x = rs.normal(size=(8, int(rs.choice([20, 64, 1000])))).astype(np.float32)
        if trial % 2:
            x = np.round(x)  # ties, and -0.0 beside 0.0
        if trial % 3 == 0:
            x[:, : x.shape[1] // 2] = -np.inf
        want = np.asarray(jax.lax.top_k(x, 20)[1])
        np.testing.assert_array_equal(np.asarray(top(x, 20)), want, err_msg=str(trial))


def test_seeded_rows_do_not_depend_on_neighbours_or_position():
    rs = np.random.RandomState(3)
    logits = rs.randn(4, V).astype(np.float32)
    target = row(seed=42, temperature=0.9, top_p=0.95)
    alone = run(logits[:1], [target])
    others = [row(seed=s, temperature=1.0) for s in (1, 2, 3)]
    mixed = run(np.concatenate([logits[1:], logits[:1]]), [*others, target])
    assert mixed.token_ids[3] == alone.token_ids[0]


def test_seeded_draws_at_two_positions_are_independent():
    """The same seed at the next output position draws afresh: over 400 seeds, the two
    positions' tokens (4 equally likely ones) match about 1/4 of the time, not always,
    and their joint counts pass a chi-square test of independence."""
    n, k = 400, 4
    logits = np.full((2 * n, V), -1e9, np.float32)
    logits[:, :k] = 0.0
    rows = [row(seed=s, temperature=1.0, tokens=(1, 2, 3)) for s in range(n)]
    rows += [row(seed=s, temperature=1.0, tokens=(1, 2, 3, 4)) for s in range(n)]
    out = run(logits, rows).token_ids
    first, second = out[:n], out[n:]
    assert set(first.tolist()) == set(second.tolist()) == set(range(k))
    assert 60 <= np.sum(first == second) <= 140  # binomial(400, 1/4): mean 100, sd 8.7
    joint = np.zeros((k, k))
    np.add.at(joint, (first, second), 1)
    expected = joint.sum(1, keepdims=True) * joint.sum(0, keepdims=True) / n
    chi2 = ((joint - expected) ** 2 / expected).sum()
    assert chi2 < 27.88  # the 0.999 quantile of chi-square with 9 degrees of freedom


def test_logprobs_are_raw_and_top_sorted():
    rs = np.random.RandomState(4)
    logits = rs.randn(2, V).astype(np.float32)
    out = run(logits, [row(temperature=0.0, logprobs=5), row(temperature=0.0)])
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(2), logits.argmax(-1)], rtol=1e-5)
    np.testing.assert_allclose(out.top_logprobs[0], np.sort(raw[0])[::-1][:20], rtol=1e-5)
    assert out.top_ids[0, 0] == logits[0].argmax()


def test_no_nan_at_extreme_settings():
    logits = np.full((2, V), -1e4, np.float32)
    logits[:, 0] = 1e4
    out = run(
        logits, [row(temperature=1e-6, top_p=1e-3, seed=1), row(temperature=2.0, min_p=1.0, seed=2)]
    )
    assert out.token_ids.tolist() == [0, 0]


def test_penalty_history_and_bitmask_are_only_sent_when_needed():
    """A plain batch holds neither the penalties' history (O(context) a row) nor the
    bitmask (O(vocabulary) a row); a row with a penalty, a grammar or min_tokens'
    blocked ids makes the batch full, and the sampler applies what it holds."""
    kw = dict(seq_bucket=2, history_len=64, max_bias=4, vocab_size=V)
    plain = build_sampling([row(temperature=0.5, logit_bias={3: 1.0})], **kw)
    assert plain.history.shape == (2, 1) and plain.allowed.shape == (2, 0)
    penalized = build_sampling([row(repetition_penalty=1.2), row()], **kw)
    assert penalized.history.shape == (2, 64) and penalized.allowed.shape == (2, -(-V // 32))
    assert penalized.history[0, :3].tolist() == [1, 2, 3] and penalized.history[1, 0] == -1
    blocked = row(temperature=0.0, blocked=(5,))
    full = build_sampling([blocked], **kw)
    assert full.history.shape == (2, 64) and full.masked.tolist() == [True, False]
    logits = np.zeros((2, V), np.float32)
    logits[:, 5] = 9.0
    assert run(logits, [blocked, row(temperature=0.0)]).token_ids.tolist() == [0, 5]
    assert run(logits, [row(temperature=0.0)] * 2).token_ids.tolist() == [5, 5]  # (plain)


def test_argmax_matches_jnp_argmax_with_ties_and_masked_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 1001)).astype(np.float32)
    x[1, [3, 700]] = 50.0  # a tie: the first index wins
    x[2] = -np.inf  # a fully masked row
    x[3, :500] = -np.inf
    x[4] = 7.0  # a constant row
    x[5, -1] = 9.0  # the maximum at the last index
    got = np.asarray(jax.jit(argmax)(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got.dtype == np.int32


# ------------------------------------------------- branches decided on the host


def _random_row(rs, i):
    """A row with a random mix of every optional part of sampling."""
    params = dict(temperature=float(rs.choice([0.0, 0.0, 0.7, 1.3])))
    if rs.rand() < 0.3:
        params["top_k"] = int(rs.choice([1, 5, V + 10]))
    if rs.rand() < 0.3:
        params["top_p"] = float(rs.choice([0.3, 0.9]))
    if rs.rand() < 0.2:
        params["min_p"] = 0.1
    if rs.rand() < 0.15:
        params["repetition_penalty"] = 1.3
    if rs.rand() < 0.15:
        params["frequency_penalty"] = 0.5
    if rs.rand() < 0.2:
        params["logit_bias"] = {int(rs.randint(V)): 4.0}
    if rs.rand() < 0.2:
        params["logprobs"] = 3
    tokens = rs.randint(0, V, 6).tolist()
    blocked = (int(rs.randint(V)),) if rs.rand() < 0.15 else ()
    beam = 1.0 if rs.rand() < 0.1 else 0.0
    return SampleRow(SamplingParams(**params), tokens, 3, i, blocked, beam=beam)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_host_decided_branches_sample_exactly_as_the_device_decides(mode):
    """A batch sampled with the branches the host decides (`SampleBranches.of`), or in
    any wider program that covers them (every program of WARM_BRANCHES a GPU would
    pick from), gives what the device's own `lax.cond`s give, bit for bit: a part that
    runs changes only the rows that ask for it."""
    rs = np.random.RandomState(7)
    step = jax.jit(sample, static_argnums=2)
    checked = set()
    for trial in range(14):
        rows = [_random_row(rs, 10 * trial + i) for i in range(rs.randint(1, 6))]
        md = build_sampling(rows, seq_bucket=6, history_len=16, max_bias=8, vocab_size=V)
        logits = rs.randn(6, V).astype(np.float32) * 3
        want = jax.tree.map(np.asarray, step(logits, md, mode))
        need = SampleBranches.of(md)
        full = bool(md.allowed.shape[1])
        programs = [need, *(b for b in WARM_BRANCHES[full] if b.covers(need))]
        assert covering(md).branches == programs[1]
        values = np.array(
            [r.wants_logprobs or r.beam > 0 for r in rows] + [False] * (6 - len(rows))
        )
        for branches in programs:
            got = step(logits, dataclasses.replace(md, branches=branches), mode)
            got = jax.tree.map(np.asarray, got)
            np.testing.assert_array_equal(got.token_ids, want.token_ids, err_msg=str(branches))
            np.testing.assert_array_equal(got.accepted, want.accepted)
            for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
                np.testing.assert_array_equal(
                    getattr(got, name)[values], getattr(want, name)[values], err_msg=name
                )
            checked.add(branches)
    assert len(checked) >= 6  # (the mixes reached several programs)


def test_host_decided_branches_leave_no_conditional_in_the_program():
    """On a GPU a conditional copies its predicate to the host and waits: the sampling
    program of host-decided branches has none (the device-decided one has them)."""
    rows = [row(temperature=0.8, top_p=0.9, logprobs=2), row(temperature=0.0)]
    md = build_sampling(rows, seq_bucket=2, history_len=16, max_bias=8, vocab_size=V)
    logits = np.zeros((2, V), np.float32)

    def hlo(md):
        return jax.jit(sample).lower(logits, md).compile().as_text()

    assert "conditional(" in hlo(md)
    for branches in WARM_BRANCHES[False]:
        assert "conditional(" not in hlo(dataclasses.replace(md, branches=branches))
