"""The gRPC server end to end, with real clients on loopback."""

import asyncio
import filecmp
import os
import random
import subprocess
import time
import urllib.request

import grpc
import pytest
from conftest import ServerThread
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxserve import LLM, SamplingParams
from server import gen_protos
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def stub(target):
    return pb_grpc.JaxServeStub(grpc.insecure_channel(target))


def request(prompt="The quick brown fox", **params):
    params = {"max_tokens": 8, "temperature": 0.0, **params}
    return pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(**params))


def wait_idle(engine, timeout=10):
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.requests:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.02)
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity


def test_stubs_are_current(tmp_path):
    for path in gen_protos.generate(str(tmp_path)):
        committed = os.path.join(ROOT, "server", os.path.basename(path))
        assert filecmp.cmp(path, committed, shallow=False), (
            f"{committed} is stale: run python -m server.gen_protos"
        )


def test_health_goes_from_not_serving_to_serving(tiny_model_dir):
    server = ServerThread(tiny_model_dir, load=False)
    try:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
        check = health_pb2.HealthCheckRequest(service="jaxserve.v1.JaxServe")
        assert health.Check(check).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub(server.target).Complete(request())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        server.load()
        assert health.Check(check).status == health_pb2.HealthCheckResponse.SERVING
        assert stub(server.target).Complete(request()).completions[0].token_ids
    finally:
        server.stop()


def test_stream_equals_unary_equals_offline(served, tiny_model_dir):
    params = dict(
        max_tokens=12, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, n=2, logprobs=2
    )
    s = stub(served.target)
    streamed = {0: ([], ""), 1: ([], "")}
    finish, usage = {}, None
    for msg in s.Generate(request(**params)):
        if msg.HasField("usage"):
            usage = msg.usage
            continue
        ids, text = streamed[msg.index]
        streamed[msg.index] = (ids + list(msg.token_ids), text + msg.text)
        assert len(msg.logprobs) == len(msg.token_ids)
        if msg.finish_reason:
            finish[msg.index] = msg.finish_reason
    unary = s.Complete(request(**params))
    offline = LLM(tiny_model_dir, max_model_len=128, warmup=False).generate(
        ["The quick brown fox"], SamplingParams(**{**params, "max_tokens": 12}), use_tqdm=False
    )[0]
    for c, o in zip(unary.completions, offline.outputs, strict=True):
        assert streamed[c.index] == (list(c.token_ids), c.text) == (o.token_ids, o.text)
        assert finish[c.index] == c.finish_reason == "length"
        assert c.logprobs[0].entries[0].token_id == c.token_ids[0]
        # Each entry's rank, as the offline API's Logprob has it (the top k: 1..k).
        for lp, want, token in zip(c.logprobs, o.logprobs, o.token_ids, strict=True):
            assert {e.token_id: e.rank for e in lp.entries} == {t: v.rank for t, v in want.items()}
            assert lp.entries[0].rank == want[token].rank >= 1
        assert c.cumulative_logprob == pytest.approx(o.cumulative_logprob, abs=1e-4)
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        unary.usage.prompt_tokens,
        unary.usage.completion_tokens,
    )
    assert unary.usage.cached_prompt_tokens == 8  # the same prompt again: one full page cached
    assert usage.completion_tokens == 24 and usage.prompt_tokens == len(offline.prompt_token_ids)


