"""A randomized test of the gRPC server: hundreds of requests mixing valid edge values
and invalid ones. Valid requests are served; an invalid one is refused with
INVALID_ARGUMENT naming its field; nothing gets INTERNAL or hangs, and afterwards
no request and no KV page is left behind."""

import asyncio
import math
import random

import grpc
import pytest
from conftest import ServerThread
from test_server import request, stub, wait_idle

from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc

VOCAB, MAX_LEN = 320, 128  # the tiny test model; ServerThread's max_model_len

# field -> (valid values, [(invalid value, text the error must contain)])
SAMPLING = {
    "temperature": (
        [0.0, 1e-6, 0.7, 2.0, 1e30],
        [(-1.0, "temperature"), (math.nan, "temperature"), (math.inf, "temperature")],
    ),
    "top_p": ([1e-3, 0.5, 1.0], [(0.0, "top_p"), (1.5, "top_p")]),
    "top_k": ([-1, 0, 1, 5, VOCAB + 80, 2**31 - 1], [(-5, "top_k")]),
    "min_p": ([0.0, 0.2, 1.0], [(1.5, "min_p"), (-0.1, "min_p")]),
    "presence_penalty": ([-2.0, 0.0, 2.0], [(2.5, "presence_penalty")]),
    "frequency_penalty": ([-2.0, 0.5, 2.0], [(-3.0, "frequency_penalty")]),
    "repetition_penalty": ([0.5, 1.0, 2.0], [(0.0, "repetition_penalty")]),
    "seed": ([0, 1, -5, 2**62], []),
    "n": ([1, 2, 3], [(0, "n must be"), (129, "n must be")]),
    "logprobs": ([0, 3, 20], [(21, "logprobs")]),
    "prompt_logprobs": ([0, 5], [(21, "prompt_logprobs")]),
    "stop": ([[], ["x"], ["\n", "e "]], [([""], "stop")]),
    "stop_token_ids": (
        [[], [5], list(range(1, 101)), list(range(7, 207))],
        [([-1], "stop_token_ids"), ([5, VOCAB], "stop_token_ids")],
    ),
    "logit_bias": (
        [{}, {5: 100.0}, {i: -1.0 for i in range(300)}],
        [
            ({999: 1.0}, "logit_bias"),
            ({5: 500.0}, "logit_bias"),
            ({i: 1.0 for i in range(301)}, "logit_bias"),
        ],
    ),
}


def _prompt(rs: random.Random, kw: dict) -> tuple[str | None, int]:
    """Sets the request's input; returns (expected error text or None, prompt length bound)."""
    kind = rs.choice(["text", "ids", "ids", "messages", "bad"])
    if kind == "text":
        kw["prompt"] = rs.choice(["a", "The quick brown fox", "  spaces\nand lines ", "é 日本"])
        return None, 32
    if kind == "ids":
        edge = [0, 1, VOCAB - 1]
        ids = [rs.choice([*edge, rs.randrange(VOCAB)]) for _ in range(rs.randint(1, 60))]
        kw["prompt_token_ids"] = pb.TokenIds(ids=ids)
        return None, 60
    if kind == "messages":
        kw["messages"] = pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content=rs.choice(["hi", "", "Ça va?"]))]
        )
        return None, 48
    bad, match = rs.choice(
        [
            (None, "one of prompt, prompt_token_ids or messages"),
            ([], "prompt_token_ids must not be empty"),
            ([5, VOCAB], "prompt_token_ids has ids outside the vocabulary"),
            ([5] * MAX_LEN, "prompt has 128 tokens"),
            ("messages", "messages must not be empty"),
        ]
    )
    if bad == "messages":
        kw["messages"] = pb.ChatMessages()
    elif bad is not None:
        kw["prompt_token_ids"] = pb.TokenIds(ids=bad)
    return match, 0


