"""gRPC server reflection, v1 and v1alpha, so that grpcurl, grpcui, Postman and the
like list and describe the services without the .proto files.

grpcio-reflection serves only `grpc.reflection.v1alpha` (v1 in Python is grpc/grpc
issue 38576), which is deprecated; clients try `grpc.reflection.v1` first, and some
(nice-grpc, tonic-based tools) speak only v1. v1 is v1alpha under another package:
the same messages, field for field, so the same bytes on the wire. Both are served
here by one v1alpha servicer, and v1's descriptor (v1alpha's, renamed) is added to
the default descriptor pool, so that a client can describe v1 itself too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import grpc
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb

V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"  # as grpc-proto names it


def enable(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serves reflection v1 and v1alpha on `server`, each listing `service_names` and
    both reflection services."""
    _v1_file()
    servicer = reflection.aio.ReflectionServicer((*service_names, V1, V1ALPHA))
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb.ServerReflectionResponse.SerializeToString,
        )
    }
    for service in (V1, V1ALPHA):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


@functools.cache
def _v1_file() -> descriptor.FileDescriptor:
    """v1's file in the default pool: v1alpha's, with v1's package (and without
    v1alpha's options: its Java and Go packages, `deprecated`)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(_V1_FILE)  # (imported from a package that has it)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, new.strip(".")
    proto.ClearField("options")
    for message in proto.message_type:  # (none has nested types)
        for field in message.field:
            if field.type_name:  # (a scalar has none; setting "" would give it one)
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    return pool.AddSerializedFile(proto.SerializeToString())
