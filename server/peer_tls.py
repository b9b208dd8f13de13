"""Mutual TLS between jaxserve instances: the peer scope (`server.operations`) granted by
a client certificate that one deployment CA (`peer_tls_ca`) signed.

gRPC's Python server either requires a verified client certificate on a port or never
asks for one (`grpc.ssl_server_credentials(require_client_auth=...)`: with False the
handshake requests none, so none reaches the call). Peers therefore have a port of their
own on the same server, `peer_grpc_port`: TLS with the server's certificate (`tls_cert`)
that requires a client certificate signed by `peer_tls_ca`. Users keep `grpc_port`, where
no certificate is asked for. A call's auth context holds a certificate (`x509_pem_cert`,
with `x509_common_name` and `x509_subject`) only when its handshake presented one and gRPC
verified it, which only the peer port does: such a call is a peer's.

The same CA verifies the peers' servers when this instance calls them (the router's
`Prefill`, a prefill instance's `PushKV`), with this instance's own client certificate
(`peer_tls_cert`, `peer_tls_key`).
"""

from __future__ import annotations

import dataclasses
import ssl

import grpc


@dataclasses.dataclass(frozen=True)
class PeerTLS:
    """The PEM bytes, read and checked at start-up (`read`)."""

    ca: bytes  # the deployment CA: signs every instance's server and client certificate
    cert: bytes | None = None  # this instance's client certificate (chain), with `key`
    key: bytes | None = None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A peer's server verified against the CA; this instance's certificate shown."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def server_credentials(self, cert: bytes, key: bytes) -> grpc.ServerCredentials:
        """The peer port's: the server's own certificate; a client's required and verified."""
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=self.ca, require_client_auth=True
        )


def read(ca: str, cert: str | None = None, key: str | None = None) -> PeerTLS:
    """The files' PEM bytes; ValueError naming the flag of one that cannot be read or is
    not what it should be (a certificate; a certificate and its private key)."""
    pem_ca = _read("--peer_tls_ca", ca)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=pem_ca.decode("ascii"))
    except (ssl.SSLError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"--peer_tls_ca {ca}: not a PEM certificate ({e})") from None
    if cert is None or key is None:
        return PeerTLS(pem_ca)
    pem_cert, pem_key = _read("--peer_tls_cert", cert), _read("--peer_tls_key", key)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ValueError(
            f"--peer_tls_cert {cert} and --peer_tls_key {key}: not a PEM certificate and "
            f"its private key ({e})"
        ) from None
    return PeerTLS(pem_ca, pem_cert, pem_key)


def _read(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be read ({e.strerror})") from None


def certified(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call came with a client certificate gRPC verified against the CA (only
    the peer port asks for one, and it requires it verified)."""
    return bool(context.auth_context().get("x509_pem_cert"))
