"""The device side of KV transfer: one gather of pages to the host, one scatter back.

A page leaves as one array "kv" [L, page, 2K, H] (every layer's slice of it; K rows
for a shared latent cache) and, for an int8 / fp8 cache, its "scales" [L, page, 2K]
beside it: the layout
`jaxserve.kv.transfer` encodes. Page counts are padded to a power of
two with the null page (0), so a handful of programs serve every batch: a gather
reads the null page for padding (ignored), a scatter writes padding into it
(the null page holds garbage by design: padding tokens write there anyway).
Pages travel in the logical layout whatever the attention backend stores
(`pallas_kernels.kv_layout`): the gather and scatter convert the few pages that
move, so engines of different backends exchange pages.
Only the target model's pages travel: a draft model recomputes its own K/V of a
cached prefix (see runner/draft.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.kv.transfer import ArraySpec, KVLayout
from jaxserve.runner.bundle import by_shape
from pallas_kernels.kv_layout import CacheLayout
from pallas_kernels.quantization import QuantizedKV, kv_element_dtype

_SAMPLE = 4096  # elements of each weight hashed into the model's fingerprint


def kv_layout(config: EngineConfig, weights: list[jax.Array]) -> KVLayout:
    """The page layout of this engine's KV cache, and the identity of its model.

    The model id hashes the architecture, the dtypes and a strided sample of every
    weight: two checkpoints of one architecture get different ids (their K/V
    differ), a copy of a checkpoint the same one, without hashing gigabytes."""
    m = config.model
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([repr(m), config.dtype, config.kv_dtype]).encode())
    for w in weights:
        flat = np.asarray(w).reshape(-1)
        h.update(str((w.shape, str(w.dtype))).encode())
        h.update(np.ascontiguousarray(flat[:: max(1, flat.size // _SAMPLE)]).tobytes())
    rows = config.cache_layout(m).rows  # 2K (K for a shared latent cache)
    shape = (m.num_layers, config.cache.page_size, rows, m.head_dim)
    arrays = [ArraySpec("kv", str(np.dtype(kv_element_dtype(config.kv_dtype))), shape)]
    if config.cache.quantized:
        arrays.append(ArraySpec("scales", "float32", shape[:3]))
    return KVLayout(model_id=h.hexdigest(), page_size=config.cache.page_size, arrays=tuple(arrays))


def _named(kv: jax.Array | QuantizedKV) -> dict[str, jax.Array]:
    """One layer's cache as the layout's named arrays."""
    return {"kv": kv.pages, "scales": kv.scales} if isinstance(kv, QuantizedKV) else {"kv": kv}


def _padded(pages: list[int]) -> np.ndarray:
    n = 1 << max(0, len(pages) - 1).bit_length()
    return np.asarray(list(pages) + [0] * (n - len(pages)), np.int32)


def _to_logical(layout: CacheLayout, name: str, x: jax.Array) -> jax.Array:
    return layout.pages_to_logical(x) if name == "kv" else layout.scales_to_logical(x)


def _from_logical(layout: CacheLayout, name: str, x: jax.Array) -> jax.Array:
    return layout.pages_from_logical(x) if name == "kv" else layout.scales_from_logical(x)


@functools.partial(jax.jit, static_argnames="layout")
def _gather(kv_caches: list, pages: jax.Array, *, layout: CacheLayout) -> dict[str, jax.Array]:
    layers = [_named(kv) for kv in kv_caches]
    return {  # each [n, L, page, 2K(, H)]
        name: jnp.stack([_to_logical(layout, name, a[name][pages]) for a in layers], axis=1)
        for name in layers[0]
    }


@functools.partial(jax.jit, donate_argnums=0, static_argnames="layout")
def _scatter(
    kv_caches: list, pages: jax.Array, data: dict[str, jax.Array], *, layout: CacheLayout
) -> list:
    out = []
    for i, kv in enumerate(kv_caches):
        new = {
            name: a.at[pages].set(_from_logical(layout, name, data[name][:, i]).astype(a.dtype))
            for name, a in _named(kv).items()
        }
        out.append(QuantizedKV(new["kv"], new["scales"]) if "scales" in new else new["kv"])
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _copy(kv_caches: list, pairs: jax.Array) -> list:
    """Copy-on-write (`kv.page_pool`): page pairs[i, 0] into page pairs[i, 1] [n, 2], in
    every layer's arrays as stored (pages lead every layout's axes, scales' too).
    Padding pairs copy the null page onto itself."""
    src, dst = pairs[:, 0], pairs[:, 1]
    return jax.tree.map(lambda a: a.at[dst].set(a[src]), kv_caches)


def copy_buckets(max_pairs: int) -> tuple[int, ...]:
    """The pair counts the copy program is compiled for: powers of two up to
    `max_pairs` (a step copies at most one page per sequence it schedules)."""
    out = [1]
    while out[-1] < max_pairs:
        out.append(out[-1] * 2)
    return tuple(out)


def copy_pages(kv_caches: list, pairs: np.ndarray, program: Callable, buckets) -> list:
    """Makes the copies `pairs` [n, 2] (src, dst) on the device, in chunks of the largest
    bucket, each padded to a bucket; returns the new caches (donated)."""
    for i in range(0, len(pairs), buckets[-1]):
        chunk = pairs[i : i + buckets[-1]]
        size = next(b for b in buckets if b >= len(chunk))
        padded = np.zeros((size, 2), np.int32)
        padded[: len(chunk)] = chunk
        kv_caches = program(kv_caches, padded)
    return kv_caches


def lower_copies(kv_caches: list, buckets) -> list[tuple[str, jax.stages.Lowered]]:
    """(name, lowered) of the copy program for each bucket, for warm-up."""
    return [
        (f"kv copy n={n}", _copy.lower(kv_caches, jax.ShapeDtypeStruct((n, 2), jnp.int32)))
        for n in buckets
    ]


def loaded_copy(compiled: dict) -> Callable:
    """The bundle's copy programs, picked by the pair count."""
    return by_shape(compiled, "kv copy n=", key_argnums=(1,))


