"""Attention backends: which KV write and which ragged attention a model calls.

Every backend has the same two functions with the reference's signatures, so the
engine switches backend by configuration alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from pallas_kernels import ragged_paged_attention as reference
from pallas_kernels.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., jax.Array]
    ragged_paged_attention: Callable[..., jax.Array]

    def __call__(
        self,
        queries: jax.Array,  # [T, N, H]
        keys: jax.Array,  # [T, K, H]
        values: jax.Array,  # [T, K, H]
        kv_cache: jax.Array,  # [P, S, 2K, H]
        md: AttentionMetadata,
        *,
        sm_scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> tuple[jax.Array, jax.Array]:  # [T, N, H], the updated cache
        """Writes this step's K/V into the pages, then attends over them."""
        kv_cache = self.write_kv(kv_cache, keys, values, md.slot_mapping)
        out = self.ragged_paged_attention(
            queries,
            kv_cache,
            md.kv_lens,
            md.page_indices,
            md.cu_q_lens,
            md.num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        return out, kv_cache


BACKENDS = {
    "reference": AttentionBackend(
        "reference", reference.write_kv, reference.ragged_paged_attention
    ),
}


def get_backend(name: str | AttentionBackend) -> AttentionBackend:
    """The backend registered under `name`; a backend object passes through (tests, training)."""
    if isinstance(name, AttentionBackend):
        return name
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"attention_backend must be one of {sorted(BACKENDS)}, got {name!r}"
        ) from None
