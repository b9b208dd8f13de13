"""KV pages that travel: a prefill instance exports a prompt's cached pages, a decode
instance imports them into its KV tier, where admission finds them; and the tier
saved at shutdown. `LLMEngine`'s methods of the same names pass in its pieces.

Host logic: the runner's gather is the one device call, made through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.kv import PagePool
from jaxserve.kv.connector import KVConnector, cached_prefix, encode_gathered
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import KVLayout, decode_page

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner


def export_prefix(
    pool: PagePool,
    runner: ModelRunner,
    layout: KVLayout,
    page_size: int,
    token_ids: list[int],
    salt: str | None = None,
) -> list[bytes]:
    """The encoded KV pages of `token_ids`' full pages that the pool holds, in order
    up to the first it lacks."""
    named = cached_prefix(pool, token_ids, page_size, salt)
    if not named:
        return []
    gathered = runner.gather_pages([n[0] for n in named])
    return [data for _, data in encode_gathered(layout, named, gathered)]


def save_kv_tier(connector: KVConnector | None, pool: PagePool) -> None:
    """Copies every cached page the tier lacks into it (and its disk), waiting for it."""
    if connector is not None:
        connector.flush()
        connector.save(pool.named_pages())


def import_pages(tier: KVTier | None, layout: KVLayout, pages: list[bytes]) -> int:
    """Checks pushed pages and keeps them in the KV tier. Raises KVTransferError (a
    ValueError) naming the first bad page, keeping none, or ValueError if there is no
    tier."""
    if tier is None:
        raise ValueError("this engine has no KV tier to receive pages in: set kv_offload_bytes")
    decoded = [decode_page(layout, data) for data in pages]
    for page, data in zip(decoded, pages, strict=True):
        tier.put(page.digest, data)
    return len(decoded)


__all__ = ["export_prefix", "import_pages", "save_kv_tier"]
