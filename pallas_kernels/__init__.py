"""Attention kernels over the paged KV cache, each beside its pure-jnp reference.

`AttentionMetadata` is the one argument that carries a batch's ragged layout to
every attention call; `get_backend(name)` returns the functions a model calls.
"""

from pallas_kernels.backends import BACKENDS, AttentionBackend, get_backend
from pallas_kernels.metadata import AttentionMetadata, GroupedMetadata, layer_metadata

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "GroupedMetadata",
    "get_backend",
    "layer_metadata",
]