def test_each_sample_of_a_stream_finishes_once(served):
    """n > 1: the second sample runs after the first has computed the prompt, so they
    finish in different steps; the first one's finish was sent again with every later
    output (found by the randomized server test)."""
    msgs = list(stub(served.target).Generate(request(max_tokens=1, n=3, ignore_eos=True)))
    finishes = [m.index for m in msgs if m.finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert sum(len(m.token_ids) for m in msgs) == 3


def test_chat_messages_use_the_template(served):
    s = stub(served.target)
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Ça va? 東京")])
    want = served.server.state.tokenizer.encode_chat([{"role": "user", "content": "Ça va? 東京"}])
    assert list(s.Tokenize(pb.TokenizeRequest(messages=messages)).token_ids) == want
    out = s.Complete(
        pb.GenerateRequest(messages=messages, sampling_params=pb.SamplingParams(max_tokens=3))
    )
    assert out.usage.prompt_tokens == len(want)
    text = s.Detokenize(pb.DetokenizeRequest(token_ids=want, skip_special_tokens=False)).text
    assert text.startswith("<s><|user|>Ça va? 東京<|end|>")


def test_model_info(served):
    info = stub(served.target).GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model, info.max_model_len, info.vocab_size, info.block_size) == (
        "tiny",
        128,
        320,
        8,
    )
    assert info.kv_cache_tokens == 255 * 8
    assert (info.kv_cache_dtype, info.quantization) == ("float32", "")


def test_cancelled_stream_is_aborted_and_frees_its_pages(served):
    engine = served.engine
    aborted = engine.stats().requests_aborted
    call = stub(served.target).Generate(request(max_tokens=100, ignore_eos=True))
    first = next(call)
    assert first.token_ids
    call.cancel()
    wait_idle(engine)
    assert engine.stats().requests_aborted == aborted + 1
    assert len(engine.scheduler.running) == 0
    # Aborting again, or after the request is gone, is harmless.
    served.server.state.engine.abort(first.request_id)
    assert stub(served.target).Complete(request()).completions[0].finish_reason == "length"


async def _stream_tokens(target, req):
    async with grpc.aio.insecure_channel(target) as channel:
        ids, ends = [], 0
        async for msg in pb_grpc.JaxServeStub(channel).Generate(req):
            ids += msg.token_ids
            ends += bool(msg.finish_reason)
        return ids, ends


@pytest.mark.slow
def test_200_concurrent_streams_then_overload_and_recovery(served):
    rs = random.Random(0)
    vocab = 320
    jobs = [
        pb.GenerateRequest(
            request_id=f"load-{i}",
            prompt_token_ids=pb.TokenIds(
                ids=[rs.randrange(3, vocab) for _ in range(rs.randint(1, 60))]
            ),
            sampling_params=pb.SamplingParams(
                max_tokens=rs.randint(1, 16),
                ignore_eos=True,
                temperature=rs.choice([0.0, 0.7]),
                seed=i,
            ),
        )
        for i in range(220)
    ]

    async def run_all():
        return await asyncio.gather(*(_stream_tokens(served.target, j) for j in jobs))

    results = asyncio.run(run_all())
    for job, (ids, ends) in zip(jobs, results, strict=True):
        assert len(ids) == job.sampling_params.max_tokens and ends == 1
    wait_idle(served.engine)

    # Overload: a bound of 4 pending requests refuses the rest, then recovers.
    served.server.state.max_pending = 4
    try:

        async def burst():
            return await asyncio.gather(
                *(
                    _stream_tokens(served.target, request(max_tokens=30, ignore_eos=True))
                    for _ in range(20)
                ),
                return_exceptions=True,
            )

        outcomes = asyncio.run(burst())
        refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        assert refused and all(o.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for o in refused)
        assert len(refused) < 20
    finally:
        served.server.state.max_pending = 1024
    wait_idle(served.engine)
    assert stub(served.target).Complete(request()).usage.completion_tokens == 8


