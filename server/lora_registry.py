"""The LoRA adapters a server serves, by the names its clients use: one registry for
HTTP and gRPC (`ServingState.loras`), as vLLM's `OpenAIServingModels` keeps them.

A request names an adapter as its model (HTTP `model`, gRPC `lora_name`); the registry
turns the name into the `LoRARequest` the engine knows it by. Adapters come from
`--lora_modules name=path` at start-up (each read and checked then: one that does not
load stops the server before it serves), and at run time from `load` and `unload`
(`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`; the gRPC `LoadLoRAAdapter`,
`UnloadLoRAAdapter`). Each adapter gets the next `lora_int_id` (1, 2, ... in the order
given at start-up), never used again, so an id names one directory for the server's
life. The engine's host memory is only a cache of these: an adapter it dropped
(`max_cpu_loras`) is read again from its path when a request names it.

Host logic: no JAX; the front (`jaxserve.front.EngineFront`) reads the files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence

from jaxserve.front import EngineFront
from jaxserve.lora import LoRARequest
from jaxserve.sampling_params import ParamError

logger = logging.getLogger(__name__)

FLAG = "--lora_modules"


class UnknownModelError(LookupError):
    """A request names a model that is neither the served one nor a loaded adapter
    (vLLM's 404: "The model `X` does not exist.")."""


class LoRAModuleError(ValueError):
    """An adapter of `--lora_modules` the server refuses at start-up; the message names
    the flag and the entry."""


@dataclasses.dataclass(frozen=True)
class LoRAModule:
    """An adapter to serve from start-up (vLLM's `LoRAModulePath`): `name` is the model
    name requests give, `path` its PEFT directory; `base_model_name`, if given, must
    be the served model's name."""

    name: str
    path: str
    base_model_name: str | None = None

    def __str__(self) -> str:
        return f"{FLAG} {self.name}={self.path}"


def parse_lora_modules(entries: Sequence[str]) -> list[LoRAModule]:
    """The adapters of `--lora_modules` entries, as vLLM takes them: `name=path`, or a
    JSON object `{"name": ..., "path": ..., "base_model_name": ...}`. Raises
    LoRAModuleError naming a malformed entry."""
    modules = []
    for entry in entries:
        if entry.lstrip().startswith("{"):
            modules.append(_json_module(entry))
            continue
        name, eq, path = entry.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise LoRAModuleError(
                f"{FLAG} {entry!r}: expected name=path (or a JSON object with name and path)"
            )
        modules.append(LoRAModule(name.strip(), path.strip()))
    return modules


def _json_module(entry: str) -> LoRAModule:
    try:
        module = json.loads(entry)
    except ValueError as e:
        raise LoRAModuleError(f"{FLAG} {entry!r}: not JSON: {e}") from None
    if not isinstance(module, dict) or not all(
        isinstance(module.get(k), str) and module[k] for k in ("name", "path")
    ):
        raise LoRAModuleError(f"{FLAG} {entry!r}: a JSON entry needs a name and a path (strings)")
    unknown = sorted(set(module) - {"name", "path", "base_model_name"})
    if unknown:
        raise LoRAModuleError(
            f"{FLAG} {entry!r}: unknown keys {unknown}; known: name, path, base_model_name"
        )
    return LoRAModule(module["name"], module["path"], module.get("base_model_name"))


class LoRARegistry:
    """Name -> `LoRARequest` of the adapters a server serves over the model `model_name`
    (the served name: no adapter may take it)."""

    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self._by_name: dict[str, LoRARequest] = {}
        self._loading: set[str] = set()  # names whose load is under way
        self._next_id = 1

    def named(self, name: str) -> LoRARequest:
        """The loaded adapter `name`; raises UnknownModelError."""
        lora = self._by_name.get(name)
        if lora is None:
            raise UnknownModelError(f"The model `{name}` does not exist.")
        return lora

    def adapters(self) -> list[LoRARequest]:
        """The adapters loaded, in the order they were."""
        return list(self._by_name.values())

    def check_modules(self, modules: Sequence[LoRAModule]) -> None:
        """Refuses, before anything loads, `--lora_modules` entries that could never be
        served: a name given twice, the served model's name, a base_model_name other
        than it. Raises LoRAModuleError naming the entry."""
        seen: set[str] = set()
        for m in modules:
            if m.name in seen:
                raise LoRAModuleError(f"{m}: the name {m.name!r} is given twice")
            if m.name == self.model_name:
                raise LoRAModuleError(
                    f"{m}: {m.name!r} is the served model's name (--served_model_name); "
                    "give the adapter another"
                )
            if m.base_model_name is not None and m.base_model_name != self.model_name:
                raise LoRAModuleError(
                    f"{m}: base_model_name {m.base_model_name!r} is not the served model "
                    f"{self.model_name!r}"
                )
            seen.add(m.name)

    async def load_modules(self, front: EngineFront, modules: Sequence[LoRAModule]) -> None:
        """Loads the `--lora_modules` adapters, ids 1, 2, ... in order; raises
        LoRAModuleError naming the first that does not load (and why)."""
        self.check_modules(modules)
        for m in modules:
            try:
                await self.load(front, m.name, m.path)
            except ValueError as e:
                raise LoRAModuleError(f"{m}: {e}") from None

    async def load(
        self, front: EngineFront, name: str, path: str, resolve: Callable[[str], str] = str
    ) -> LoRARequest:
        """Reads and checks the adapter at `path` on the engine (every replica) and serves
        it as `name`. Raises ParamError naming `lora_name` (missing, the served model's,
        already loaded) or `lora_path` (missing, refused by `resolve`, which gives the
        path to read; the engine's reason it does not load), or the front's ValueError
        (an engine without enable_lora); nothing changes."""
        if not name or not path:
            field = "lora_name" if not name else "lora_path"
            raise ParamError(field, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self._by_name or name in self._loading:
            raise ParamError("lora_name", f"The lora adapter '{name}' has already been loaded.")
        if name == self.model_name:
            raise ParamError(
                "lora_name", f"lora_name {name!r} is the served model's name: choose another"
            )
        path = resolve(path)
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1  # (never again, even if this load fails)
        self._loading.add(name)
        try:
            await front.control("add_lora", request=lora)
        except ParamError as e:  # the adapter: its files, its shapes, its config
            notes = getattr(e, "__notes__", [])  # (which data-parallel replica)
            raise ParamError("lora_path", " ".join([str(e), *notes])) from None
        finally:
            self._loading.discard(name)
        self._by_name[name] = lora
        logger.info("loaded LoRA adapter %r (id %d) from %s", name, lora.lora_int_id, path)
        return lora

    async def unload(self, front: EngineFront, name: str) -> LoRARequest:
        """Stops serving adapter `name` and forgets it on the engine. Raises ParamError
        naming `lora_name` if no adapter has that name, or while requests use it (the
        adapter stays served then). A request that took the adapter just before still
        runs with it (the engine reads it again)."""
        if not name:
            raise ParamError("lora_name", "'lora_name' must be provided.")
        lora = self._by_name.pop(name, None)  # no request finds it from now on
        if lora is None:
            raise ParamError("lora_name", f"The lora adapter '{name}' cannot be found.")
        try:
            await front.control("remove_lora", lora_int_id=lora.lora_int_id)
        except BaseException as e:
            self._by_name.setdefault(name, lora)  # (unless a load took the name meanwhile)
            if isinstance(e, ValueError):
                message = f"The lora adapter '{name}' cannot be unloaded now: {e}"
                raise ParamError("lora_name", message) from None
            raise
        logger.info("unloaded LoRA adapter %r (id %d)", name, lora.lora_int_id)
        return lora
