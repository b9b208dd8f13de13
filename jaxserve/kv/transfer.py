"""KV pages as bytes: the one format in which pages leave a pool and come back.

A full page is named by its *digest*, a hash chained over the prefix it ends
(`page_digest(parent digest, the page's tokens, salt)`), so it means the same
in every process that runs the same model: the host/disk tier files pages under
it, and a prefill instance hands pages to a decode instance under it. (The pool
itself keys pages by value, collision-free; the digest is only for pages that
travel.)

A page's bytes are a header, its arrays and a checksum:

  MAGIC | u32 header length | header (JSON) | array bytes... | blake2b-16 of all before

The header names the `KVLayout` fingerprint (the model's identity, page size,
and each per-page array's name, dtype and shape), the page's digest, its
parent's digest and its tokens. Pages are a list of named arrays so that a KV
dtype with per-token scales (int8/fp8) adds a "scale" array beside "kv" and
changes the fingerprint. `decode_page` refuses, with `KVTransferError` naming
what is wrong, a page that is truncated or corrupt (checksum), from another
model or layout (fingerprint), or not the page asked for (digest).

No JAX here: the runner gathers pages into numpy arrays and scatters them back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Hashable, Sequence

import ml_dtypes  # noqa: F401  (names numpy's bfloat16 and float8 dtypes, as KV dtypes)
import numpy as np

MAGIC = b"JXKV\x01"
ROOT_DIGEST = b"\x00" * 16  # the parent of a sequence's first page
_CHECKSUM_BYTES = 16


class KVTransferError(ValueError):
    """A page that must not be installed: corrupt, truncated, foreign or misnamed."""


def page_digest(parent: bytes, tokens: Sequence[int], salt: Hashable = None) -> bytes:
    """The 16-byte digest of a full page, chained over every page before it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, np.int64).tobytes())
    # The salt separates tenants: a salted chain shares no digest with an unsalted one.
    h.update(b"\x00" if salt is None else b"\x01" + repr(salt).encode())
    return h.digest()


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one page holds, and of which model: two pools exchange pages only if
    their layouts' fingerprints are equal."""

    model_id: str  # a digest of the model's architecture and weights
    page_size: int
    arrays: tuple[ArraySpec, ...]  # per page, e.g. ("kv", float32, [L, page, 2K, H])

    @property
    def fingerprint(self) -> str:
        spec = [self.model_id, self.page_size, [dataclasses.astuple(a) for a in self.arrays]]
        return hashlib.blake2b(json.dumps(spec).encode(), digest_size=12).hexdigest()

    @property
    def page_bytes(self) -> int:
        """The arrays' bytes of one page (the encoded page adds a small header)."""
        return sum(a.nbytes for a in self.arrays)


@dataclasses.dataclass(frozen=True)
class Page:
    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]
    arrays: dict[str, np.ndarray]


def encode_page(layout: KVLayout, page: Page) -> bytes:
    header = {
        "fingerprint": layout.fingerprint,
        "digest": page.digest.hex(),
        "parent": page.parent.hex(),
        "tokens": list(page.tokens),
    }
    parts = [MAGIC, b"", json.dumps(header).encode()]
    parts[1] = struct.pack("<I", len(parts[2]))
    for spec in layout.arrays:
        a = page.arrays[spec.name]
        if a.shape != spec.shape or a.dtype != np.dtype(spec.dtype):
            raise ValueError(
                f"page array {spec.name!r} is {a.dtype}{list(a.shape)}; the layout says "
                f"{spec.dtype}{list(spec.shape)}"
            )
        parts.append(np.ascontiguousarray(a).tobytes())
    body = b"".join(parts)
    return body + hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest()


def decode_page(layout: KVLayout, data: bytes, digest: bytes | None = None) -> Page:
    """The page in `data`, checked whole; `digest`: the page that was asked for."""
    if len(data) < len(MAGIC) + 4 + _CHECKSUM_BYTES or not data.startswith(MAGIC):
        raise KVTransferError(f"not a KV page ({len(data)} bytes, bad magic)")
    body, checksum = data[:-_CHECKSUM_BYTES], data[-_CHECKSUM_BYTES:]
    if hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest() != checksum:
        raise KVTransferError(
            f"KV page checksum mismatch ({len(data)} bytes): corrupt or truncated"
        )
    (n,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(body[start : start + n])
        fingerprint, page_hex = header["fingerprint"], header["digest"]
        parent, tokens = bytes.fromhex(header["parent"]), tuple(header["tokens"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVTransferError(f"KV page header unreadable: {e}") from None
    if fingerprint != layout.fingerprint:  # (the refusal names neither: it would be a key)
        raise KVTransferError("KV page from another model or layout (fingerprints differ)")
    if digest is not None and page_hex != digest.hex():
        raise KVTransferError(f"KV page is {page_hex}, asked for {digest.hex()}")
    if len(tokens) != layout.page_size:
        raise KVTransferError(f"KV page holds {len(tokens)} tokens, not this layout's page size")
    offset, arrays = start + n, {}
    if len(body) - offset != layout.page_bytes:
        raise KVTransferError(
            f"KV page has {len(body) - offset} bytes of arrays, not this layout's size"
        )
    for spec in layout.arrays:
        flat = np.frombuffer(
            body, np.dtype(spec.dtype), spec.nbytes // np.dtype(spec.dtype).itemsize, offset
        )
        arrays[spec.name] = flat.reshape(spec.shape)
        offset += spec.nbytes
    return Page(bytes.fromhex(page_hex), parent, tokens, arrays)


def check_chain(page: Page, salt: Hashable = None) -> None:
    """Raises KVTransferError unless the page's digest is its parent + tokens + salt's."""
    if page_digest(page.parent, page.tokens, salt) != page.digest:
        raise KVTransferError(
            f"KV page {page.digest.hex()} does not hash to its parent and tokens (or another salt)"
        )