BAD = [
    (pb.GenerateRequest(sampling_params=pb.SamplingParams()), "one of prompt"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds()), "must not be empty"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 320])), "outside the vocabulary"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * 128)), "max_model_len"),
    (request(max_tokens=0), "max_tokens must be an integer >= 1"),
    (request(max_tokens=500), "exceeds max_model_len"),
    (request(temperature=float("nan")), "temperature must be a finite number"),
    (request(temperature=-1.0), "temperature must be >= 0"),
    (request(top_p=0.0), "top_p must be in"),
    (request(min_p=1.5), "min_p must be in"),
    (request(logprobs=21), "logprobs must be an integer in"),
    (request(n=0), r"n must be an integer in \[1, 128\]"),
    (request(n=129), r"n must be an integer in \[1, 128\]"),
    (request(stop_token_ids=[320]), "stop_token_ids names token 320"),
    (request(temperature=1e300), "temperature must be"),
    (request(top_k=-5), "top_k"),
    (request(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (request(presence_penalty=3.0), "presence_penalty must be in"),
    (request(min_tokens=20, max_tokens=5), "min_tokens"),
    (request(stop=[""]), "stop must be non-empty strings"),
    (request(logit_bias={999: 1.0}), "logit_bias names token 999"),
    (request(logit_bias={5: 500.0}), r"logit_bias\[5\] must be in"),
    (pb.GenerateRequest(messages=pb.ChatMessages()), "messages must not be empty"),
    (request(structured_outputs=pb.StructuredOutputs()), "structured_outputs must set one of"),
    (request(structured_outputs=pb.StructuredOutputs(regex="a(b")), r"structured_outputs\.regex"),
    (
        request(structured_outputs=pb.StructuredOutputs(json='{"type": "nope"}')),
        r"structured_outputs\.json",
    ),
    (
        request(structured_outputs=pb.StructuredOutputs(choice=pb.Choices())),
        r"structured_outputs\.choice",
    ),
]


def test_a_prompt_being_tokenized_holds_up_no_other_call(served, monkeypatch):
    """As over HTTP (test_http.py): tokenizing ran on the server's event loop."""
    import threading

    from server import servicer

    parse, entered, released = servicer.parse_prompt, threading.Event(), threading.Event()

    def parse_slowly(prompt, *a, **kw):
        if prompt.get("prompt") == "hold me":
            entered.set()
            assert released.wait(30), "the other call was held up"
        return parse(prompt, *a, **kw)

    monkeypatch.setattr(servicer, "parse_prompt", parse_slowly)
    held = []
    slow = threading.Thread(
        target=lambda: held.append(stub(served.target).Complete(request("hold me", max_tokens=2)))
    )
    slow.start()
    assert entered.wait(30)  # the slow prompt is being tokenized, and stays so until released
    fast = stub(served.target).Complete(request(max_tokens=2), timeout=30)
    released.set()
    slow.join(30)
    assert fast.usage.completion_tokens == 2 and held[0].usage.completion_tokens == 2


def test_the_proto_carries_every_sampling_field_with_its_default():
    """The gRPC front takes SamplingParams' fields by name (issue 29: one schema): a
    field added there without one here fails this test."""
    from jaxserve.sampling_params import FIELDS, SamplingParams
    from server.servicer import sampling_params_from_proto

    assert set(FIELDS) <= set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()


def test_every_front_end_takes_the_client_fields_from_their_one_declaration():
    """A per-request field a client sets (priority, cache_salt) is declared once, on
    GenerateRequest, and named in CLIENT_FIELDS: every HTTP body takes it with that
    type and default, gRPC's message has it, and both pass it on by `client_fields`
    (a field appeared in about 12 files)."""
    from jaxserve.generate_request import CLIENT_FIELDS, client_field_types, client_fields
    from server.openai_api.protocol import ChatCompletionRequest, CompletionRequest
    from server.openai_api.responses_protocol import ResponsesRequest
    from server.openai_api.tokens import GenerateTokensRequest

    bodies = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, GenerateTokensRequest)
    for name, (kind, default) in client_field_types().items():
        for body in bodies:
            field = body.model_fields[name]
            assert (field.annotation, field.default) == (kind, default), (body, name)
        assert name in pb.GenerateRequest.DESCRIPTOR.fields_by_name
    sent = pb.GenerateRequest(prompt="x", priority=-2, cache_salt="")
    assert client_fields(sent) == {"priority": -2, "cache_salt": None}  # "": unset
    body = CompletionRequest(prompt="x", priority=3, cache_salt="t")
    assert client_fields(body) == {"priority": 3, "cache_salt": "t"}
    assert set(CLIENT_FIELDS) == {"priority", "cache_salt"}


