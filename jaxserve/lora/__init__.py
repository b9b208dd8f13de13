"""Multi-LoRA serving, host side: the request type, PEFT adapters read and checked,
and where adapters live (host memory, device slots). No JAX here: the device side
is `models.lora` (the projections) and `jaxserve.runner.lora_io` (slot writes)."""

from jaxserve.lora.manager import AdapterCache, SlotTable
from jaxserve.lora.peft import Adapter, LoRALayout, load_adapter, module_key
from jaxserve.lora.request import LoRARequest


def adapter_salt(cache_salt: str | None, key: str | None):
    """The prefix-cache salt of a request's pages: its cache_salt, and its adapter's
    content key when it has one, so that pages computed under two adapters (or under
    an adapter and none) are never shared. A tuple: no string salt can equal it."""
    return cache_salt if key is None else ("lora", key, cache_salt)


__all__ = [
    "Adapter",
    "AdapterCache",
    "LoRALayout",
    "LoRARequest",
    "SlotTable",
    "adapter_salt",
    "load_adapter",
    "module_key",
]
