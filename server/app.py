"""The server: the OpenAI-compatible HTTP API (`server.openai_api`, on `http_port`)
and gRPC (servicer, health, reflection, auth, TLS, on `grpc_port`, and for other
instances on `peer_grpc_port`: `server.peer_tls`), either or both, in one process, on one
event loop, over one engine; metrics and draining for both.

The ports open first, reporting NOT_SERVING (HTTP /health: 503) while the model
loads and warms up (and the `lora_modules` adapters are read), then SERVING; they go
back to NOT_SERVING if the engine dies and while draining. A port that cannot be
opened (taken, say) is a `ListenError` naming it, with no other port left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import socket
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.engine import LLMEngine
from jaxserve.front import EngineFront
from jaxserve.tokenizer import Tokenizer
from server import disagg, operations, peer_tls, reflection
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server.edge import GrpcEdge, Keys
from server.lora_registry import LoRAModule
from server.prometheus import ServerMetrics
from server.servicer import JaxServeServicer
from server.serving import ServingState

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name


class ListenError(OSError):
    """A server's port cannot be opened: `server` is "gRPC", "peer gRPC", "HTTP" or
    "metrics"; `errno` is EADDRINUSE when the port is taken."""

    def __init__(self, server: str, host: str, port: int, cause: OSError | RuntimeError):
        code = cause.errno if isinstance(cause, OSError) else None
        super().__init__(code, os.strerror(code) if code else str(cause))
        self.server, self.host, self.port = server, host, port

    @property
    def in_use(self) -> bool:
        return self.errno == errno.EADDRINUSE

    def __str__(self) -> str:
        return f"{self.server} port {self.host}:{self.port}: {self.strerror}"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    # None: no server of that protocol; 0: any free port (JaxServeServer.grpc_port and
    # .http_port say which). gRPC alone by default; the CLI serves both (--grpc_port, --port).
    grpc_port: int | None = 50051
    http_port: int | None = None  # the OpenAI-compatible HTTP API
    metrics_port: int | None = None  # None: no /metrics endpoint
    max_pending: int = 1024  # past this many requests in flight: RESOURCE_EXHAUSTED
    max_message_bytes: int = 4 << 20
    # Keys by scope (`server.operations`), each checked from "authorization: Bearer
    # KEY" or "x-api-key": inference (None: open); the admin operations (pause, sleep,
    # weights, adapters, caches; None: not served at all); disaggregated serving's
    # Prefill and PushKV (None: `api_key`'s, unless peers have a port of their own).
    api_key: str | None = None
    admin_api_key: str | None = None
    peer_api_key: str | None = None
    # Roots under which an admin call may name a file here (update_weights' path, a
    # LoRA adapter's lora_path); none: no call may.
    allowed_local_paths: tuple[str, ...] = ()
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    # Mutual TLS between instances (`server.peer_tls`), PEM files. `peer_grpc_port`: a
    # second port of the gRPC server (0: any free one) for the router and the other
    # instances, TLS with `tls_cert` that requires a client certificate signed by
    # `peer_tls_ca`; such a certificate grants the peer scope (as `peer_api_key` does,
    # and without one it alone). The same CA verifies the peers this server calls, which
    # are shown `peer_tls_cert` (with `peer_tls_key`). The router takes only the CA and
    # its certificate: it serves no peer operations.
    peer_grpc_port: int | None = None
    peer_tls_ca: str | None = None
    peer_tls_cert: str | None = None
    peer_tls_key: str | None = None
    drain_grace_s: float = 30.0
    # Disaggregated serving: "prefill" and "decode" need a front that transfers KV
    # pages (refused at start-up otherwise); "both" serves everything it can.
    role: str = "both"
    # Reading chat replies (HTTP, and gRPC's messages input): server/tool_parsers,
    # server/reasoning_parsers.
    tool_call_parser: str | None = None  # "hermes", "llama3_json", "mistral"
    tool_call_constrained: bool = False  # tool_choice "auto" constrained to valid calls too
    reasoning_parser: str | None = None  # "deepseek_r1", "qwen3"
    # LoRA adapters served from start-up (`--lora_modules`; the engine needs
    # enable_lora): each read and checked before the server reports SERVING.
    lora_modules: tuple[LoRAModule, ...] = ()
    # HTTP `GET /tokenizer_info` (vLLM's, behind the same flag: it shows the chat
    # template and the tokenizer's configuration); off: 404.
    enable_tokenizer_info_endpoint: bool = False

    def __post_init__(self):
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        object.__setattr__(self, "allowed_local_paths", tuple(self.allowed_local_paths))
        self.keys()  # refuses an empty key
        self.chat_parsers()  # refuses an unknown parser
        if self.role not in disagg.ROLES:
            raise ValueError(f"role must be one of {sorted(disagg.ROLES)}, got {self.role!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.max_pending <= 0:
            raise ValueError(f"max_pending must be positive, got {self.max_pending}")
        if self.grpc_port is None and self.http_port is None:
            raise ValueError("grpc_port and http_port are both None: no server to start")
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ValueError(f"grpc_port and http_port are both {self.grpc_port}")
        self._check_peer_tls()

    def _check_peer_tls(self) -> None:
        """Refuses a combination of the peer TLS options that cannot work, by flag name."""
        if (self.peer_tls_cert is None) != (self.peer_tls_key is None):
            raise ValueError(
                "--peer_tls_cert and --peer_tls_key (this instance's client certificate "
                "for its peers) must be given together"
            )
        if self.peer_tls_cert is not None and self.peer_tls_ca is None:
            raise ValueError(
                "--peer_tls_cert needs --peer_tls_ca, the CA that verifies the peers it is shown to"
            )
        port = self.peer_grpc_port
        if port is None:
            return
        if self.peer_tls_ca is None:
            raise ValueError(
                "--peer_grpc_port requires client certificates signed by --peer_tls_ca: give it"
            )
        if self.tls_cert is None:
            raise ValueError(
                "--peer_tls_ca (with --peer_grpc_port) needs --tls_cert and --tls_key: "
                "the peer port serves TLS with this server's certificate"
            )
        if self.grpc_port is None:
            raise ValueError("--peer_grpc_port is a second port of the gRPC server: no grpc_port")
        if port and port in (self.grpc_port, self.http_port):
            raise ValueError(f"--peer_grpc_port {port} is also the gRPC or the HTTP port")

    def keys(self) -> Keys:
        """What `server.edge` checks: the keys by scope, whether a peer's certificate
        grants the peer scope (a peer port), the body bound."""
        peer = self.peer_api_key
        if peer is None and self.peer_grpc_port is None:  # no peer credential: the user key
            peer = self.api_key
        return Keys(
            user=self.api_key,
            admin=self.admin_api_key,
            peer=peer,
            peer_certificates=self.peer_grpc_port is not None,
            max_body_bytes=self.max_message_bytes,
        )

    def peer_tls(self) -> peer_tls.PeerTLS | None:
        """The peer TLS files, read and checked (ValueError naming the flag); None: none."""
        if self.peer_tls_ca is None:
            return None
        return peer_tls.read(self.peer_tls_ca, self.peer_tls_cert, self.peer_tls_key)

    def chat_parsers(self):
        from server.openai_api.chat_output import ChatParsers

        return ChatParsers(self.tool_call_parser, self.tool_call_constrained, self.reasoning_parser)


class _MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not parse with INVALID_ARGUMENT (gRPC's own answer is
    UNKNOWN), by parsing inside the handler instead of before it."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (
            handler is None
            or handler.request_streaming  # PushKV: parsed message by message
            or not details.method.startswith(f"/{SERVICE_NAME}/")
        ):
            return handler
        parse = handler.request_deserializer

        async def parsed(raw, context):
            try:
                return parse(raw)
            except DecodeError as e:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"malformed {details.method} request: {e}"
                )

        if handler.unary_unary is not None:

            async def unary(raw, context):
                return await handler.unary_unary(await parsed(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(
                unary, response_serializer=handler.response_serializer
            )

        async def stream(raw, context):
            async for item in handler.unary_stream(await parsed(raw, context), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            stream, response_serializer=handler.response_serializer
        )


class JaxServeServer:
    """One gRPC server over one engine built by `make_engine` (in a worker thread): an
    `LLMEngine`, which it serves through an `AsyncLLMEngine`, or an `EngineFront`."""

    def __init__(
        self,
        make_engine: Callable[[], tuple[LLMEngine | EngineFront, Tokenizer | None]],
        options: ServerOptions,
        *,
        model_name: str = "",
    ):
        if options.peer_tls_ca is not None and options.peer_grpc_port is None:
            raise ValueError(
                "--peer_tls_ca: an instance takes its peers' client certificates on a port "
                "of their own; give --peer_grpc_port (0: any free port)"
            )
        self.options = options
        self._peer_tls = options.peer_tls()  # (read now: a bad file stops the start-up)
        self._make_engine = make_engine
        self.state = ServingState(
            model_name=model_name,
            max_pending=options.max_pending,
            allowed_local_paths=options.allowed_local_paths,
        )
        self.state.loras.check_modules(options.lora_modules)  # (LoRAModuleError: at once)
        self.metrics = ServerMetrics(
            model_name,
            self._stats,
            info_fn=self._info,
            replicas_fn=self._replica_stats,
            lifecycle_fn=self._lifecycle,
        )
        self.health = health.aio.HealthServicer()
        self.grpc_port: int | None = None
        self.peer_grpc_port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._http = None
        self._metrics_http = None
        self._watch: asyncio.Task | None = None
        self.ready = asyncio.Event()

    def _stats(self):
        engine = self.state.engine
        return None if engine is None else engine.stats()

    def _info(self):
        engine = self.state.engine
        return None if engine is None else engine.model_info

    def _replica_stats(self):
        engine = self.state.engine
        return None if engine is None else engine.replica_stats()

    def _lifecycle(self):
        engine = self.state.engine
        if engine is None:
            return None
        s = engine.state
        return s.is_paused, s.is_sleeping, s.weight_version

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> int | None:
        """Opens the ports (NOT_SERVING) and returns the gRPC port (None: no gRPC
        server); `load` then loads the engine and reports SERVING. ListenError, with
        no port left open, if one cannot be opened."""
        try:
            await self._open()
        except BaseException:
            await self._close_ports()
            raise
        return self.grpc_port

    async def _open(self) -> None:
        o = self.options
        if o.http_port is not None:
            from server.openai_api.api import HttpServer, build_app

            app = build_app(
                self.state,
                self.metrics,
                o.keys(),
                o.chat_parsers(),
                serve_tokenizer_info=o.enable_tokenizer_info_endpoint,
            )
            try:  # (binds the port now; serves from `start`)
                self._http = HttpServer(
                    app, o.host, o.http_port, tls_cert=o.tls_cert, tls_key=o.tls_key
                )
            except OSError as e:
                raise ListenError("HTTP", o.host, o.http_port, e) from None
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if o.grpc_port is not None:
            if o.grpc_port:
                check_port("gRPC", o.host, o.grpc_port)
            self._server = self._grpc_server()
            self.grpc_port = add_grpc_port(self._server, o)
            if o.peer_grpc_port is not None:
                if o.peer_grpc_port:
                    check_port("peer gRPC", o.host, o.peer_grpc_port)
                self.peer_grpc_port = add_peer_grpc_port(self._server, o, self._peer_tls)
            await self._server.start()
            logger.info("gRPC on %s:%d", o.host, self.grpc_port)
            if self.peer_grpc_port is not None:
                logger.info("gRPC for peers (mutual TLS) on %s:%d", o.host, self.peer_grpc_port)
        if self._http is not None:
            self.http_port = await self._http.start()
            logger.info("HTTP (OpenAI API) on %s:%d", o.host, self.http_port)
        if o.metrics_port is not None:
            try:
                self._metrics_http = self.metrics.serve(o.metrics_port, o.host)
            except OSError as e:
                raise ListenError("metrics", o.host, o.metrics_port, e) from None
            self.metrics_port = self._metrics_http.server_port
        logger.info("NOT_SERVING while the model loads")

    def _grpc_server(self) -> grpc.aio.Server:
        o, tls = self.options, self._peer_tls
        service = pb.DESCRIPTOR.services_by_name["JaxServe"]
        operations.check_table(grpc_methods={m.name for m in service.methods})
        interceptors = [GrpcEdge(SERVICE_NAME, o.keys()), _MalformedRequestInterceptor()]
        server = grpc.aio.server(interceptors=interceptors, options=grpc_server_options(o))
        pb_grpc.add_JaxServeServicer_to_server(
            JaxServeServicer(
                self.state,
                self.metrics,
                max_message_bytes=o.max_message_bytes,
                parsers=o.chat_parsers(),
                peer_api_key=o.peer_api_key,
                peer_credentials=None if tls is None else tls.channel_credentials(),
            ),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable(server, (SERVICE_NAME, health_service))
        return server

    async def _close_ports(self) -> None:
        """After a failed `start`: closes what it opened."""
        if self._server is not None:
            await self._server.stop(0)
        if self._http is not None:
            await self._http.stop(0)
        if self._metrics_http is not None:
            await asyncio.to_thread(self._metrics_http.shutdown)

    async def load(self) -> None:
        """Builds (and warms up) the engine off the event loop, reads the `lora_modules`
        adapters, then serves. Raises ValueError (the front shut down again) if the
        front cannot serve the role, LoRAModuleError if an adapter does not load."""
        engine, tokenizer = await asyncio.to_thread(self._make_engine)
        # Data-parallel replicas come with their own front (jaxserve.distributed.data_parallel).
        front = AsyncLLMEngine(engine) if isinstance(engine, LLMEngine) else engine
        try:
            disagg.check_role(front, self.options.role)
            await self.state.loras.load_modules(front, self.options.lora_modules)
        except ValueError:
            await asyncio.to_thread(front.close)
            raise
        self.state.tokenizer = tokenizer
        self.state.engine = front
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watch = asyncio.create_task(self._watch_engine())
        self.ready.set()
        logger.info("SERVING %s", self.state.model_name)

    async def _watch_engine(self) -> None:
        while self.state.engine.healthy:
            await asyncio.sleep(0.5)
        logger.error("the engine died: %r; reporting NOT_SERVING", self.state.engine.error)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """Drains: NOT_SERVING, refuse new calls, let running ones finish within `grace`."""
        grace = self.options.drain_grace_s if grace is None else grace
        self.state.draining = True  # new requests: UNAVAILABLE / 503
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        grpc_stop = None
        if self._server is not None:
            grpc_stop = asyncio.create_task(self._server.stop(grace))
        await self._drain_http(grace, grpc_stop)
        if grpc_stop is not None:
            await grpc_stop
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        # Off the event loop (joins threads, saves the KV tier, calls Ray replicas).
        if self.state.engine is not None:
            await asyncio.to_thread(self.state.engine.close)
        if self._metrics_http is not None:
            await asyncio.to_thread(self._metrics_http.shutdown)

    async def _drain_http(self, grace: float, grpc_stop: asyncio.Task | None) -> None:
        """Keeps the HTTP port open (answering 503) while requests are in flight and
        gRPC drains, for at most `grace` seconds, then closes it."""
        if self._http is None:
            return
        deadline = time.monotonic() + grace
        engine = self.state.engine

        def busy() -> bool:
            grpc_busy = grpc_stop is not None and not grpc_stop.done()
            return grpc_busy or (engine is not None and engine.num_requests > 0)

        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self._http.stop(max(deadline - time.monotonic(), 0.0))


def default_model_name(model_dir: str) -> str:
    return os.path.basename(os.path.normpath(model_dir))


def grpc_server_options(o: ServerOptions) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", o.max_message_bytes),
        ("grpc.max_send_message_length", o.max_message_bytes),
        # A port another process holds is an error, not shared with it (gRPC's
        # default on Linux, SO_REUSEPORT, lets a second server bind and take calls).
        ("grpc.so_reuseport", 0),
    ]


def check_port(server: str, host: str, port: int) -> None:
    """ListenError if `port` cannot be opened on `host` (found by binding a socket as
    gRPC and uvicorn do, then closing it). gRPC's own failure to bind is a
    RuntimeError without the cause, which its C core logs apart."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host.strip("[]"), port), family=family).close()
    except OSError as e:
        raise ListenError(server, host, port, e) from None