@pytest.mark.parametrize(
    "req,field",
    [
        (request(temperature=-1.0), "temperature"),
        (request(max_tokens=500), "max_tokens"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 320])), "prompt_token_ids"),
        (request(structured_outputs=pb.StructuredOutputs(regex="a(b")), "structured_outputs"),
        (request(stop_token_ids=[320]), "stop_token_ids"),
        # A role OpenAI's chat has not: the HTTP API's refusal (it was rendered).
        (
            pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard")])),
            "messages[0].role",
        ),
    ],
)
def test_an_invalid_argument_names_its_field_as_metadata(served, req, field):
    from server.servicer import FIELD_METADATA

    with pytest.raises(grpc.RpcError) as e:
        stub(served.target).Complete(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(e.value.trailing_metadata())[FIELD_METADATA] == field


@pytest.mark.parametrize("req,match", BAD)
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(served, req, match):
    s = stub(served.target)
    with pytest.raises(grpc.RpcError) as e:
        list(s.Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert pytest.importorskip("re").search(match, e.value.details()), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        s.Complete(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert s.Complete(request(max_tokens=2)).usage.completion_tokens == 2


def test_structured_output_over_grpc(served):
    import json

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    so = pb.StructuredOutputs(json=json.dumps(schema))
    s = stub(served.target)
    done = s.Complete(request(max_tokens=40, temperature=1.0, n=2, seed=3, structured_outputs=so))
    streamed = "".join(
        m.text
        for m in s.Generate(request(max_tokens=40, structured_outputs=so))
        if m.index == 0 and not m.HasField("usage")
    )
    for text, reason in [(c.text, c.finish_reason) for c in done.completions] + [
        (streamed, "stop")
    ]:
        assert reason == "stop"
        value = json.loads(text)
        assert set(value) == {"n"} and 0 <= value["n"] <= 99
    choice = pb.StructuredOutputs(choice=pb.Choices(choices=["red", "green"]))
    out = s.Complete(request(max_tokens=10, temperature=1.0, structured_outputs=choice))
    assert out.completions[0].text in ("red", "green")
    wait_idle(served.engine)


def test_malformed_and_oversized_messages_are_refused(served):
    channel = grpc.insecure_channel(served.target)
    raw = channel.unary_unary("/jaxserve.v1.JaxServe/Complete")
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\xff\xff\xff\xff garbage")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed /jaxserve.v1.JaxServe/Complete request" in e.value.details()
    huge = pb.GenerateRequest(prompt="x" * (5 << 20))
    with pytest.raises(grpc.RpcError) as e:
        stub(served.target).Complete(huge)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub(served.target).Complete(request(max_tokens=2)).usage.completion_tokens == 2


def test_reflection_lists_the_services(served):
    s = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(served.target))
    responses = s.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {x.name for r in responses for x in r.list_services_response.service}
    assert {"jaxserve.v1.JaxServe", "grpc.health.v1.Health"} <= names


def _scrape(port) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    values = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics_agree_with_what_was_sent(served):
    wait_idle(served.engine)
    before = _scrape(served.server.metrics_port)
    s = stub(served.target)
    sent = [(5, 3), (9, 6), (17, 4)]
    for n, m in sent:
        s.Complete(
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=list(range(50, 50 + n))),
                sampling_params=pb.SamplingParams(max_tokens=m, ignore_eos=True),
            )
        )
    after = _scrape(served.server.metrics_port)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    label = '{model_name="tiny"}'
    assert delta(f"jaxserve:generation_tokens_total{label}") == sum(m for _, m in sent)
    assert delta(f"jaxserve:prompt_tokens_total{label}") + delta(
        f"jaxserve:prefix_cache_hits_total{label}"
    ) == sum(n for n, _ in sent)
    assert delta('jaxserve:request_success_total{finished_reason="length"}') == 3
    assert delta("jaxserve:e2e_request_latency_seconds_count") == 3
    assert delta("jaxserve:time_to_first_token_seconds_count") == 3
    assert delta("jaxserve:inter_token_latency_seconds_count") == sum(m - 1 for _, m in sent)
    assert after[f"jaxserve:num_requests_running{label}"] == 0


