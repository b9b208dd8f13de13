"""The disaggregation router: the jaxserve.v1 API in front of prefill and decode instances.

  jaxserve serve --role=router --prefill_targets=h:1,h:2 --decode_targets=h:3,h:4

For each request the router picks a prefill instance and a decode instance
(round robin), asks the prefill instance to compute the prompt's KV and first
tokens and push the pages to the decode instance (`Prefill`, server/disagg.py),
then streams the decode instance's `Generate` of the resumed samples to the
client, patched into one ordinary stream: the samples that finished at the
first token, prompt logprobs on the first message, usage over all samples on
the last. With mutual TLS (`server.peer_tls`) the targets are the instances'
peer ports, reached over TLS with the router's client certificate. Nothing
reaches the client before the decode instance has answered, so a failure up to
then is retried:

  - a decode instance that is down or refuses the pages (Prefill: ABORTED), or
    that fails before its first message: the next decode instance; after all
    of them, the whole request colocated on the prefill instance (a full
    engine, which holds the prompt's pages in its prefix cache);
  - requests that cannot be split (min_tokens > 1, structured output, beam search,
    a LoRA adapter) run colocated from the start, on a decode instance (a prefill
    one if none answers);
  - a prefill instance that fails (down, or dies mid-transfer): the next one;
    with none left the request fails with UNAVAILABLE naming the cause;
  - a failure after the client has output: UNAVAILABLE, the stream ends.

The client's cancellation cancels the router's calls, which cancel (abort) the
request on every instance holding it.
"""

from __future__ import annotations

import itertools
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from server import disagg
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server.edge import GrpcEdge
from server.servicer import sampling_params_from_proto

logger = logging.getLogger(__name__)

_PASS_ON = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


class _Retry(Exception):
    """The attempt failed before the client saw anything: try the next instance."""


class _PrefillFailed(_Retry):
    """The prefill instance failed (down, or died mid-transfer): skip it."""


