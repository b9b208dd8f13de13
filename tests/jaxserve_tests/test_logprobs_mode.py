"""`logprobs_mode` (vLLM's): the values logprobs hold, against numpy computations of
the same distributions, on synthetic logits (the sampler) and on the demo model's
logits (the engine: sampled tokens, the top entries, prompt logprobs, speculation).

The numpy reference (`processed`) is written from vLLM's definition, independently
of the sampler: logit bias, blocked tokens, penalties (repetition over prompt and
output, frequency and presence over the output), then for a sampled row
temperature, min-p, top-k, and top-p over what top-k kept; a greedy row stops
before temperature.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import numpy as np
import pytest
from engine_utils import prompt_logits

from jaxserve import LLM, RequestOutputKind, SamplingParams
from jaxserve.config import LOGPROBS_MODES
from jaxserve.runner.input_batch import MAX_TOP_LOGPROBS, SampleRow, build_sampling
from jaxserve.runner.sampler import sample
from jaxserve.sampling_params import ParamError

V = 64
TINY = "demo-model-tiny"


def log_softmax(x: np.ndarray) -> np.ndarray:
    top = x[np.isfinite(x)].max()
    return x - top - np.log(np.exp(x - top).sum())


def processed(
    logits: np.ndarray,
    p: SamplingParams,
    history: list[int],
    num_prompt: int,
    blocked: tuple[int, ...] = (),
) -> np.ndarray:
    """The logits a row with `p` samples from (float64; -inf where excluded)."""
    x = np.asarray(logits, np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    x[list(blocked)] = -np.inf
    if p.repetition_penalty != 1.0:
        for t in set(history):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in collections.Counter(history[num_prompt:]).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.temperature == 0:
        return x
    x = x / p.temperature
    probs = np.exp(log_softmax(x))
    x[probs < p.min_p * probs.max()] = -np.inf
    order = np.argsort(-x, kind="stable")
    if p.top_k:
        x[x < x[order[min(p.top_k, len(x)) - 1]]] = -np.inf
    if p.top_p < 1.0:
        probs = np.exp(log_softmax(x))[order]
        before = np.cumsum(probs) - probs
        kept = x[order][before < p.top_p].min()
        x[x < kept] = -np.inf
    return x


def values(mode: str, raw: np.ndarray, proc: np.ndarray) -> np.ndarray:
    """What `mode` reports, from the raw and the processed logits."""
    x = raw if mode.startswith("raw") else proc
    return x if mode.endswith("logits") else log_softmax(x)


def assert_entry(entry: dict[int, float], token: int, want: np.ndarray, k: int) -> None:
    """An output's logprobs entry against the reference values `want` [V]: the top k
    first, in order (the device's), then the sampled token's if it is not among them."""
    top = list(entry.items())[:k]
    assert token in entry and len(entry) == k + (token not in dict(top)), (entry, token, k)
    np.testing.assert_allclose(entry[token], want[token], rtol=1e-4, atol=1e-4)
    got = np.array([v for _, v in top])
    np.testing.assert_allclose(got, np.sort(want)[::-1][:k], rtol=1e-4, atol=1e-4)
    ids = np.array([t for t, _ in top], np.int64)[np.isfinite(got)]
    np.testing.assert_allclose(want[ids], got[np.isfinite(got)], rtol=1e-4, atol=1e-4)


def test_the_mode_is_checked_naming_the_value():
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of .* got 'processed'"):
        LLM(TINY, logprobs_mode="processed")  # (refused before anything is loaded)
    # (--logprobs_mode: tests/server_tests/test_cli.py, where the CLI's flags are defined)


# ------------------------------------------------------------------ the sampler


@functools.cache
def jitted_sample(mode: str):
    return jax.jit(functools.partial(sample, logprobs_mode=mode))


def run(logits: np.ndarray, rows: list[SampleRow], mode: str):
    md = build_sampling(rows, seq_bucket=len(rows), history_len=16, max_bias=4, vocab_size=V)
    return jax.tree.map(np.asarray, jitted_sample(mode)(np.asarray(logits, np.float32), md))


SHAPED = [  # (params, blocked): every processing step, alone and together
    (dict(temperature=0.7, top_k=6), ()),
    (dict(temperature=1.3, top_p=0.6), ()),
    (dict(temperature=0.9, min_p=0.05, top_k=10, top_p=0.9), ()),
    (
        dict(temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3),
        (),
    ),
    (dict(temperature=1.1, logit_bias={3: 4.0, 7: -100.0}), (11, 12)),
    (dict(temperature=0.0, logit_bias={5: 2.5}, repetition_penalty=1.3, top_k=2), (9,)),
    (dict(temperature=0.0), ()),
]


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_sampler_values_match_numpy(mode):
    rs = np.random.RandomState(0)
    logits = (rs.randn(len(SHAPED), V) * 2).astype(np.float32)
    history, num_prompt = [1, 2, 3, 3, 5, 8, 8, 8], 4
    rows = [
        SampleRow(SamplingParams(logprobs=5, **kw), history, num_prompt, seed, blocked)
        for seed, (kw, blocked) in enumerate(SHAPED)
    ]
    out = run(logits, rows, mode)
    for i, row in enumerate(rows):
        want = values(
            mode, logits[i], processed(logits[i], row.params, history, 4, row.blocked_ids)
        )
        token = int(out.token_ids[i])
        assert np.isfinite(want[token]), (i, mode)  # never a token the processing excluded
        np.testing.assert_allclose(out.logprobs[i], want[token], rtol=1e-4, atol=1e-4)
        # Its rank, vLLM's: how many values are at least its own.
        assert (
            (want > want[token] + 1e-4).sum() < out.ranks[i] <= (want >= want[token] - 1e-4).sum()
        )
        # The top 20 values in order; -inf where fewer tokens survived the processing.
        np.testing.assert_allclose(
            out.top_logprobs[i], np.sort(want)[::-1][:MAX_TOP_LOGPROBS], rtol=1e-4, atol=1e-4
        )
        finite = np.isfinite(out.top_logprobs[i])
        np.testing.assert_allclose(
            want[out.top_ids[i][finite]], out.top_logprobs[i][finite], rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_beam_search_rows_get_the_raw_distribution_in_every_mode(mode):
    """A beam search's candidates are log_softmax(logits / its temperature), whatever
    the engine's mode; a sampled row beside them keeps the mode's values."""
    rs = np.random.RandomState(1)
    logits = (rs.randn(3, V) * 2).astype(np.float32)
    history = [1, 2, 3]
    sampled = SampleRow(SamplingParams(logprobs=5, temperature=0.7, top_k=6), history, 2, 0)
    greedy = SamplingParams(temperature=0.0)
    rows = [sampled, SampleRow(greedy, history, 2, 0, beam=1.0)]
    rows.append(SampleRow(greedy, history, 2, 0, beam=0.5))
    out = run(logits, rows, mode)
    for i, temperature in ((1, 1.0), (2, 0.5)):
        want = log_softmax(logits[i] / temperature)
        np.testing.assert_allclose(
            out.top_logprobs[i], np.sort(want)[::-1][:MAX_TOP_LOGPROBS], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(want[out.top_ids[i]], out.top_logprobs[i], rtol=1e-5, atol=1e-5)
    alone = run(logits[:1], rows[:1], mode)
    np.testing.assert_allclose(out.top_logprobs[0], alone.top_logprobs[0])
    assert out.top_ids[0].tolist() == alone.top_ids[0].tolist()


def test_processed_modes_sample_the_same_tokens_as_raw():
    """The mode changes what is reported, never what is sampled."""
    rs = np.random.RandomState(1)
    logits = (rs.randn(len(SHAPED), V) * 2).astype(np.float32)
    rows = [
        SampleRow(SamplingParams(logprobs=2, **kw), [1, 2, 3], 2, seed, blocked)
        for seed, (kw, blocked) in enumerate(SHAPED)
    ]
    tokens = {mode: run(logits, rows, mode).token_ids.tolist() for mode in LOGPROBS_MODES}
    assert len(set(map(tuple, tokens.values()))) == 1, tokens


# ------------------------------------------------------------------- the engine

SMALL = dict(
    max_model_len=128,
    block_size=8,
    num_kv_pages=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    warmup=False,
    # No cached pages: `reference_logits` computes into free pages after the requests.
    enable_prefix_caching=False,
)
PROMPT = "Once upon a time there was a little"
SHAPED_PARAMS = [
    SamplingParams(
        temperature=0.8,
        top_k=12,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={5: 2.0, 9: -100.0},
        logprobs=5,
        prompt_logprobs=3,
        max_tokens=6,
        ignore_eos=True,
        seed=3,
    ),
    SamplingParams(
        temperature=0.0,
        repetition_penalty=1.4,
        logit_bias={268: 1.5},
        logprobs=4,
        prompt_logprobs=2,
        max_tokens=6,
        ignore_eos=True,
    ),
    SamplingParams(temperature=1.0, top_k=3, logprobs=6, max_tokens=4, ignore_eos=True, seed=1),
]


@pytest.fixture(scope="module")
def engines():
    """engines(mode, **settings): the module's engine of that mode and settings, made
    once (the demo model's tiny sibling); all closed at the module's end."""
    made: dict[str, LLM] = {}

    def get(mode: str, **kw) -> LLM:
        key = repr((mode, sorted(kw.items())))
        if key not in made:
            made[key] = LLM(TINY, logprobs_mode=mode, compilation_cache_dir=None, **SMALL, **kw)
        return made[key]

    yield get
    for llm in made.values():
        llm.close()


def reference_logits(llm: LLM, ids: list[int]) -> np.ndarray:
    """The model's logits [len(ids), V] over `ids`, computed in one step of its own
    (on free pages), independently of the steps that sampled them."""
    pages = list(range(1, -(-len(ids) // 8) + 1))
    assert llm.engine.pool.num_free == llm.engine.pool.capacity  # nothing else is there
    return prompt_logits(llm.engine.runner, ids, pages).astype(np.float64)


def check_request(llm: LLM, mode: str, out, p: SamplingParams) -> int:
    """Every output and prompt entry of a finished request against numpy; returns how
    many sampled tokens fell outside their entry's top k."""
    prompt = list(out.prompt_token_ids)
    c = out.outputs[0]
    full = prompt + list(c.token_ids)
    raw = reference_logits(llm, full)
    outside = 0
    for t, token in enumerate(c.token_ids):
        pos = len(prompt) + t - 1  # the row that predicts output token t
        proc = processed(raw[pos], p, full[: pos + 1], len(prompt))
        assert np.isfinite(proc[token])  # a token the processing excluded is never drawn
        assert_entry(c.logprobs[t], token, values(mode, raw[pos], proc), p.logprobs)
        outside += len(c.logprobs[t]) > p.logprobs
    if p.prompt_logprobs is not None:
        # As vLLM: no sampling processing at a prompt position; processed == raw there.
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            want = values(mode, raw[i - 1], raw[i - 1])
            assert_entry(out.prompt_logprobs[i], prompt[i], want, p.prompt_logprobs)
    return outside


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_engine_logprobs_match_numpy(engines, mode):
    llm = engines(mode)
    outs = llm.generate([PROMPT] * len(SHAPED_PARAMS), SHAPED_PARAMS, use_tqdm=False)
    for out, p in zip(outs, SHAPED_PARAMS, strict=True):
        check_request(llm, mode, out, p)
    # top_k=3 with 6 logprobs: in the processed modes 3 of them are -inf (cut).
    entries = outs[2].outputs[0].logprobs
    cut = [sum(v == -np.inf for v in e.values()) for e in entries]
    assert cut == ([3] * len(entries) if mode.startswith("processed") else [0] * len(entries))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_sampled_token_is_always_there(engines, mode):
    """logprobs=0 gives the sampled token's entry alone; logprobs=1 the top token and,
    where another was drawn, the sampled one beside it (vLLM's k + 1)."""
    llm = engines(mode)
    params = [
        SamplingParams(temperature=0.8, logprobs=k, max_tokens=12, ignore_eos=True, seed=7)
        for k in (0, 1)
    ]
    outs = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert all(len(e) == 1 for e in outs[0].outputs[0].logprobs)
    assert check_request(llm, mode, outs[0], params[0]) == 12
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids  # (the same seed)
    assert 0 < check_request(llm, mode, outs[1], params[1]) < 12  # some, not all, outside


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_ngram_speculation_gives_the_logprobs_of_no_speculation(engines, mode):
    """Greedy with a penalty and a bias: each verifying row is processed with its own
    history (the drafts before it), so accepted drafts carry their own step's values."""
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    prompt = "1 2 3 4 5 6 7 8 9 10 11 12"  # (its greedy output repeats itself)
    p = SamplingParams(
        temperature=0.0,
        frequency_penalty=0.05,
        logit_bias={268: 0.5},
        logprobs=3,
        max_tokens=24,
        ignore_eos=True,
    )
    plain = engines(mode).generate([prompt], p, use_tqdm=False)[0].outputs[0]
    speculating = engines(mode, speculative_config=spec)
    fast = speculating.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    stats = speculating.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0  # drafts were accepted
    assert fast.token_ids == plain.token_ids
    for a, b in zip(fast.logprobs, plain.logprobs, strict=True):
        assert list(a) == list(b)
        np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_processed_mode_compiles_the_same_programs_and_nothing_after_warm_up(monkeypatch):
    """The mode is bound into the programs, not a second set of them: warm-up compiles
    a forward and a prompt-logprob program per token bucket and two sampling programs
    per row bucket, as in the default mode; serving every kind of request then
    compiles nothing (compile_guard raises if a step would)."""
    from jaxserve.runner import warmup

    made = {}
    warm_up = warmup.warm_up

    def recording(runner, extra):
        made.update(warm_up(runner, extra))
        return made

    monkeypatch.setattr(warmup, "warm_up", recording)
    kw = {**SMALL, "warmup": True, "max_num_batched_tokens": 32}
    with LLM(
        TINY,
        logprobs_mode="processed_logprobs",
        compile_guard=True,
        compilation_cache_dir=None,
        **kw,
    ) as llm:
        runner = llm.engine.runner
        tokens, rows = runner.token_buckets, runner.row_buckets
        assert sorted(made) == sorted(
            [f"forward T={t}" for t in tokens]
            + [f"prompt logprobs T={t}" for t in tokens]
            + [f"sample B={b}" for b in rows]
            + [f"sample+full B={b}" for b in rows]
            + [f"kv copy n={n}" for n in runner.copy_buckets]
            + ["page table writes"]
        )
        compiled = runner.compiles.count
        prompts = [PROMPT, "A", "The quick brown fox jumps over the lazy dog again and again"]
        for params in (SHAPED_PARAMS, SHAPED_PARAMS[::-1], [SamplingParams(max_tokens=3)] * 3):
            llm.generate(prompts, params, use_tqdm=False)
        assert runner.compiles.count == compiled


# Plain batches of each kind a GPU's warm programs cover (`WARM_BRANCHES`), then the
# full ones above: greedy, greedy with logprobs, sampling with and without top-p.
PLAIN_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.0, logprobs=2, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True, seed=4),
    SamplingParams(temperature=0.9, top_p=0.8, logprobs=1, max_tokens=5, ignore_eos=True, seed=5),
]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_host_decided_branches_serve_what_the_device_decides(engines, mode):
    """`sampling_branches="host"` (a GPU's default, with asynchronous scheduling
    there): every request, alone and in mixed batches, gets the tokens and logprobs of
    the device-decided programs of the same scheduling. (Asynchronous steps batch
    differently, which moves a mixed batch's logprobs in the last bits: each mode is
    compared with its own.)"""
    for params in ([p] for p in PLAIN_PARAMS), [PLAIN_PARAMS], [SHAPED_PARAMS + PLAIN_PARAMS]:
        for batch in params:
            prompts = [PROMPT] * len(batch)
            for overlap in (False, True):
                outs = {
                    b: engines(mode, sampling_branches=b, async_scheduling=overlap).generate(
                        prompts, batch, use_tqdm=False
                    )
                    for b in ("device", "host")
                }
                for a, b in zip(outs["device"], outs["host"], strict=True):
                    assert a.outputs[0].token_ids == b.outputs[0].token_ids, overlap
                    assert a.outputs[0].logprobs == b.outputs[0].logprobs, overlap
                    assert a.prompt_logprobs == b.prompt_logprobs, overlap