def test_api_key_is_required_but_health_stays_open(tiny_model_dir):
    server = ServerThread(tiny_model_dir, api_key="s3cret", metrics_port=None)
    try:
        channel = grpc.insecure_channel(server.target)
        s = pb_grpc.JaxServeStub(channel)
        for call in (
            lambda md: s.Complete(request(), metadata=md),
            lambda md: list(s.Generate(request(), metadata=md)),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call([("authorization", "Bearer wrong")])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert s.Complete(request(), metadata=[("x-api-key", "s3cret")]).completions
        assert list(s.Generate(request(), metadata=[("authorization", "Bearer s3cret")]))
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
    finally:
        server.stop()


def test_tls(tiny_model_dir, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    server = ServerThread(tiny_model_dir, tls_cert=str(cert), tls_key=str(key), metrics_port=None)
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        secure = pb_grpc.JaxServeStub(grpc.secure_channel(server.target, creds))
        assert secure.Complete(request(max_tokens=2)).usage.completion_tokens == 2
        with pytest.raises(grpc.RpcError):  # plaintext is refused
            stub(server.target).Complete(request(max_tokens=2), timeout=5)
    finally:
        server.stop()


def test_speculative_decoding_metrics_have_vllms_names():
    from prometheus_client import generate_latest

    from jaxserve.engine_stats import StatsSnapshot
    from server.prometheus import ServerMetrics

    snapshot = StatsSnapshot(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        prompt_tokens=0,
        generation_tokens=0,
        requests_finished=0,
        requests_aborted=0,
        num_compiles=0,
        spec_decode_num_drafts=5,
        spec_decode_num_draft_tokens=20,
        spec_decode_num_accepted_tokens=9,
        spec_decode_num_accepted_tokens_per_pos=(5, 3, 1, 0),
    )
    text = generate_latest(ServerMetrics("m", lambda: snapshot).registry).decode()
    assert 'jaxserve:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'jaxserve:spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert (
        'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3.0'
        in text
    )
    assert snapshot.spec_decode_mean_acceptance_length == 1.0 + 9 / 5


def stats_of(**fields):
    """An engine's StatsSnapshot: `fields`, every other figure 0."""
    import dataclasses

    from jaxserve.engine_stats import StatsSnapshot

    required = [
        f.name for f in dataclasses.fields(StatsSnapshot) if f.default is dataclasses.MISSING
    ]
    return StatsSnapshot(**{**dict.fromkeys(required, 0), **fields})


def test_kv_tier_metrics_show_its_bytes_and_evictions():
    from prometheus_client import generate_latest

    from server.prometheus import ServerMetrics

    snapshot = stats_of(
        kv_tier_host_bytes=4096,
        kv_tier_disk_bytes=1 << 30,
        kv_tier_host_evictions=7,
        kv_tier_disk_evictions=3,
    )
    text = generate_latest(ServerMetrics("m", lambda: snapshot).registry).decode()
    assert "# TYPE jaxserve:kv_tier_disk_bytes gauge" in text
    assert 'jaxserve:kv_tier_disk_bytes{model_name="m"} 1.073741824e+09' in text
    assert 'jaxserve:kv_tier_host_bytes{model_name="m"} 4096.0' in text
    assert "# TYPE jaxserve:kv_tier_disk_evictions_total counter" in text
    assert 'jaxserve:kv_tier_disk_evictions_total{model_name="m"} 3.0' in text
    assert 'jaxserve:kv_tier_host_evictions_total{model_name="m"} 7.0' in text


def test_lora_metrics_show_slots_and_requests_per_adapter():
    """LoRA figures (only with LoRA enabled), and replicas' summed by adapter name."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from jaxserve.distributed.data_parallel import DataParallelEngine
    from server.prometheus import ServerMetrics

    plain = generate_latest(ServerMetrics("m", lambda: stats_of()).registry).decode()
    assert "lora" not in plain
    lora = dict(lora_slots=4, lora_slots_in_use=3, lora_loads=9, lora_evictions=5)
    replicas = [
        stats_of(**lora, lora_requests_running=(("a", 2), ("b", 1))),
        stats_of(**lora, lora_requests_running=(("b", 3),), lora_requests_waiting=(("c", 1),)),
    ]
    snapshot = DataParallelEngine.stats(SimpleNamespace(replica_stats=lambda: replicas))
    assert snapshot.lora_requests_running == (("a", 2), ("b", 4))
    assert snapshot.lora_requests_waiting == (("c", 1),) and snapshot.lora_slots == 8
    text = generate_latest(ServerMetrics("m", lambda: snapshot).registry).decode()
    assert 'jaxserve:lora_slots{model_name="m"} 8.0' in text
    assert 'jaxserve:lora_slots_in_use{model_name="m"} 6.0' in text
    assert 'jaxserve:lora_loads_total{model_name="m"} 18.0' in text
    assert 'jaxserve:lora_evictions_total{model_name="m"} 10.0' in text
    assert 'jaxserve:lora_requests_running{lora_name="b",model_name="m"} 4.0' in text
    assert 'jaxserve:lora_requests_waiting{lora_name="c",model_name="m"} 1.0' in text
    assert (
        'lora_requests_info{max_lora="8",running_lora_adapters="a,b",waiting_lora_adapters="c"}'
        in text
    )


def test_async_scheduling_over_grpc_and_http(tiny_model_dir):
    """A server whose engine schedules asynchronously streams what the synchronous
    offline engine generates, over gRPC and HTTP, and a cancelled stream frees its
    pages though its next step was already dispatched."""
    import httpx

    server = ServerThread(tiny_model_dir, http_port=0, llm_kwargs=dict(async_scheduling=True))
    try:
        engine = server.engine
        assert engine.config.scheduler.async_scheduling
        params = dict(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True, n=2, logprobs=1)
        offline = LLM(tiny_model_dir, max_model_len=128, warmup=False).generate(
            ["The quick brown fox"], SamplingParams(**params), use_tqdm=False
        )[0]
        streamed = {0: [], 1: []}
        for msg in stub(server.target).Generate(request(**params)):
            if not msg.HasField("usage"):
                streamed[msg.index] += msg.token_ids
        assert [streamed[0], streamed[1]] == [o.token_ids for o in offline.outputs]
        body = dict(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=12,
            temperature=0.8,
            seed=5,
            ignore_eos=True,
            return_token_ids=True,
        )
        with httpx.Client(base_url=server.http_url) as http:
            choice = http.post("/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["token_ids"] == offline.outputs[0].token_ids
        call = stub(server.target).Generate(request(max_tokens=100, ignore_eos=True))
        assert next(call).token_ids
        call.cancel()
        wait_idle(engine)
        assert engine.pipeline.inflight is None
    finally:
        server.stop()


def test_metrics_show_the_mesh_and_each_replica():
    from prometheus_client import generate_latest

    from jaxserve.outputs import ModelInfo
    from server.prometheus import ServerMetrics

    replicas = [
        stats_of(num_running=3, kv_cache_usage=0.5),
        stats_of(num_waiting=2),
    ]
    info = ModelInfo(
        *["m", "Llama", 128, 64, 8, "float32", "float32", None, 16, 100, 0, 0.0, 300],
        tensor_parallel_size=4,
        data_parallel_size=2,
        num_devices=8,
        num_processes=1,
        kv_cache_bytes_per_device=4096,
    )
    metrics = ServerMetrics(
        "m", lambda: replicas[0], info_fn=lambda: info, replicas_fn=lambda: replicas
    )
    text = generate_latest(metrics.registry).decode()
    assert 'jaxserve:mesh_devices{dp="2",model_name="m",processes="1",tp="4"} 8.0' in text
    assert 'jaxserve:kv_cache_bytes_per_device{model_name="m"} 4096.0' in text
    assert 'jaxserve:replica_num_requests_running{model_name="m",replica="0"} 3.0' in text
    assert 'jaxserve:replica_num_requests_waiting{model_name="m",replica="1"} 2.0' in text