class RouterServicer(pb_grpc.JaxServeServicer):
    def __init__(
        self,
        prefill_targets: list[str],
        decode_targets: list[str],
        max_message_bytes: int,
        *,
        peer_api_key: str | None = None,
        peer_credentials: grpc.ChannelCredentials | None = None,
    ):
        self.peer_api_key = peer_api_key  # sent with Prefill (None: the caller's key)
        # TLS to every instance (`server.peer_tls`; None: plaintext): the instances'
        # peer ports, which take this certificate as the peer scope's credential.
        self.peer_credentials = peer_credentials
        if not prefill_targets or not decode_targets:
            raise ValueError(
                f"the router needs prefill_targets and decode_targets, got {prefill_targets} "
                f"and {decode_targets}"
            )
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._stubs: dict[str, pb_grpc.JaxServeStub] = {}  # made on the serving loop
        self.prefill_targets, self.decode_targets = prefill_targets, decode_targets
        self._turn = itertools.count()
        self._ids = itertools.count()

    def _stub(self, target: str) -> pb_grpc.JaxServeStub:
        if target not in self._stubs:
            channel = disagg.channel(target, self.peer_credentials, self._options)
            self._stubs[target] = pb_grpc.JaxServeStub(channel)
        return self._stubs[target]

    def _order(self, targets: list[str]) -> list[str]:
        k = next(self._turn) % len(targets)
        return targets[k:] + targets[:k]

    # ------------------------------------------------------------------ Generate

    async def Generate(self, request, context):
        if request.HasField("resume"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "resume is for decode instances, not the router"
            )
        if not request.request_id:
            request.request_id = f"router-{next(self._ids)}"
        md = disagg.auth_metadata(context)
        try:
            why = disagg.can_disaggregate(
                sampling_params_from_proto(request.sampling_params),
                request.HasField("beam_search"),
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        errors, failed = [], set()
        for prefill, decode in self._attempts(why is None):
            if prefill in failed:
                continue
            try:
                stream = (
                    self._split(request, prefill, decode, md)
                    if prefill is not None and decode is not None
                    else self._colocated(request, prefill or decode, md)
                )
                async for msg in stream:
                    yield msg
                return
            except _Retry as e:
                logger.warning("request %s: %s; trying the next instance", request.request_id, e)
                errors.append(str(e))
                if isinstance(e, _PrefillFailed):
                    failed.add(prefill)
            except grpc.aio.AioRpcError as e:  # after the client had output, or not retryable
                code = e.code() if e.code() in _PASS_ON else grpc.StatusCode.UNAVAILABLE
                await context.abort(code, f"{e.details()}")
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, "no instance could serve the request: " + "; ".join(errors)
        )

    def _attempts(self, split: bool) -> list[tuple[str | None, str | None]]:
        """(prefill, decode) pairs to try in order; None for a colocated run's other role."""
        if not split:  # whole, on a decode instance, else on a prefill instance
            return [(None, t) for t in self._order(self.decode_targets)] + [
                (None, t) for t in self._order(self.prefill_targets)
            ]
        attempts = []
        for prefill in self._order(self.prefill_targets):
            attempts += [(prefill, d) for d in self._order(self.decode_targets)]
            attempts.append((prefill, None))  # colocated on the prefill instance
        return attempts

    async def _colocated(self, request, target: str, md):
        """The whole request on one instance; retried if it fails before its first message."""
        call = self._stub(target).Generate(request, metadata=md)
        try:
            async for msg in _messages(call, target, retry_until_first=True):
                yield msg
        finally:
            call.cancel()

    async def _split(self, request, prefill: str, decode: str, md):
        call = self._stub(prefill).Prefill(
            pb.PrefillRequest(request=request, decode_target=decode),
            metadata=disagg.peer_metadata(self.peer_api_key, md),
        )
        try:
            reply = await call
        except grpc.aio.AioRpcError as e:
            if e.code() in _PASS_ON or e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise
            what = f"prefill on {prefill} -> decode {decode}: {e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.ABORTED:  # the push to the decode instance failed
                raise _Retry(what) from None
            raise _PrefillFailed(what) from None
        finally:
            call.cancel()
        head = list(reply.messages)
        if head:
            head[0].prompt_logprobs.extend(reply.prompt_logprobs)
        done_tokens = sum(len(m.token_ids) for m in head)
        if not reply.resume.samples:  # every sample finished at its first token
            for msg in head:
                yield msg
            yield pb.GenerateResponse(request_id=request.request_id, usage=reply.usage)
            return
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(request)
        resumed.resume.CopyFrom(reply.resume)
        # The prefill sent them; asked again, the decode instance would recompute the prompt.
        resumed.sampling_params.ClearField("prompt_logprobs")
        call = self._stub(decode).Generate(resumed, metadata=md)
        try:
            first = True
            async for msg in _messages(call, decode, retry_until_first=True):
                if first:
                    for m in head:
                        yield m
                    if not head:
                        msg.prompt_logprobs.extend(reply.prompt_logprobs)
                    first = False
                if msg.HasField("usage"):
                    msg.usage.completion_tokens += done_tokens
                    msg.usage.cached_prompt_tokens = reply.usage.cached_prompt_tokens
                yield msg
        finally:
            call.cancel()

    # ------------------------------------------------------------------ the rest

    async def Complete(self, request, context):
        messages = [m async for m in self.Generate(request, context)]
        return complete_from_stream(request.request_id, messages)

    async def _unary(self, method: str, request, context):
        target = self._order(self.prefill_targets)[0]
        try:
            return await getattr(self._stub(target), method)(
                request, metadata=disagg.auth_metadata(context)
            )
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details())

    async def Tokenize(self, request, context):
        return await self._unary("Tokenize", request, context)

    async def Detokenize(self, request, context):
        return await self._unary("Detokenize", request, context)

    async def GetModelInfo(self, request, context):
        return await self._unary("GetModelInfo", request, context)

    async def Prefill(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the router does not prefill")

    async def PushKV(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the router keeps no KV pages")


async def _messages(call, target: str, *, retry_until_first: bool):
    """The call's messages; a failure before the first one is a _Retry."""
    first = True
    try:
        async for msg in call:
            first = False
            yield msg
    except grpc.aio.AioRpcError as e:
        if first and retry_until_first and e.code() not in _PASS_ON:
            raise _Retry(f"{target}: {e.code().name}: {e.details()}") from None
        raise


def complete_from_stream(request_id: str, messages: list) -> pb.CompleteResponse:
    """Gathers a Generate stream into the Complete answer."""
    reply = pb.CompleteResponse(request_id=request_id)
    samples: dict[int, pb.Completion] = {}
    for msg in messages:
        reply.prompt_logprobs.extend(msg.prompt_logprobs)
        if msg.HasField("usage"):
            reply.usage.CopyFrom(msg.usage)
            continue
        c = samples.setdefault(msg.index, pb.Completion(index=msg.index))
        c.text += msg.text
        c.token_ids.extend(msg.token_ids)
        c.logprobs.extend(msg.logprobs)
        if msg.logprobs:
            c.cumulative_logprob = c.cumulative_logprob + sum(
                lp.entries[0].logprob for lp in msg.logprobs
            )
        if msg.finish_reason:
            c.finish_reason, c.stop_reason = msg.finish_reason, msg.stop_reason
    reply.completions.extend(samples[i] for i in sorted(samples))
    return reply


class RouterServer:
    """The router's gRPC server: RouterServicer, health (SERVING at once), auth."""

    def __init__(self, servicer: RouterServicer, options):
        self.servicer = servicer
        self.options = options
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self.grpc_port: int | None = None

    async def start(self) -> int:
        """Opens `options.grpc_port` (the router serves gRPC only) and returns it;
        ListenError if it cannot be opened."""
        from server.app import (
            SERVICE_NAME,
            add_grpc_port,
            check_port,
            grpc_server_options,
        )

        o = self.options
        if o.grpc_port is None:
            raise ValueError("the router serves gRPC only: it needs a grpc_port")
        if o.grpc_port:
            check_port("gRPC", o.host, o.grpc_port)
        self._server = grpc.aio.server(
            interceptors=[GrpcEdge(SERVICE_NAME, o.keys())], options=grpc_server_options(o)
        )
        pb_grpc.add_JaxServeServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        try:
            # (tls=False: the router has always served without TLS)
            self.grpc_port = add_grpc_port(self._server, o, tls=False)
        except BaseException:
            await self._server.stop(0)
            raise
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("router (gRPC) on %s:%d", o.host, self.grpc_port)
        return self.grpc_port

    async def stop(self, grace: float | None = None) -> None:
        from server.app import SERVICE_NAME

        grace = self.options.drain_grace_s if grace is None else grace
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.stop(grace)


__all__ = ["RouterServer", "RouterServicer", "complete_from_stream"]
