"""Beam search over HTTP (completions' `use_beam_search` with n / best_of, vLLM's extra
fields) and gRPC (`GenerateRequest.beam_search`), against `LLM.beam_search` on the
same model; refusals name the field as the client sent it."""

import json

import grpc
import httpx
import pytest
from conftest import ServerThread

from jaxserve import LLM
from jaxserve.sampling_params import BeamSearchParams
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc

PROMPT = "The quick brown fox"
KW = dict(max_model_len=128, block_size=8, num_kv_pages=256, max_num_seqs=32, warmup=False)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    server = ServerThread(tiny_model_dir, http_port=0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """The best 4 of a beam search of width 4 and of width 2 (length penalty 0.5)."""
    with LLM(tiny_model_dir, max_num_batched_tokens=256, **KW) as llm:
        return {
            k: llm.beam_search(
                PROMPT, BeamSearchParams(beam_width=k, max_tokens=8, length_penalty=0.5)
            )[0].sequences
            for k in (2, 4)
        }


def test_completions_use_beam_search_n_and_best_of(http, offline):
    # best_of beams, the n best returned; n alone is the beam width.
    for body, k, n in (({"n": 2, "best_of": 4}, 4, 2), ({"n": 2}, 2, 2), ({"n": 4}, 4, 4)):
        for stream in (False, True):
            r = http.post(
                "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": PROMPT,
                    "max_tokens": 8,
                    "use_beam_search": True,
                    "length_penalty": 0.5,
                    "stream": stream,
                    **body,
                },
            )
            assert r.status_code == 200, r.text
            if stream:
                chunks = [
                    json.loads(line[6:])
                    for line in r.text.splitlines()
                    if line.startswith("data: {")
                ]
                texts = {}
                for chunk in chunks:
                    for c in chunk["choices"]:
                        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                        assert c["logprobs"] is None  # not asked for (they were sent)
                got = [texts[i] for i in sorted(texts)]
            else:
                choices = r.json()["choices"]
                assert all(c["logprobs"] is None for c in choices)  # not asked for
                got = [c["text"] for c in sorted(choices, key=lambda c: c["index"])]
            assert got == [s.text for s in offline[k][:n]], (body, stream)
    asked = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "use_beam_search": True}
    r = http.post("/v1/completions", json={**asked, "n": 2, "logprobs": 1})
    assert all(len(c["logprobs"]["tokens"]) >= 1 for c in r.json()["choices"])


def test_grpc_beam_search(served, offline):
    with grpc.insecure_channel(served.target) as channel:
        stub = pb_grpc.JaxServeStub(channel)
        request = pb.GenerateRequest(
            prompt=PROMPT,
            sampling_params=pb.SamplingParams(max_tokens=8, n=3),
            beam_search=pb.BeamSearch(beam_width=4, length_penalty=0.5),
        )
        reply = stub.Complete(request, timeout=120)
        assert [c.text for c in reply.completions] == [s.text for s in offline[4][:3]]
        assert [list(c.token_ids) for c in reply.completions] == [
            s.tokens[-len(c.token_ids) :]
            for s, c in zip(offline[4][:3], reply.completions, strict=True)
        ]
        bad = pb.GenerateRequest(
            prompt=PROMPT,
            sampling_params=pb.SamplingParams(max_tokens=8, top_p=0.5),
            beam_search=pb.BeamSearch(beam_width=2),
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(bad, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
        bad = pb.GenerateRequest(
            prompt=PROMPT,
            sampling_params=pb.SamplingParams(max_tokens=8),
            beam_search=pb.BeamSearch(beam_width=2, early_stopping="sometimes"),
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(bad, timeout=60)
        assert "beam_search.early_stopping" in e.value.details()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"n": 11}, "n"),  # beam_width past 10
        ({"n": 2, "best_of": 11}, "best_of"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 2, "top_p": 0.5}, "top_p"),
        ({"n": 2, "response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 2, "early_stopping": "sometimes"}, "early_stopping"),
        ({"n": 2, "max_tokens": None}, "max_tokens"),
        ({"n": 2, "stop": ["x"]}, "stop"),
    ],
)
def test_refusals_name_the_param(http, body, param):
    r = http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "use_beam_search": True, **body},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_chat_completions_refuse_beam_search(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_best_of_without_beam_search_must_equal_n(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "n": 1, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_a_beam_search_is_never_split_between_prefill_and_decode():
    from jaxserve.sampling_params import SamplingParams
    from server import disagg

    assert disagg.can_disaggregate(SamplingParams(), beam_search=True) == "beam_search"
    assert disagg.can_disaggregate(SamplingParams()) is None