def test_host_decided_branches_compile_their_programs_in_warm_up(monkeypatch):
    """Warm-up compiles each row bucket's WARM_BRANCHES programs (the first of each
    kind under the usual name); serving every kind of request compiles nothing more
    (compile_guard raises if a step would)."""
    from jaxserve.runner import warmup
    from jaxserve.runner.input_batch import WARM_BRANCHES

    made = {}
    warm_up = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda r, e: made.update(warm_up(r, e)) or made)
    kw = {**SMALL, "warmup": True, "max_num_batched_tokens": 32, "max_num_seqs": 4}
    with LLM(
        TINY, sampling_branches="host", compile_guard=True, compilation_cache_dir=None, **kw
    ) as llm:
        rows = llm.engine.runner.row_buckets
        sampling = sorted(name for name in made if name.startswith("sample"))
        per_bucket = len(WARM_BRANCHES[False]) + len(WARM_BRANCHES[True])
        assert len(sampling) == per_bucket * len(rows)
        assert {f"sample B={b}" for b in rows} | {f"sample+full B={b}" for b in rows} <= set(
            sampling
        )
        assert f"sample B={rows[0]} draw+cut" in sampling
        compiled = llm.engine.runner.compiles.count
        for params in (SHAPED_PARAMS, PLAIN_PARAMS, PLAIN_PARAMS[::-1]):
            llm.generate([PROMPT] * len(params), params, use_tqdm=False)
        assert llm.engine.runner.compiles.count == compiled


