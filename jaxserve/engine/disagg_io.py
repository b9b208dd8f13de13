"""KV pages that travel: a prefill instance exports a prompt's cached pages, a decode
instance imports them into its KV tier, where admission finds them; and the tier
saved at shutdown. `KVTransfer`'s methods are `LLMEngine`'s.

Host logic: the runner's gather is the one device call, made through it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig
from jaxserve.kv import PagePool
from jaxserve.kv.connector import KVConnector, cached_prefix, encode_gathered
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import KVLayout, decode_page
from jaxserve.lora import LoRARequest
from jaxserve.sampling_params import ParamError

if TYPE_CHECKING:
    from jaxserve.engine.adapters import EngineAdapters
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.scheduler import Scheduler


class KVTransfer:
    """Export, import and the tier's save: methods of `LLMEngine`."""

    # The engine's, read here.
    config: EngineConfig
    runner: ModelRunner
    scheduler: Scheduler
    pool: PagePool
    tier: KVTier | None
    kv_connector: KVConnector | None
    adapters: EngineAdapters | None

    @functools.cached_property
    def kv_layout(self) -> KVLayout:
        """What this engine's KV pages hold, and of which model (kv/transfer.py)."""
        return self.runner.kv_layout()

    def export_prefix(
        self, token_ids: list[int], salt: str | None = None, lora: LoRARequest | None = None
    ) -> list[bytes]:
        """The encoded KV pages of `token_ids`' full pages that the pool holds, in order
        up to the first it lacks: what a prefill instance pushes to a decode instance.
        `lora`: the adapter they were computed under (its pages are its own: a decode
        instance finds them for requests of the same adapter only). Call it between
        steps (the engine's thread)."""
        if lora is not None:
            if self.adapters is None:
                raise ParamError("lora", f"got adapter {lora.lora_name!r}: enable_lora is off")
            salt = self.adapters.salt(lora, salt)
        if self.scheduler.kv.windowed:
            raise ValueError(
                f"{self.config.model_dir!r} runs a hybrid KV cache (layer groups of their own "
                "pages), whose pages do not travel: serve the prefill instance with "
                "disable_hybrid_kv_cache_manager=True"
            )
        named = cached_prefix(self.pool, token_ids, self.config.cache.page_size, salt)
        if not named:
            return []
        gathered = self.runner.gather_pages([n[0] for n in named])
        return [data for _, data in encode_gathered(self.kv_layout, named, gathered)]

    def save_kv_tier(self) -> None:
        """Copies every cached page the tier lacks into it (and its disk), waiting for
        it: at shutdown, so that a restart with the same kv_offload_dir finds them."""
        if self.kv_connector is not None:
            self.kv_connector.flush()
            self.kv_connector.save(self.pool.named_pages())

    def import_pages(self, pages: list[bytes]) -> int:
        """Checks pushed pages and keeps them in the KV tier, where admission finds them
        (any thread). Raises KVTransferError (a ValueError) naming the first bad page,
        keeping none, or ValueError if this engine has no tier."""
        if self.tier is None:
            raise ValueError("this engine has no KV tier to receive pages in: set kv_offload_bytes")
        decoded = [decode_page(self.kv_layout, data) for data in pages]
        for page, data in zip(decoded, pages, strict=True):
            self.tier.put(page.digest, data)
        return len(decoded)


__all__ = ["KVTransfer"]
