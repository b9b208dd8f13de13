"""The offline API end to end: LLM(...).generate(...) on a small checkpoint."""

import math
import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(
        tiny_model_dir,
        max_model_len=96,
        block_size=8,
        num_kv_pages=40,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )


def _assert_idle(llm):
    assert not llm.engine.has_unfinished()
    llm.engine.pool.check_invariant()
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_text_and_token_prompts(llm):
    ids = llm.tokenizer.encode("The quick brown fox")
    text_out, ids_out = llm.generate(["The quick brown fox", {"prompt_token_ids": ids}], GREEDY)
    assert text_out.prompt == "The quick brown fox"
    assert text_out.prompt_token_ids == ids_out.prompt_token_ids == ids
    a, b = text_out.outputs[0], ids_out.outputs[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.finish_reason == "length"
    # A random model may end on half a UTF-8 character, which is never emitted.
    assert a.text == llm.tokenizer.decode(a.token_ids).rstrip("\ufffd")
    _assert_idle(llm)


def test_batched_equals_alone_with_chunked_prefill_and_queueing(llm):
    rs = np.random.RandomState(0)
    # 7 prompts > max_num_seqs=4, and prompts longer than the 32-token step budget.
    prompts = [
        {"prompt_token_ids": rs.randint(7, 320, size=n).tolist()} for n in (3, 40, 8, 17, 33, 1, 64)
    ]
    together = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, together, strict=True):
        alone = llm.generate([p], GREEDY)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    _assert_idle(llm)


def test_stop_token_ids_and_min_tokens(llm):
    prompt = {"prompt_token_ids": [1, 50, 60, 70]}
    free = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at])
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: first + 1]
    # The stop token is not rendered.
    assert out.text == llm.tokenizer.decode(free[:first]).rstrip("\ufffd")
    later = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert len(later.token_ids) >= 6


def test_stop_string_before_min_tokens_keeps_the_text_whole(llm):
    """A stop string that appears before min_tokens is not looked for (vLLM), so the
    text still equals the decoded tokens; it used to be cut at the stop string while
    the tokens went on, and the two no longer matched."""
    prompt = {"prompt_token_ids": [1, 50, 60, 70]}
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate([prompt], SamplingParams(**params))[0].outputs[0]
    # The first real character of the output, and how many tokens it took to appear.
    k, stop = next(
        (k, ch)
        for k in range(1, 13)
        for ch in llm.tokenizer.decode(free.token_ids[:k])
        if ch != "\ufffd"
    )
    out = llm.generate([prompt], SamplingParams(**params, min_tokens=k + 8, stop=[stop]))[0]
    c = out.outputs[0]
    assert len(c.token_ids) >= k + 8 and c.token_ids == free.token_ids[: len(c.token_ids)]
    whole = llm.tokenizer.decode(c.token_ids).rstrip("\ufffd")
    if c.finish_reason == "stop":  # a later occurrence, ending at or after min_tokens
        assert c.stop_reason == stop and whole.startswith(c.text)
        assert stop in c.text  # the early occurrence was kept
    else:
        assert c.text == whole
    _assert_idle(llm)


def test_per_prompt_sampling_params(llm):
    outs = llm.generate(
        ["a", "b"],
        [
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        ],
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ({"prompt_token_ids": []}, GREEDY, "prompt_token_ids must not be empty"),
        ({"prompt_token_ids": [5, 320]}, GREEDY, r"outside the vocabulary \[0, 320\)"),
        ({"prompt_token_ids": [-1]}, GREEDY, "outside the vocabulary"),
        ({"prompt_token_ids": [5] * 96}, GREEDY, "max_model_len is 96"),
        ({"prompt_token_ids": [5] * 90}, GREEDY, r"max_tokens \(12\) exceeds max_model_len"),
        (42, GREEDY, r"prompts\[1\]: a prompt must be text"),
    ],
)
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(llm, prompt, params, match):
    with pytest.raises(ValueError, match=r"prompts\[1\]") as e:
        llm.generate(["fine prompt", prompt], [GREEDY, params])
    e.match(match)
    _assert_idle(llm)  # the good prompt of the rejected call was not left queued
    assert len(llm.generate(["still serving"], GREEDY)[0].outputs[0].token_ids) == 12


