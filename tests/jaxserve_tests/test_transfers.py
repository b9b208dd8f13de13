"""A step crosses between host and device once each way (issue 35): the batch and the
sampling settings go over as one packed buffer each (`runner.packing`), and the
sampled ids with their logprobs come back as one vector. They were ~27 transfers in
and 5 out a step (one per array), each a driver call and a staging copy on a GPU or
TPU.

Host -> device transfers are counted by JAX's transfer guard, which logs each one
("log_explicit": implicit and explicit alike) from C++ to the process's stderr; the
copies back by counting the arrays the runner brings to the host."""

import dataclasses
import re

import jax
import pytest

from jaxserve import LLM
from jaxserve.generate_request import GenerateRequest
from jaxserve.runner import model_runner
from jaxserve.sampling_params import SamplingParams

ENGINE = dict(
    max_model_len=256,
    block_size=16,
    num_kv_pages=160,
    max_num_seqs=16,
    max_num_batched_tokens=128,
    skip_tokenizer_init=True,
    warmup=True,  # every program compiled first: a compile transfers constants
)
STEPS = 8


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request):
    llm = LLM("demo-model-tiny", async_scheduling=request.param, **ENGINE)
    yield llm.engine
    llm.close()


def add(engine, name: str, count: int, prompt_len: int, **params):
    sp = SamplingParams(max_tokens=120, ignore_eos=True, **params)
    for i in range(count):
        ids = [(7 * i + j) % 500 + 3 for j in range(prompt_len)]
        engine.add_request(GenerateRequest(f"{name}{i}", ids, sp))


def transfers(engine, capfd, monkeypatch, steps: int) -> tuple[int, int]:
    """(host -> device, device -> host) transfers of `steps` engine steps."""
    fetched = []
    to_host = model_runner._to_host
    monkeypatch.setattr(model_runner, "_to_host", lambda x: fetched.append(1) or to_host(x))
    capfd.readouterr()
    with jax.transfer_guard("log_explicit"):
        for _ in range(steps):
            engine.step()
    logged = capfd.readouterr().err
    monkeypatch.setattr(model_runner, "_to_host", to_host)
    return len(re.findall("host-to-device transfer", logged)), len(fetched)


def test_steady_decode_moves_one_buffer_each_way(engine, capfd, monkeypatch):
    add(engine, "decode", 16, 20, temperature=0.8, top_p=0.9, seed=1)
    for _ in range(6):  # every prompt in (128 tokens a step), the batch decoding
        engine.step()
    assert len(engine.scheduler.running) == 16
    into, out = transfers(engine, capfd, monkeypatch, STEPS)
    assert into <= 2 * STEPS and out <= STEPS, (into, out)
    assert into >= STEPS  # (the guard sees them: a check that could not fail is none)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.step()


def test_mixed_steps_with_penalties_and_logprobs_too(engine, capfd, monkeypatch):
    """Prefill chunks beside decodes, the penalty history and logprobs asked: still one
    buffer each way."""
    add(engine, "running", 8, 20, repetition_penalty=1.2, logprobs=3)
    for _ in range(3):
        engine.step()
    add(engine, "prefill", 8, 100, presence_penalty=0.5)  # chunks beside the decodes
    into, out = transfers(engine, capfd, monkeypatch, STEPS)
    assert into <= 2 * STEPS and out <= STEPS, (into, out)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.step()


def test_prefix_hits_longer_than_a_step_carries_are_written_before_it():
    """Eight sequences admitted at once on a 12-page prefix-cache hit change more of
    the kept page tables (96 entries) than a step carries (128 / 16 + 2 x 16 = 40):
    the rest goes before the step by the table-write program, and each decodes the
    tokens the prompt computed without a hit gave."""
    llm = LLM("demo-model-tiny", **{**ENGINE, "enable_prefix_caching": True})
    runner = llm.engine.runner
    assert runner.page_table_host.max_writes == 40
    writes = []
    program = runner.programs.table_writes
    runner.programs = dataclasses.replace(
        runner.programs, table_writes=lambda *a: writes.append(1) or program(*a)
    )
    prompt = [(11 * j) % 500 + 3 for j in range(200)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = lambda tokens: {"prompt_token_ids": tokens}
    (alone,) = llm.generate([ids(prompt)], greedy, use_tqdm=False)
    assert not writes
    hits = llm.generate([ids(prompt + [7 + i]) for i in range(8)], greedy, use_tqdm=False)
    assert writes and all(o.num_cached_tokens == 192 for o in hits)
    again = llm.generate([ids(prompt)] * 8, greedy, use_tqdm=False)
    assert {tuple(o.outputs[0].token_ids) for o in again} == {tuple(alone.outputs[0].token_ids)}
    llm.close()
