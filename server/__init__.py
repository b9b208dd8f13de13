"""The gRPC server (jaxserve.v1): proto, generated stubs, servicer and client.

It builds on `jaxserve.engine`; nothing in the engine imports it.
"""
