"""Disaggregated prefill/decode through the router, in one process: a prefill
server, two decode servers and the router, each on its own event loop. (The same
with real processes: test_disagg_processes.py.)"""

import asyncio
import concurrent.futures
import threading

import grpc
import pytest
from conftest import ServerThread
from mock_runner import MockRunner, mock_model
from test_server import request, stub, wait_idle

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import engine_config
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server.app import JaxServeServer, ServerOptions
from server.router import RouterServer, RouterServicer

DECODE = {"kv_offload_bytes": 16 << 20}
LONG = "The quick brown fox jumps over the lazy dog, " * 3  # several full pages


class RouterThread:
    def __init__(self, prefill: list[str], decode: list[str], **options):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        peer_api_key = options.get("peer_api_key")
        servicer = RouterServicer(prefill, decode, 4 << 20, peer_api_key=peer_api_key)
        self.server = RouterServer(servicer, ServerOptions(grpc_port=0, **options))
        port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.target = f"127.0.0.1:{port}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(grace=1), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    prefill = ServerThread(tiny_model_dir)
    decodes = [ServerThread(tiny_model_dir, llm_kwargs=DECODE) for _ in range(2)]
    router = RouterThread([prefill.target], [d.target for d in decodes])
    yield prefill, decodes, router
    router.stop()
    for s in (prefill, *decodes):
        s.stop()


WORKLOAD = [
    request(LONG, max_tokens=10, ignore_eos=True),
    request(LONG + "again", max_tokens=6, n=3, seed=5, temperature=1.0, logprobs=2),
    request(LONG, max_tokens=16, stop=["e", "o"]),
    request("Hi", max_tokens=5, prompt_logprobs=1, ignore_eos=True),
    request(LONG, max_tokens=1, ignore_eos=True),
    request(LONG, max_tokens=8, min_tokens=3, ignore_eos=True),  # colocated
    salted := request(LONG, max_tokens=4, ignore_eos=True),
]
salted.cache_salt = "tenant-b"


def collect(target, req):
    """The stream, per sample: tokens, text, finish, stop, logprobs (rounded); usage."""
    samples, usage, prompt_lp = {}, None, None
    for msg in stub(target).Generate(req, timeout=120):
        if prompt_lp is None:
            prompt_lp = [
                [(e.token_id, round(e.logprob, 3)) for e in p.entries] for p in msg.prompt_logprobs
            ]
        if msg.HasField("usage"):
            usage = msg.usage
            continue
        s = samples.setdefault(msg.index, [[], "", "", "", []])
        s[0] += msg.token_ids
        s[1] += msg.text
        if msg.finish_reason:
            s[2], s[3] = msg.finish_reason, msg.stop_reason
        s[4] += [[(e.token_id, round(e.logprob, 3)) for e in lp.entries] for lp in msg.logprobs]
    return samples, (usage.prompt_tokens, usage.completion_tokens), prompt_lp


@pytest.mark.slow
def test_router_streams_equal_one_engine_and_pages_return(cluster):
    prefill, decodes, router = cluster
    # One engine: the prefill instance serving the request whole.
    want = [collect(prefill.target, r) for r in WORKLOAD]
    with concurrent.futures.ThreadPoolExecutor(len(WORKLOAD)) as pool:
        got = list(pool.map(lambda r: collect(router.target, r), WORKLOAD))
    assert got == want
    assert sum(d.engine.stats().kv_tier_loads for d in decodes) > 0
    for s in (prefill, *decodes):
        wait_idle(s.engine)
    unary = stub(router.target).Complete(WORKLOAD[1], timeout=120)
    assert [list(c.token_ids) for c in unary.completions] == [want[1][0][i][0] for i in range(3)]


