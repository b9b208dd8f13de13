"""API keys, compared in constant time (`hmac.compare_digest`) by both servers.

A key is compared as bytes: the server's key as UTF-8, a presented value as the raw
bytes it arrived as (HTTP headers reach Starlette decoded as latin-1; gRPC metadata
as text), so a non-ASCII key works and a non-ASCII guess is refused, never an error.
"""

from __future__ import annotations

import hmac


def key_bytes(key: str) -> bytes:
    """The server's key (or "Bearer KEY") as bytes (an undecodable byte that the
    environment carried as a surrogate comes back as itself)."""
    return key.encode("utf-8", errors="surrogateescape")


def presented(value: str | bytes | None, *, latin1: bool = False) -> bytes | None:
    """A presented credential as bytes: `latin1` for a value decoded from raw header
    bytes as latin-1 (Starlette's headers), else UTF-8; None if it has no bytes."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        return value.encode("latin-1" if latin1 else "utf-8", errors="surrogateescape")
    except UnicodeEncodeError:
        return None


def matches(value: bytes | None, expected: bytes) -> bool:
    """Whether a presented credential is the expected one, in a time that does not
    depend on where they differ (`hmac.compare_digest`)."""
    return value is not None and hmac.compare_digest(value, expected)