def add_grpc_port(server: grpc.aio.Server, o: ServerOptions, *, tls: bool = True) -> int:
    """Binds `o.grpc_port` (TLS with `o.tls_cert` unless not `tls`); ListenError if
    it cannot be (`check_port` first says why)."""
    address = _address(o.host, o.grpc_port)
    try:
        if tls and o.tls_cert:
            with open(o.tls_cert, "rb") as c, open(o.tls_key, "rb") as k:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            return server.add_secure_port(address, creds)
        return server.add_insecure_port(address)
    except RuntimeError as e:  # taken since the check
        raise ListenError("gRPC", o.host, o.grpc_port, e) from None


def add_peer_grpc_port(server: grpc.aio.Server, o: ServerOptions, tls: peer_tls.PeerTLS) -> int:
    """Binds `o.peer_grpc_port`: TLS with `o.tls_cert` that requires a client certificate
    signed by `tls.ca` (`server.peer_tls`); ListenError if it cannot be."""
    with open(o.tls_cert, "rb") as c, open(o.tls_key, "rb") as k:
        creds = tls.server_credentials(c.read(), k.read())
    try:
        return server.add_secure_port(_address(o.host, o.peer_grpc_port), creds)
    except RuntimeError as e:  # taken since the check
        raise ListenError("peer gRPC", o.host, o.peer_grpc_port, e) from None


def _address(host: str, port: int) -> str:
    return f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