def test_sampling_branches_is_checked_naming_the_value():
    with pytest.raises(ValueError, match="sampling_branches.*'gpu'"):
        LLM(TINY, sampling_branches="gpu")


def test_detokenize_false_gives_token_ids_only(engines, monkeypatch):
    """vLLM's `detokenize=False`: the same tokens and logprobs, no text (no detokenizer
    is made for the request); stop strings, which match text, are refused."""
    from jaxserve.engine import core

    made = []
    detokenizer = core.IncrementalDetokenizer
    monkeypatch.setattr(
        core,
        "IncrementalDetokenizer",
        lambda tok, ids, p: made.append(p) or detokenizer(tok, ids, p),
    )
    llm = engines("raw_logprobs")
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    with_text, ids_only = llm.generate(
        [PROMPT, PROMPT], [p, dataclasses.replace(p, detokenize=False)], use_tqdm=False
    )
    # the first request's alone (generate asks for its final output only)
    assert made == [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)]
    a, b = with_text.outputs[0], ids_only.outputs[0]
    assert a.text and b.text == "" and b.token_ids == a.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):  # (rows of one batch: float noise)
        assert list(x) == list(y)
        np.testing.assert_allclose(list(x.values()), list(y.values()), rtol=1e-5)
    with pytest.raises(ParamError, match="stop strings match text") as e:
        SamplingParams(stop=["."], detokenize=False)
    assert e.value.field == "stop"
    with pytest.raises(ParamError, match="detokenize must be a bool") as e:
        SamplingParams(detokenize="no")
    assert e.value.field == "detokenize"
