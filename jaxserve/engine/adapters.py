"""An engine's LoRA adapters: read and checked when a request (or `add_lora`) names
one, kept in host memory while requests use them, written into device slots as
the scheduler assigns them (`jaxserve.lora.manager` has the policy).

Host logic; the slot writes go through the runner.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig
from jaxserve.generate_request import GenerateRequest
from jaxserve.lora import (
    Adapter,
    AdapterCache,
    LoRARequest,
    SlotTable,
    adapter_salt,
    load_adapter,
)
from jaxserve.sampling_params import ParamError

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def lora_disabled() -> ValueError:
    """What a front says when asked to add or remove an adapter of an engine that serves
    none."""
    return ValueError(
        "this engine serves no LoRA adapters: start it with enable_lora=True (--enable_lora)"
    )


class EngineAdapters:
    """The adapters of an engine whose runner serves LoRA (`config.lora.enable_lora`)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner):
        self.runner = runner
        self.layout = runner.lora.layout()
        model_dir = config.model_dir
        self._read = lambda r: load_adapter(r, self.layout, model_dir)
        self.cache = AdapterCache(config.lora.max_cpu_loras, self._read)
        self.slots = SlotTable(config.lora.max_loras)  # the scheduler's
        # The adapters in host memory, as of the cache's last change (`loaded`).
        self._loaded: tuple[LoRARequest, ...] = ()
        logger.info(
            "LoRA: %d device slots of rank %d over %d projections, %d adapters in host memory",
            config.lora.max_loras,
            config.lora.max_lora_rank,
            len(self.layout.modules),
            config.lora.max_cpu_loras,
        )

    def admit(self, request: GenerateRequest) -> str | None:
        """The adapter key of a request about to be queued (None: no adapter): read and
        checked now, and kept in memory until `release`. Raises ParamError("lora")
        naming what is wrong with the adapter."""
        if request.lora is None:
            return None
        adapter = self._get(request.lora)
        self.cache.acquire(request.lora.lora_int_id)
        return adapter.key

    def release(self, lora: LoRARequest) -> None:
        """A request that `admit` took finished (or was aborted)."""
        self.cache.release(lora.lora_int_id)
        self._changed()

    def salt(self, lora: LoRARequest, cache_salt: str | None):
        """The prefix-cache salt of pages computed under adapter `lora` (ParamError if
        the adapter does not load): what `export_prefix` looks its pages up by."""
        return adapter_salt(cache_salt, self._get(lora).key)

    def write_slots(self, loads: list[tuple[int, str]]) -> None:
        """Writes the adapters a plan assigned into their slots (before its step)."""
        for slot, key in loads:
            self.runner.load_lora(slot, self.cache.by_key(key))

    # ------------------------------------------------------- vLLM's engine API

    def read(self, request: LoRARequest) -> Adapter:
        """Reads and checks an adapter's files (ParamError if it is bad); any thread may
        call it (it reads the layout alone), so that a slow or large read holds no step
        up. `add` keeps what it returns."""
        try:
            return self._read(request)
        except ValueError as e:
            raise ParamError("lora", str(e)) from None

    def add(self, request: LoRARequest, loaded: Adapter | None = None) -> bool:
        """Keeps an adapter in host memory ahead of its requests: `loaded` (what `read`
        returned, off the engine's thread), else read and checked now (ParamError if it
        is bad)."""
        self._get(request, loaded)
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forgets an adapter (and empties its slot); False if it is not known.
        ValueError while live requests use it."""
        adapter = self.cache.remove(lora_int_id)
        if adapter is None:
            return False
        self._changed()
        if all(a.key != adapter.key for a in self.cache.adapters()):  # (no twin under another id)
            self.slots.forget(adapter.key)
        return True

    def list(self) -> set[int]:
        """The ids of the adapters in host memory."""
        return {a.request.lora_int_id for a in self.cache.adapters()}

    def loaded(self) -> tuple[LoRARequest, ...]:
        """The adapters in host memory, least recently used first. Any thread may ask:
        the engine's thread replaces this tuple whenever the cache changes, and never
        changes one it handed out."""
        return self._loaded

    def _get(self, request: LoRARequest, loaded: Adapter | None = None) -> Adapter:
        try:
            adapter = self.cache.get(request, loaded)
        except ValueError as e:
            raise ParamError("lora", str(e)) from None
        finally:
            self._changed()
        return adapter

    def _changed(self) -> None:
        self._loaded = tuple(a.request for a in self.cache.adapters())
