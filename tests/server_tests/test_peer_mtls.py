"""Mutual TLS for the peer scope (`server.peer_tls`): a client certificate signed by the
deployment CA, shown on the peer port, grants Prefill and PushKV; users connect without
one; with no peer key, nothing else opens the peer operations, and a refused call is
refused before its handler takes any of its stream. Certificates are made with the
openssl CLI (the `cryptography` package is not a dependency)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading

import grpc
import pytest
from conftest import ServerThread
from test_disagg import DECODE, LONG
from test_server import request, wait_idle

from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server import peer_tls
from server.app import (
    SERVICE_NAME,
    JaxServeServer,
    ServerOptions,
    add_grpc_port,
    add_peer_grpc_port,
)
from server.edge import PEER_REFUSED, GrpcEdge
from server.router import RouterServer, RouterServicer


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _signed(d, name: str, ca: str, *extra: str) -> None:
    """d/name.pem (and .key), its CN `name`, signed by d/ca.pem."""
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
        "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(d / f"{name}.csr"), "-days", "1",
        "-CA", str(d / f"{ca}.pem"), "-CAkey", str(d / f"{ca}.key"),
        "-set_serial", str(int.from_bytes(name.encode(), "big")),
        "-out", str(d / f"{name}.pem"), *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The deployment CA ("ca"), another CA ("other"); a server certificate for
    localhost and 127.0.0.1, a peer's client certificate ("peer"), and one of the other
    CA ("stranger")."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={ca}",
            "-keyout", str(d / f"{ca}.key"), "-out", str(d / f"{ca}.pem"),
        )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _signed(d, "server", "ca", "-extfile", str(d / "san.ext"))
    _signed(d, "peer", "ca")
    _signed(d, "stranger", "other")
    return d


def _mtls(pki, **options) -> dict:
    """The options of an instance that serves its peers with mutual TLS."""
    return {
        "tls_cert": str(pki / "server.pem"),
        "tls_key": str(pki / "server.key"),
        "peer_grpc_port": 0,
        "peer_tls_ca": str(pki / "ca.pem"),
        **options,
    }


def _credentials(pki, client: str | None) -> grpc.ChannelCredentials:
    """TLS that trusts the deployment CA, showing `client`'s certificate (None: none)."""
    if client is None:
        return grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    return peer_tls.read(
        str(pki / "ca.pem"), str(pki / f"{client}.pem"), str(pki / f"{client}.key")
    ).channel_credentials()


class Recording(pb_grpc.JaxServeServicer):
    """Counts the peer handlers entered and the pushed messages they took."""

    def __init__(self):
        self.entered, self.taken = 0, 0

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model="recording")

    async def Prefill(self, request, context):
        self.entered += 1
        return pb.PrefillResponse(pages_pushed=7)

    async def PushKV(self, request_iterator, context):
        self.entered += 1
        kept = 0
        async for message in request_iterator:
            kept += len(message.pages)
        self.taken += kept
        return pb.PushKVResponse(pages=kept)


@contextlib.contextmanager
def _served(options: ServerOptions, servicer):
    """`servicer` behind the edge on both ports, as `JaxServeServer` binds them, on an
    event loop of its own; yields the user port's and the peer port's targets. (The
    clients are grpc's blocking ones: its asyncio client, writing a stream the server
    has refused, now and then reports INTERNAL instead of the refusal, as it does for a
    wrong key's.)"""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server(interceptors=[GrpcEdge(SERVICE_NAME, options.keys())])
        pb_grpc.add_JaxServeServicer_to_server(servicer, server)
        port = add_grpc_port(server, options)
        peer_port = add_peer_grpc_port(server, options, options.peer_tls())
        await server.start()
        return server, port, peer_port

    server, port, peer_port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"127.0.0.1:{port}", f"127.0.0.1:{peer_port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _pages():
    for _ in range(3):
        yield pb.KVPages(pages=[b"forged"])