def test_request_larger_than_the_pool_is_rejected(tiny_model_dir):
    small = LLM(
        tiny_model_dir, max_model_len=96, block_size=8, num_kv_pages=4, max_num_seqs=2, warmup=False
    )
    with pytest.raises(ValueError, match="whole pool has 3"):
        small.generate([{"prompt_token_ids": [5] * 30}], GREEDY)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("max_tokens", 0, "max_tokens must be an integer >= 1"),
        ("max_tokens", -3, "max_tokens"),
        ("temperature", math.nan, "temperature must be a finite number"),
        ("temperature", -0.5, "temperature must be >= 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
        ("logprobs", 21, r"logprobs must be an integer in \[0, 20\]"),
        ("n", 0, r"n must be an integer in \[1, 128\]"),
        ("n", 10_000, r"n must be an integer in \[1, 128\]"),
        ("top_k", -2, "top_k"),
        ("stop", [""], "stop must be non-empty strings"),
        ("temperature", 1e300, "temperature must be finite in float32"),
        ("repetition_penalty", 1e300, "repetition_penalty must be finite in float32"),
        ("repetition_penalty", 1e-300, "repetition_penalty must be > 0"),
        ("seed", 2**63, "seed must be a 64-bit signed integer"),
        ("seed", 10**30, "seed must be a 64-bit signed integer"),
    ],
)
def test_sampling_params_validation_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_a_refused_value_names_its_field_as_data(llm):
    """Front ends report the field from `ParamError.field`, not from the message's text;
    it survives pickling (a Ray replica's error) and LLM.generate's prompt prefix."""
    import pickle

    from jaxserve.sampling_params import ParamError

    with pytest.raises(ParamError) as e:
        SamplingParams(top_p=2.0)
    assert e.value.field == "top_p"
    again = pickle.loads(pickle.dumps(e.value))
    assert (again.field, str(again)) == ("top_p", str(e.value))
    with pytest.raises(ParamError, match=r"prompts\[0\]: prompt \(4 tokens\) \+ max_tokens") as e:
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=500))
    assert e.value.field == "max_tokens"


def test_a_tiny_temperature_is_raised_to_the_float32_safe_floor():
    assert SamplingParams(temperature=1e-40).temperature == 0.01
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(temperature=0.0).greedy


def test_values_past_the_device_arrays_are_bounded_offline(llm):
    """Offline, top_k 2**31 raised a bare OverflowError from the device-input builder;
    stop_token_ids past the vocabulary were accepted (issue 28)."""
    prompt = {"prompt_token_ids": [1, 50, 60, 70]}
    sampled = lambda top_k: SamplingParams(max_tokens=6, seed=3, top_k=top_k)
    want = llm.generate([prompt], sampled(320))[0].outputs[0].token_ids
    for top_k in (2**31, 10**20):
        assert llm.generate([prompt], sampled(top_k))[0].outputs[0].token_ids == want
    bad = SamplingParams(max_tokens=4, stop_token_ids=[7, 320])
    with pytest.raises(ValueError, match=r"stop_token_ids names token 320, outside"):
        llm.generate([prompt], bad)
    _assert_idle(llm)