@pytest.mark.slow
def test_a_dead_decode_instance_falls_back(cluster, tiny_model_dir):
    prefill, decodes, _ = cluster
    dead = "127.0.0.1:1"  # nothing listens there
    router = RouterThread([prefill.target], [dead, decodes[1].target])
    try:
        req = WORKLOAD[0]
        want = collect(prefill.target, req)
        for _ in range(2):  # the round robin tries the dead one first once
            assert collect(router.target, req) == want
        only_dead = RouterThread([prefill.target], [dead])
        try:  # every decode down: colocated on the prefill instance
            assert collect(only_dead.target, req) == want
        finally:
            only_dead.stop()
    finally:
        router.stop()
    for s in (prefill, *decodes):
        wait_idle(s.engine)


@pytest.mark.slow
def test_a_dead_prefill_instance_is_a_clean_error(cluster):
    _, decodes, _ = cluster
    router = RouterThread(["127.0.0.1:1"], [decodes[0].target])
    try:
        with pytest.raises(grpc.RpcError) as e:
            collect(router.target, WORKLOAD[0])
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "127.0.0.1:1" in e.value.details()
    finally:
        router.stop()
    wait_idle(decodes[0].engine)


@pytest.mark.slow
def test_cancelling_at_the_router_aborts_on_the_instances(cluster):
    prefill, decodes, router = cluster
    call = stub(router.target).Generate(request(LONG, max_tokens=40, ignore_eos=True))
    first = next(call)
    assert first.token_ids
    call.cancel()
    for s in (prefill, *decodes):
        wait_idle(s.engine)
    assert sum(d.engine.stats().requests_aborted for d in decodes) >= 1


