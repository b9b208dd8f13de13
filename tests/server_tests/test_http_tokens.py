"""Tokens in, tokens out over HTTP (`POST /inference/v1/generate`, vLLM's): against
`LLM.generate` on the same model with the same settings, streamed and not; its 400s
name the field; it is behind the API key. The server runs in processed_logprobs mode,
so values a request's top_k cuts are -inf, sent as -9999.0."""

import json

import httpx
import numpy as np
import pytest
from conftest import SERVER_LLM, ServerThread

from jaxserve import LLM, SamplingParams
from server.edge import Keys
from server.openai_api.api import HttpServer, build_app

MODE = "processed_logprobs"
ENGINE = dict(SERVER_LLM, logprobs_mode=MODE)
PROMPT_IDS = [5, 17, 42, 99, 7, 250, 3]
SAMPLED = dict(
    temperature=0.9,
    top_k=3,
    seed=11,
    n=2,
    max_tokens=6,
    logprobs=5,
    prompt_logprobs=2,
    ignore_eos=True,
)
GREEDY = dict(
    temperature=0.0, repetition_penalty=1.3, logit_bias={"7": 3.0}, max_tokens=5, logprobs=0
)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    server = ServerThread(tiny_model_dir, http_port=0, llm_kwargs={"logprobs_mode": MODE})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.http_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """`LLM.generate` of the same model, settings and mode (its own engine)."""
    with LLM(tiny_model_dir, compilation_cache_dir=None, **ENGINE) as llm:

        def run(sampling: dict) -> object:
            sp = dict(sampling)
            if "logit_bias" in sp:
                sp["logit_bias"] = {int(t): v for t, v in sp["logit_bias"].items()}
            sp = SamplingParams(**sp)
            return llm.generate([{"prompt_token_ids": PROMPT_IDS}], sp, use_tqdm=False)[0]

        yield run


def post(http, **body):
    return http.post("/inference/v1/generate", json={"token_ids": PROMPT_IDS, **body})


def as_json(v: float) -> float:
    return max(v, -9999.0)


def assert_matches(choice_logprobs: dict, token_ids: list[int], entries, k: int) -> None:
    """The reply's logprobs content against the offline entries (float noise: the
    two engines batch differently)."""
    content = choice_logprobs["content"]
    assert [c["token_id"] for c in content] == token_ids
    for c, token, entry in zip(content, token_ids, entries, strict=True):
        assert c["token"] == f"token_id:{token}"
        assert c["logprob"] == pytest.approx(as_json(entry[token]), abs=1e-4)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        assert len(c["top_logprobs"]) == k
        got = [t["logprob"] for t in c["top_logprobs"]]
        assert got == pytest.approx([as_json(v) for _, v in top], abs=1e-4)
        finite = [t["token_id"] for t in c["top_logprobs"] if t["logprob"] > -9999.0]
        assert finite == [t for t, v in top if v > -np.inf]


@pytest.mark.slow
def test_ids_and_logprobs_equal_the_offline_generate(http, offline):
    for sampling in (SAMPLED, GREEDY):
        r = post(http, sampling_params=sampling)
        assert r.status_code == 200, r.text
        body = r.json()
        want = offline(sampling)
        assert body["logprobs_mode"] == MODE and body["model"] == "tiny"
        assert body["weight_version"] == want.weight_version == 0
        assert body["first_weight_version"] == want.first_weight_version == 0
        assert "text" not in json.dumps(body)  # no detokenization on this path
        assert len(body["choices"]) == len(want.outputs)
        for choice, c in zip(body["choices"], want.outputs, strict=True):
            assert choice["index"] == c.index and choice["token_ids"] == c.token_ids
            assert choice["finish_reason"] == c.finish_reason == "length"
            assert_matches(choice["logprobs"], c.token_ids, c.logprobs, sampling["logprobs"])
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(PROMPT_IDS)
        assert usage["completion_tokens"] == sum(len(c.token_ids) for c in want.outputs)
    # top_k=3 and 5 logprobs: two of each step's top 5 are cut, -inf, sent as -9999.0.
    sampled = post(http, sampling_params=SAMPLED).json()
    for choice in sampled["choices"]:
        for step in choice["logprobs"]["content"]:
            assert [t["logprob"] for t in step["top_logprobs"]][3:] == [-9999.0, -9999.0]
    want = offline(SAMPLED).prompt_logprobs
    got = sampled["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want) == len(PROMPT_IDS)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert [int(t) for t in g] == list(w)
        assert [v["logprob"] for v in g.values()] == pytest.approx(list(w.values()), abs=1e-4)


def test_streamed_chunks_add_up_to_the_reply(http):
    whole = post(http, sampling_params=SAMPLED).json()
    with http.stream(
        "POST",
        "/inference/v1/generate",
        json={
            "token_ids": PROMPT_IDS,
            "sampling_params": SAMPLED,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert chunks[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    for choice in whole["choices"]:
        mine = [
            c for chunk in chunks[:-1] for c in chunk["choices"] if c["index"] == choice["index"]
        ]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        content = [s for c in mine for s in c["logprobs"]["content"]]
        assert content == choice["logprobs"]["content"]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])


@pytest.mark.parametrize(
    "body,param",
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [5, 320]}, "token_ids"),  # the vocabulary is [0, 320)
        ({"token_ids": [5, -1]}, "token_ids"),
        ({"token_ids": [5, "a"]}, "token_ids[1]"),
        ({"sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"sampling_params": {"max_tokens": 500}}, "sampling_params.max_tokens"),
        ({"sampling_params": {"bad_words": ["x"]}}, "sampling_params.bad_words"),
        ({"sampling_params": {"stop": ["x"]}}, "sampling_params.stop"),  # (no text)
        ({"sampling_params": {"logit_bias": {"x": 1.0}}}, "sampling_params.logit_bias"),
        ({"sampling_params": {"logprobs": 21}}, "sampling_params.logprobs"),
        (
            {"sampling_params": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "sampling_params.structured_outputs",
        ),
        (
            {"sampling_params": {"structured_outputs": {"nope": 1}}},
            "sampling_params.structured_outputs",
        ),
    ],
)
def test_invalid_requests_are_400_naming_the_field(http, body, param):
    r = http.post("/inference/v1/generate", json={"token_ids": PROMPT_IDS, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_unknown_model_is_404(http):
    assert post(http, model="other").status_code == 404


def test_behind_the_api_key(served):
    state, metrics = served.server.state, served.server.metrics

    async def start():
        server = HttpServer(build_app(state, metrics, Keys(user="s3cret")), "127.0.0.1", 0)
        await server.start()
        return server

    server = served.call(start())
    try:
        url = f"http://127.0.0.1:{server.port}/inference/v1/generate"
        body = {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 2}}
        r = httpx.post(url, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
    finally:
        served.call(server.stop(1))