def test_model_must_be_a_local_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_bfloat16_runs_and_a_slow_dtype_is_named_in_the_log(tiny_model_dir, caplog):
    with caplog.at_level("WARNING", logger="jaxserve.runner.model_runner"):
        llm = LLM(
            tiny_model_dir,
            dtype="fp16",
            max_model_len=64,
            block_size=8,
            num_kv_pages=16,
            warmup=False,
        )
    assert "dtype=float16 is slow on this CPU" in caplog.text
    assert "float32 is the fast one" in caplog.text
    llm = LLM(
        tiny_model_dir, dtype="bf16", max_model_len=64, block_size=8, num_kv_pages=16, warmup=False
    )
    out = llm.generate(["The quick brown fox"], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 12
    assert llm.engine.runner.kv_caches[0].dtype.name == "bfloat16"


def test_token_ids_only_with_skip_tokenizer_init(tiny_model_dir, llm):
    """skip_tokenizer_init: ids in, ids out; text prompts and stop strings are refused."""
    plain = LLM(
        tiny_model_dir,
        skip_tokenizer_init=True,
        max_model_len=96,
        block_size=8,
        num_kv_pages=40,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        warmup=False,
    )
    assert plain.tokenizer is None
    prompt = {"prompt_token_ids": [1, 50, 60, 70]}
    out = plain.generate([prompt], GREEDY)[0].outputs[0]
    assert out.token_ids == llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert out.text == ""
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt: this engine has no tokenizer"):
        plain.generate(["text"], GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        plain.generate([prompt], SamplingParams(max_tokens=4, stop=["x"]))
    _assert_idle(plain)


def test_tokenizer_from_another_directory(tiny_model_dir, tmp_path):
    import shutil

    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_model_dir, name), tmp_path / name)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        LLM(tmp_path, max_model_len=96, num_kv_pages=40, max_num_seqs=4)
    llm = LLM(
        tmp_path,
        tokenizer=tiny_model_dir,
        max_model_len=96,
        num_kv_pages=40,
        max_num_seqs=4,
        warmup=False,
    )
    assert llm.generate(["The quick"], GREEDY)[0].outputs[0].text


def test_generate_inside_a_running_event_loop(llm):
    """As in a Jupyter cell, where an event loop runs (over data-parallel replicas:
    `test_data_parallel.py`)."""
    import asyncio

    want = llm.generate(["The quick"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    async def cell():
        return llm.generate(["The quick"], GREEDY, use_tqdm=False)

    assert asyncio.run(cell())[0].outputs[0].token_ids == want
    _assert_idle(llm)


def test_a_detokenizer_that_raises_fails_only_its_prompt(llm, monkeypatch, caplog):
    """An exception in one request's detokenizer (here: the one with stop=["~fails~"])
    used to end `generate` for every prompt; now that prompt's output names the cause,
    the others are whole, and the engine serves on."""
    from jaxserve.detokenizer import IncrementalDetokenizer

    prompts = ["The quick", "Hello there", "One two"]
    want = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    add = IncrementalDetokenizer.add

    def add_or_fail(self, token_id, **kw):
        if self.stop == ["~fails~"] and len(self.text) > 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return add(self, token_id, **kw)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add_or_fail)
    failing = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["~fails~"])
    outs = llm.generate(prompts, [GREEDY, failing, GREEDY], use_tqdm=False)
    for i in (0, 2):
        assert outs[i].error is None
        assert (outs[i].outputs[0].token_ids, outs[i].outputs[0].text) == (
            want[i].token_ids,
            want[i].text,
        )
    bad = outs[1]
    assert bad.finished and bad.outputs[0].finish_reason == "abort"
    assert "UnicodeDecodeError" in bad.error and "injected" in bad.error, bad.error
    assert bad.outputs[0].token_ids == want[1].token_ids[: len(bad.outputs[0].token_ids)]
    assert any(r.exc_info for r in caplog.records if "failed on the engine" in r.getMessage())
    _assert_idle(llm)
    assert llm.engine.stats().kv_cache_usage == 0
    monkeypatch.undo()
    assert llm.generate(prompts[1:2], GREEDY, use_tqdm=False)[0].outputs[0].text == want[1].text


LOGS = """
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING)
from jaxserve import LLM
LLM("demo-model-tiny", max_num_seqs=4, max_num_batched_tokens=64, warmup=False,
    compilation_cache_dir=None).close()
"""


@pytest.mark.parametrize("logging_set", ["default", "configured"])
def test_the_python_api_logs_what_the_command_line_does_unless_logging_is_configured(
    logging_set,
):
    """LLM() printed no log at all (no model line, no KV capacity); now INFO on stderr,
    as vLLM's, and nothing where the program configured logging itself."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", LOGS, logging_set], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = "INFO" in proc.stderr and "KV cache:" in proc.stderr and "loaded " in proc.stderr
    assert said == (logging_set == "default"), proc.stderr[-3000:]