def test_bad_requests_through_the_router(cluster):
    _, _, router = cluster
    with pytest.raises(grpc.RpcError) as e:
        stub(router.target).Generate(request(temperature=-1.0), timeout=30).next()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub(router.target).Complete(request(LONG, max_tokens=100000), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    resumed = request(LONG)
    resumed.resume.samples.add(index=0, token_ids=[1])
    with pytest.raises(grpc.RpcError) as e:
        stub(router.target).Complete(resumed, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(pb.PrefillRequest(), pb.PrefillRequest)


def _data_parallel_front():
    """Two mock-runner replicas behind a DataParallelEngine (no model, no devices)."""
    model = mock_model()
    config = engine_config(
        "mock", model, max_model_len=256, block_size=4, num_kv_pages=64, warmup=False
    )
    replicas = [AsyncLLMEngine(LLMEngine(config, runner=MockRunner(config, 64))) for _ in "ab"]
    return DataParallelEngine(replicas, config)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_prefill_and_decode_over_data_parallel_replicas_are_refused_at_start_up(role):
    front = _data_parallel_front()

    async def main():
        server = JaxServeServer(lambda: (front, None), ServerOptions(grpc_port=0, role=role))
        await server.start()
        try:
            with pytest.raises(ValueError, match=rf"role '{role}'.*\(DataParallelEngine\)"):
                await server.load()
            assert server.state.engine is None and not server.ready.is_set()
        finally:
            await server.stop(grace=0)

    asyncio.run(main())
    assert not front.healthy  # the refused front was shut down


def test_both_over_data_parallel_replicas_serves_and_refuses_only_kv_transfer():
    front = _data_parallel_front()

    async def main():
        server = JaxServeServer(lambda: (front, None), ServerOptions(grpc_port=0))
        await server.start()
        await server.load()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        api = pb_grpc.JaxServeStub(channel)
        try:
            msg = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=[1, 2, 3]),
                sampling_params=pb.SamplingParams(max_tokens=4, ignore_eos=True),
                priority=1,
                cache_salt="tenant",
            )
            reply = await api.Complete(msg)
            assert len(reply.completions[0].token_ids) == 4
            for call in (
                api.Prefill(pb.PrefillRequest(request=msg, decode_target="127.0.0.1:1")),
                api.PushKV(iter([pb.KVPages(pages=[b"x"])])),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "DataParallelEngine" in e.value.details()
        finally:
            await channel.close()
            await server.stop(grace=0)

    asyncio.run(main())


def test_peers_take_the_peer_key_and_clients_cannot_push_pages(tiny_model_dir):
    """With --peer_api_key, the router's Prefill and the prefill instance's PushKV carry
    it; a client holding only the user key reaches Generate, never Prefill or PushKV
    (forged pages in a decode instance's tier would serve every tenant sharing the
    prefix). A refused push is refused before any of its stream is read (the edge's
    handler never takes a message)."""
    keys = dict(api_key="u5er", peer_api_key="p33r")
    prefill = ServerThread(tiny_model_dir, **keys)
    decode = ServerThread(tiny_model_dir, llm_kwargs=DECODE, **keys)
    router = RouterThread([prefill.target], [decode.target], **keys)
    user = [("authorization", "Bearer u5er")]
    try:
        req = request(LONG, max_tokens=6, ignore_eos=True)
        got = stub(router.target).Complete(req, metadata=user, timeout=120)
        want = stub(prefill.target).Complete(req, metadata=user, timeout=120)
        assert got.completions[0].token_ids == want.completions[0].token_ids
        assert decode.engine.stats().kv_tier_loads > 0  # the pages went over, keyed
        wait_idle(decode.engine)
        stored = decode.engine.stats().kv_tier_stores

        def pages():
            yield pb.KVPages(pages=[b"forged"])

        for metadata in ((), user, [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as e:
                stub(decode.target).PushKV(pages(), metadata=metadata, timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub(prefill.target).Prefill(
                    pb.PrefillRequest(request=req, decode_target=decode.target),
                    metadata=metadata,
                    timeout=30,
                )
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert decode.engine.stats().kv_tier_stores == stored  # nothing of the client's kept
    finally:
        router.stop()
        for s in (prefill, decode):
            s.stop()


def test_pushed_pages_are_bounded_before_they_are_read_and_refusals_reveal_no_layout(cluster):
    """PushKV held a whole stream (64 MiB) before checking anything, even without a tier;
    a junk page's refusal named the layout's fingerprint, the key to forging one."""
    prefill, decodes, _ = cluster
    sent = []

    def pages(n, size):
        for _ in range(n):
            sent.append(size)
            yield pb.KVPages(pages=[b"\0" * size])

    # No tier (the prefill instance): refused before the stream is taken.
    with pytest.raises(grpc.RpcError) as e:
        stub(prefill.target).PushKV(pages(64, 1 << 20), timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no KV tier" in e.value.details()
    # A tier of 16 MiB: refused once the stream passes it, not after 64 MiB.
    with pytest.raises(grpc.RpcError) as e:
        stub(decodes[0].target).PushKV(pages(64, 1 << 20), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "16777216 bytes" in e.value.details()
    # A junk page carrying a made-up fingerprint: refused, the real one not named.
    layout = decodes[0].engine.kv_layout
    with pytest.raises(grpc.RpcError) as e:
        stub(decodes[0].target).PushKV(iter([pb.KVPages(pages=[_junk_page("0" * 16)])]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprints differ" in e.value.details()
    assert layout.fingerprint not in e.value.details()


@pytest.mark.parametrize("target", ["", "decode", "host:0", "host:99999", "dns:///x:1"])
def test_a_decode_target_that_is_no_address_is_refused_before_the_prefill(cluster, target):
    """An empty or malformed decode_target (the chaos storm sent one) ran the prefill,
    then the push waited its whole timeout (60 s) on an address gRPC cannot dial."""
    prefill, _, _ = cluster
    req = pb.PrefillRequest(request=request(LONG, max_tokens=4), decode_target=target)
    with pytest.raises(grpc.RpcError) as e:
        stub(prefill.target).Prefill(req, timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "decode_target must be HOST:PORT" in e.value.details()


def _junk_page(fingerprint: str) -> bytes:
    """Bytes that pass a page's framing and checksum, with this header."""
    import hashlib
    import json
    import struct

    from jaxserve.kv import transfer

    header = json.dumps(
        {"fingerprint": fingerprint, "digest": "00", "parent": "", "tokens": [1]}
    ).encode()
    body = transfer.MAGIC + struct.pack("<I", len(header)) + header
    return body + hashlib.blake2b(body, digest_size=transfer._CHECKSUM_BYTES).digest()