JITTED_COPY = _copy


@dataclasses.dataclass(frozen=True)
class PagePrograms:
    """The gather and scatter: jitted (`JITTED`), or a compiled bundle's (`loaded`)."""

    gather: Callable  # (kv_caches, pages [n]) -> named arrays
    scatter: Callable  # (kv_caches, pages [n], named arrays) -> kv_caches (donated)


def jitted(layout: CacheLayout) -> PagePrograms:
    """The jitted gather and scatter of caches stored in `layout`."""
    return PagePrograms(
        functools.partial(_gather, layout=layout), functools.partial(_scatter, layout=layout)
    )


def loaded(compiled: dict) -> PagePrograms:
    """The bundle's programs, picked by the padded page count."""
    return PagePrograms(
        gather=by_shape(compiled, "kv gather n=", key_argnums=(1,)),
        scatter=by_shape(compiled, "kv scatter n=", key_argnums=(1,)),
    )


def lower_all(kv_caches: list, num_pages: int, layout: CacheLayout) -> list:
    """The gather and scatter programs for every padded page count up to `num_pages`,
    (name, lowered) for warm-up (a serving loop then compiles nothing when pages move)."""
    lowered, n = [], 1
    while True:
        pages = jax.ShapeDtypeStruct((n,), jnp.int32)
        # The logical layout's arrays, as the gather returns them.
        data = jax.eval_shape(functools.partial(_gather, layout=layout), kv_caches, pages)
        lowered += [
            (f"kv gather n={n}", _gather.lower(kv_caches, pages, layout=layout)),
            (f"kv scatter n={n}", _scatter.lower(kv_caches, pages, data, layout=layout)),
        ]
        if n >= num_pages:
            return lowered
        n *= 2


def gather_pages(kv_caches: list, pages: list[int], programs: PagePrograms) -> dict[str, jax.Array]:
    """Starts copying `pages` out (asynchronous: dispatched before the next step, which
    may overwrite them); {"kv": [n', L, page, 2K, H] (, "scales": [n', L, page, 2K])}
    on the device, n' >= n."""
    return programs.gather(kv_caches, _padded(pages))


def scatter_pages(
    kv_caches: list,
    pages: list[int],
    arrays: list[dict[str, np.ndarray]],
    programs: PagePrograms,
) -> list:
    """Writes each page's arrays into `pages`; returns the new caches (donated)."""
    idx = _padded(pages)
    data = {}
    for name, first in arrays[0].items():
        data[name] = np.zeros((len(idx), *first.shape), first.dtype)
        for i, a in enumerate(arrays):
            data[name][i] = a[name]
    return programs.scatter(kv_caches, idx, data)
