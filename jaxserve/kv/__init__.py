"""Host-side KV page bookkeeping (no JAX imports)."""

from jaxserve.kv.page_pool import PagePool

__all__ = ["PagePool"]
