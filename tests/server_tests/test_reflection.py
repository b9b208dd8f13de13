"""gRPC server reflection, v1 and v1alpha: each lists the services (JaxServe, health,
both reflection services) and describes them, v1 to a client whose messages are v1's
own (built from the v1 descriptor the server registers); both stay open on a server
with an API key, as health checks do, while JaxServe's methods take the key.

No model: the ports answer while it would load.
"""

import asyncio

import grpc
import pytest
from conftest import ServerThread
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb

from server import jaxserve_pb2 as pb
from server import reflection
from server.app import SERVICE_NAME

WANT = {SERVICE_NAME, "grpc.health.v1.Health", reflection.V1, reflection.V1ALPHA}
V1ALPHA_MESSAGES = (v1alpha_pb.ServerReflectionRequest, v1alpha_pb.ServerReflectionResponse)


@pytest.fixture(scope="module")
def target():
    """A gRPC server with an API key, not loaded (no model)."""
    server = ServerThread(None, load=False, metrics_port=None, api_key="s3cret")
    yield server.target
    server.stop()


@pytest.fixture(scope="module")
def v1_messages(target):
    """The v1 request and response classes, from the v1 descriptor the server
    registered (as a client that compiled grpc/reflection/v1/reflection.proto has them)."""
    pool = descriptor_pool.Default()
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
        for name in ("ServerReflectionRequest", "ServerReflectionResponse")
    )


def ask(target: str, service: str, requests: list[dict], messages) -> list:
    """One ServerReflectionInfo stream on `service`: a reply per request."""
    request_cls, response_cls = messages

    async def call():
        async with grpc.aio.insecure_channel(target) as channel:
            info = channel.stream_stream(
                f"/{service}/ServerReflectionInfo",
                request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            return [r async for r in info(iter(request_cls(**r) for r in requests))]

    return asyncio.run(call())


def test_each_version_lists_the_services(target, v1_messages):
    for service, messages in ((reflection.V1, v1_messages), (reflection.V1ALPHA, V1ALPHA_MESSAGES)):
        [reply] = ask(target, service, [{"list_services": ""}], messages)
        assert {s.name for s in reply.list_services_response.service} == WANT, service


def test_v1_describes_jaxserve_and_itself(target, v1_messages):
    symbols = [SERVICE_NAME, reflection.V1]
    requests = [{"file_containing_symbol": s} for s in symbols]
    replies = ask(target, reflection.V1, requests, v1_messages)
    files = []
    for reply in replies:
        assert not reply.HasField("error_response"), reply.error_response
        [raw] = reply.file_descriptor_response.file_descriptor_proto
        files.append(descriptor_pb2.FileDescriptorProto.FromString(raw))
    jaxserve, v1 = files
    assert jaxserve.name == pb.DESCRIPTOR.name and "JaxServe" in [s.name for s in jaxserve.service]
    [method] = v1.service[0].method
    assert (v1.package, v1.service[0].name) == ("grpc.reflection.v1", "ServerReflection")
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert method.output_type == ".grpc.reflection.v1.ServerReflectionResponse"


def test_an_unknown_symbol_is_an_error_reply(target, v1_messages):
    [reply] = ask(target, reflection.V1, [{"file_containing_symbol": "no.Such"}], v1_messages)
    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_open_while_jaxserve_takes_the_key(target, v1_messages):
    """The edge checks JaxServe's methods only (reflection, like health, is open)."""

    async def call():
        async with grpc.aio.insecure_channel(target) as channel:
            info = channel.unary_unary(
                f"/{SERVICE_NAME}/GetModelInfo",
                request_serializer=pb.GetModelInfoRequest.SerializeToString,
                response_deserializer=pb.ModelInfo.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await info(pb.GetModelInfoRequest())
            return e.value.code()

    assert asyncio.run(call()) == grpc.StatusCode.UNAUTHENTICATED
    [reply] = ask(target, reflection.V1, [{"list_services": ""}], v1_messages)
    assert SERVICE_NAME in {s.name for s in reply.list_services_response.service}
