"""How the runner lays out the KV cache: its layer groups (`jaxserve.config.kv_groups`),
each group's page count, and so each layer's arrays."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.config import kv_groups as kvg
from jaxserve.distributed import meshes
from pallas_kernels.kv_layout import CacheLayout


@dataclasses.dataclass(frozen=True)
class KVPlan:
    groups: tuple[kvg.KVGroup, ...]
    group_pages: tuple[int, ...]  # null page included, in `groups`' order
    layer_bytes: int  # one page of one layer, per device

    @classmethod
    def make(cls, config: EngineConfig, group_pages: tuple[int, ...]) -> KVPlan:
        layer_bytes = config.kv_bytes_per_page(per_device=True) // config.model.num_layers
        return cls(config.kv_groups, tuple(group_pages), layer_bytes)

    @property
    def hybrid(self) -> bool:
        """Whether some group slides (or there are several)."""
        return len(self.groups) > 1 or self.groups[0].window is not None

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Each layer's group, for `StepInput.from_host` (empty for one group)."""
        return kvg.group_of_layer(self.groups) if len(self.groups) > 1 else ()

    @property
    def layer_pages(self) -> list[int]:
        """Each layer's page count: its group's."""
        return [self.group_pages[g] for g in kvg.group_of_layer(self.groups)]

    def caches(self, config: EngineConfig, mesh: Mesh | None, layout: CacheLayout, device=None):
        """One zeroed KV cache per layer, of its group's pages (`meshes.zeros_kv`); for a
        compile-only `device`, their shapes placed there (`meshes.abstract_kv`)."""
        layers, dtype = config.model.num_layers, config.kv_dtype
        if device is None:
            return meshes.zeros_kv(mesh, layers, layout, self.layer_pages, dtype)
        return meshes.abstract_kv(mesh, device, layers, layout, self.layer_pages, dtype)

    @property
    def bytes_per_device(self) -> int:
        return sum(self.layer_pages) * self.layer_bytes

    def max_concurrency(self, config: EngineConfig) -> float:
        """Sequences of max_model_len held at once: by tokens for one full group (as
        vLLM logs it), else the fewest any group holds."""
        if not self.hybrid:
            return (self.group_pages[0] - 1) * config.cache.page_size / config.max_model_len
        return min(
            kvg.sequences_held(g, n, **self._sizes(config))
            for g, n in zip(self.groups, self.group_pages, strict=True)
        )

    def manifest(self) -> list[tuple[int | None, int]]:
        """(window, pages) per group, for a compiled bundle's manifest."""
        return [(g.window, n) for g, n in zip(self.groups, self.group_pages, strict=True)]

    def describe(self, config: EngineConfig) -> str:
        """Each group's capacity, for the start-up log."""
        return kvg.describe(
            self.groups, self.group_pages, layer_bytes=self.layer_bytes, **self._sizes(config)
        )

    @staticmethod
    def _sizes(config: EngineConfig) -> dict[str, int]:
        return dict(
            page_size=config.cache.page_size,
            pages_per_seq=config.pages_per_seq,
            chunk=config.scheduler.max_num_batched_tokens,
        )