def _push(target: str, credentials, metadata=()) -> grpc.StatusCode | int:
    """PushKV's pages kept, or the status code of its refusal."""
    with grpc.secure_channel(target, credentials) as channel:
        try:
            reply = pb_grpc.JaxServeStub(channel).PushKV(_pages(), metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                assert e.details() == PEER_REFUSED  # (nothing of the cache's layout)
            return e.code()
        return reply.pages


def test_a_peer_certificate_grants_the_peer_scope_and_nothing_else_does(pki):
    """No peer key: a certificate of the CA on the peer port is served; on the user
    port no certificate is asked for, so a push there is refused UNAUTHENTICATED (even
    with the user key, which opened peer operations when no peer credential was set)
    and the handler never entered; the peer port refuses a handshake without one of the
    CA's certificates (UNAVAILABLE), so nothing reaches a handler. Users connect
    without a certificate."""
    options = ServerOptions(**_mtls(pki, api_key="u5er"))
    assert options.keys().peer is None and options.keys().peer_certificates
    user = [("authorization", "Bearer u5er")]
    recording = Recording()
    with _served(options, recording) as (target, peer_target):
        assert _push(peer_target, _credentials(pki, "peer"), user) == 3
        assert (recording.entered, recording.taken) == (1, 3)
        with grpc.secure_channel(peer_target, _credentials(pki, "peer")) as channel:
            reply = pb_grpc.JaxServeStub(channel).Prefill(pb.PrefillRequest(), timeout=10)
            assert reply.pages_pushed == 7
        assert recording.entered == 2

        refused = grpc.StatusCode.UNAUTHENTICATED
        for client in (None, "peer", "stranger"):  # (the user port asks for none)
            for metadata in ((), user, [("authorization", "Bearer wrong")]):
                assert _push(target, _credentials(pki, client), metadata) == refused
        with grpc.secure_channel(target, _credentials(pki, None)) as channel:
            api = pb_grpc.JaxServeStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                api.Prefill(pb.PrefillRequest(), metadata=user, timeout=10)
            assert (e.value.code(), e.value.details()) == (refused, PEER_REFUSED)
            info = api.GetModelInfo(pb.GetModelInfoRequest(), metadata=user, timeout=10)
            assert info.model == "recording"
        for client in (None, "stranger"):
            code = _push(peer_target, _credentials(pki, client), user)
            assert code == grpc.StatusCode.UNAVAILABLE
        assert (recording.entered, recording.taken) == (2, 3)


def test_with_a_peer_key_too_either_credential_will_do(pki):
    options = ServerOptions(**_mtls(pki, api_key="u5er", peer_api_key="p33r"))
    recording = Recording()
    with _served(options, recording) as (target, peer_target):
        key = [("authorization", "Bearer p33r")]
        assert _push(target, _credentials(pki, None), key) == 3
        assert _push(peer_target, _credentials(pki, "peer")) == 3
        code = _push(target, _credentials(pki, None), [("x-api-key", "u5er")])
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert (recording.entered, recording.taken) == (2, 6)


class RouterThread:
    """A router that reaches the instances over TLS with a peer's certificate."""

    def __init__(self, prefill: str, decode: str, credentials):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        servicer = RouterServicer([prefill], [decode], 4 << 20, peer_credentials=credentials)
        self.server = RouterServer(servicer, ServerOptions(grpc_port=0))
        port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.target = f"127.0.0.1:{port}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(grace=1), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_disaggregated_round_trip_over_mutual_tls_without_a_peer_key(pki, tiny_model_dir):
    """router -> Prefill -> PushKV -> Generate, every hop to an instance's peer port over
    TLS with a peer's certificate, no key anywhere: the router's answer is the prefill
    instance's own, and the decode instance used the pushed pages."""
    peer = dict(peer_tls_cert=str(pki / "peer.pem"), peer_tls_key=str(pki / "peer.key"))
    prefill = ServerThread(tiny_model_dir, metrics_port=None, **_mtls(pki, **peer))
    decode = ServerThread(tiny_model_dir, llm_kwargs=DECODE, metrics_port=None, **_mtls(pki))
    peer_port = {s: f"127.0.0.1:{s.server.peer_grpc_port}" for s in (prefill, decode)}
    router = RouterThread(peer_port[prefill], peer_port[decode], _credentials(pki, "peer"))
    try:
        req = request(LONG, max_tokens=6, ignore_eos=True)
        with grpc.insecure_channel(router.target) as channel:
            got = pb_grpc.JaxServeStub(channel).Complete(req, timeout=120)
        user = grpc.secure_channel(prefill.target, _credentials(pki, None))
        with user:  # a user, on the user port, without a certificate
            want = pb_grpc.JaxServeStub(user).Complete(req, timeout=120)
        assert got.completions[0].token_ids == want.completions[0].token_ids
        assert decode.engine.stats().kv_tier_loads > 0  # the pages went over
        wait_idle(decode.engine)
        stored = decode.engine.stats().kv_tier_stores
        code = _push(decode.target, _credentials(pki, "peer"))
        assert code == grpc.StatusCode.UNAUTHENTICATED  # (the user port: no certificate)
        assert decode.engine.stats().kv_tier_stores == stored
    finally:
        router.stop()
        for s in (prefill, decode):
            s.stop()


@pytest.mark.parametrize(
    "options,error",
    [
        (dict(peer_tls_cert="c.pem"), "--peer_tls_cert and --peer_tls_key"),
        (dict(peer_tls_cert="c.pem", peer_tls_key="k.pem"), "--peer_tls_cert needs --peer_tls_ca"),
        (dict(peer_grpc_port=0), "--peer_grpc_port requires client certificates signed by"),
        (dict(peer_grpc_port=0, peer_tls_ca="ca.pem"), "needs --tls_cert and --tls_key"),
        (
            dict(peer_grpc_port=50051, peer_tls_ca="ca.pem", tls_cert="c", tls_key="k"),
            "--peer_grpc_port 50051 is also the gRPC or the HTTP port",
        ),
        (
            dict(grpc_port=None, http_port=0, peer_grpc_port=0, peer_tls_ca="ca.pem")
            | dict(tls_cert="c", tls_key="k"),
            "--peer_grpc_port is a second port of the gRPC server",
        ),
    ],
)
def test_peer_tls_options_that_cannot_work_are_refused_naming_the_flags(options, error):
    with pytest.raises(ValueError, match=error):
        ServerOptions(**options)


def test_peer_tls_files_are_read_at_start_up_naming_the_flag(pki, tmp_path):
    def server(**options):
        return JaxServeServer(lambda: None, ServerOptions(grpc_port=0, **options))

    with pytest.raises(ValueError, match="--peer_tls_ca: an instance .* give --peer_grpc_port"):
        server(peer_tls_ca=str(pki / "ca.pem"))
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match=f"--peer_tls_ca {missing}: cannot be read"):
        server(**_mtls(pki, peer_tls_ca=missing))
    with pytest.raises(ValueError, match="--peer_tls_ca .*ca.key: not a PEM certificate"):
        server(**_mtls(pki, peer_tls_ca=str(pki / "ca.key")))
    cert, key = str(pki / "peer.pem"), str(pki / "stranger.key")
    with pytest.raises(ValueError, match=f"--peer_tls_key {missing}: cannot be read"):
        server(**_mtls(pki, peer_tls_cert=cert, peer_tls_key=missing))
    with pytest.raises(ValueError, match="not a PEM certificate and its private key"):
        server(**_mtls(pki, peer_tls_cert=cert, peer_tls_key=key))
    assert server(**_mtls(pki, peer_tls_cert=cert, peer_tls_key=str(pki / "peer.key")))


@pytest.mark.parametrize(
    "args,error",
    [
        (["--peer_tls_ca=ca.pem"], "--peer_tls_ca: an instance takes its peers'"),
        (
            [
                "--role=router",
                "--prefill_targets=h:1",
                "--decode_targets=h:2",
                "--peer_grpc_port=0",
            ],
            "--peer_grpc_port is for the instances",
        ),
    ],
)
def test_the_command_refuses_them_in_one_line(args, error):
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "serve", *args, "--compilation_cache_dir="],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = proc.stderr.splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(f"jaxserve serve: {error}"), proc.stderr