def random_request(rs: random.Random, i: int) -> tuple[pb.GenerateRequest, str | None]:
    """A request with at most one invalid field, and the text its error must contain."""
    kw = {"request_id": f"fuzz-{i}", "priority": rs.randint(-3, 3)}
    if rs.random() < 0.3:
        kw["cache_salt"] = rs.choice(["tenant-a", "tenant-b"])
    expected, _ = _prompt(rs, kw)
    sp = {
        "max_tokens": rs.choice([1, 2, 5, 8]),
        "ignore_eos": rs.random() < 0.5,
        "include_stop_str_in_output": rs.random() < 0.5,
        "skip_special_tokens": rs.random() < 0.5,
    }
    for field, (valid, _) in SAMPLING.items():
        if valid and rs.random() < 0.4:
            sp[field] = rs.choice(valid)
    if sp.get("stop_token_ids"):
        sp["min_tokens"] = rs.randint(1, sp["max_tokens"])  # blocks every stop id for a while
    if expected is None and rs.random() < 0.35:
        choice = rs.choice(
            [(f, bad) for f, (_, bads) in SAMPLING.items() for bad in bads]
            + [("max_tokens", (0, "max_tokens")), ("max_tokens", (500, "max_tokens"))]
            + [("min_tokens", (9, "min_tokens"))]
        )
        field, (value, expected) = choice
        sp[field] = value
        if field == "min_tokens":
            sp["max_tokens"] = 8
    if "logit_bias" in sp:
        sp["logit_bias"] = {int(k): float(v) for k, v in sp["logit_bias"].items()}
    return pb.GenerateRequest(sampling_params=pb.SamplingParams(**sp), **kw), expected


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    server = ServerThread(tiny_model_dir)
    yield server
    server.stop()


def test_min_tokens_with_100_stop_ids_is_served(fuzz_server):
    """vLLM accepts any number of stop ids; min_tokens blocks them all on the device."""
    req = request(max_tokens=6, min_tokens=6, stop_token_ids=list(range(100)), ignore_eos=False)
    out = stub(fuzz_server.target).Complete(req)
    ids = out.completions[0].token_ids
    assert len(ids) == 6 and not set(ids) & set(range(100))


@pytest.mark.slow
def test_randomized_requests_are_served_or_refused_by_name(fuzz_server):
    rs = random.Random(1234)
    cases = [random_request(rs, i) for i in range(320)]
    assert 80 < sum(e is not None for _, e in cases) < 240  # a real mix of both

    async def one(s, req, expected, limit, unary):
        async with limit:
            try:
                if unary:
                    resp = await asyncio.wait_for(s.Complete(req), 120)
                    outs = list(resp.completions)
                else:
                    msgs = await asyncio.wait_for(_collect(s.Generate(req)), 120)
                    outs = [m for m in msgs if m.finish_reason]
            except grpc.aio.AioRpcError as e:
                return ("error", e.code(), e.details())
            return ("ok", outs)

    async def main():
        async with grpc.aio.insecure_channel(fuzz_server.target) as channel:
            s = pb_grpc.JaxServeStub(channel)
            limit = asyncio.Semaphore(24)
            return await asyncio.gather(
                *(one(s, req, exp, limit, i % 2 == 0) for i, (req, exp) in enumerate(cases))
            )

    results = asyncio.run(main())
    for (req, expected), result in zip(cases, results, strict=True):
        where = f"{req.request_id}: {req}"
        if expected is None:
            assert result[0] == "ok", f"valid request refused: {result} for {where}"
            n = req.sampling_params.n if req.sampling_params.HasField("n") else 1
            assert len(result[1]) == n, where
            assert all(c.finish_reason in ("stop", "length") for c in result[1]), where
        else:
            assert result[0] == "error", f"invalid request served ({expected}): {where}"
            code, details = result[1], result[2]
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, where)
            assert expected in details, (expected, details)
    wait_idle(fuzz_server.engine)
    assert not fuzz_server.engine.requests and fuzz_server.server.state.engine.num_requests == 0
    assert stub(fuzz_server.target).Complete(request(max_tokens=2)).usage.completion_tokens == 2


async def _collect(call):
    return [m async for m in call]
