"""Compiling for a target that is not here, remembered across processes.

JAX's persistent compilation cache keeps executables for the devices a process has;
a compile-only device (`jaxserve.targets`) cannot load one back ("PjRtCompiler must
be constructed with a Client to call DeserializeLoadedExecutable"), so JAX's cache
only warns and compiles again. Such a program is compiled to be analysed and
serialized, never run, so what a compile gives can be kept instead: XLA's cost and
memory analyses, the optimized module's text and the serialized executable. This
module keeps that record beside JAX's cache, in `<jax_compilation_cache_dir>/compile-only`,
whenever that cache is on (the command line, `LLM(compilation_cache_dir=...)`, the
test suite), and answers a later compile of the same program from it.

The same program means the same key as a compile's inputs: the lowered module's
text (which holds every Pallas kernel's Mosaic or Triton source in its custom
call), the devices it is compiled for and their platform's compiler version, jax's
and jaxlib's versions, and the XLA flags of the environment. Any change there is a
miss and a real compile. A compile that fails is never recorded: it fails again,
for real.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import zlib
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxserve.compile_cache import FileCache

SUBDIR = "compile-only"
MAX_BYTES = 2 << 30  # the records' bound; the least recently used go first
_FORMAT = 1


class CompiledRecord:
    """What a compile-only program's compile gave, read back: the parts of
    `jax.stages.Compiled` that a program that never runs is used for."""

    def __init__(self, record: dict[str, Any]):
        self._record = record

    def cost_analysis(self):
        return self._record["cost"]

    def memory_analysis(self):
        return SimpleNamespace(**self._record["memory"])

    def as_text(self) -> str:
        return self._record["text"]

    def module_cost(self) -> dict[str, float]:
        return self._record["module_cost"]

    def serialized(self) -> tuple:
        """`serialize_executable.serialize`'s (executable, in_tree, out_tree)."""
        return pickle.loads(self._record["payload"])


def compile_for(lowered: jax.stages.Lowered, devices: Sequence) -> Any:
    """`lowered.compile()` for compile-only `devices`, answered from a record when
    JAX's persistent cache is on and the same program was compiled before (by any
    process); a miss compiles and records it."""
    directory = _directory()
    if directory is None:
        return lowered.compile()
    key, records = _key(lowered, devices), FileCache(directory, MAX_BYTES)
    data = records.get(key)
    if data is not None:
        with contextlib.suppress(EOFError, pickle.UnpicklingError, zlib.error):
            record = pickle.loads(zlib.decompress(data))
            if record.get("format") == _FORMAT:
                return CompiledRecord(record)
    with _no_jax_cache_write():
        compiled = lowered.compile()
    records.put(key, zlib.compress(pickle.dumps(_record_of(compiled)), 1))
    return compiled


def module_cost(compiled) -> dict[str, float] | list | None:
    """XLA's cost analysis of `compiled`; where the executable offers none (XLA:GPU
    for a compile-only device), the same analysis over its optimized module with the
    host's XLA."""
    if isinstance(compiled, CompiledRecord):
        return compiled.module_cost()
    analysis = compiled.cost_analysis()
    if not analysis:
        from jax._src import xla_bridge
        from jax._src.lib import xla_client

        module = compiled.runtime_executable().hlo_modules()[0]
        analysis = xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
    return analysis


def serialized(compiled) -> tuple:
    """(executable, in_tree, out_tree) of a compiled program or of its record."""
    if isinstance(compiled, CompiledRecord):
        return compiled.serialized()
    return serialize_executable.serialize(compiled)


def _directory() -> str | None:
    root = jax.config.jax_compilation_cache_dir
    if not root or not jax.config.jax_enable_compilation_cache:
        return None
    directory = os.path.join(os.path.expanduser(root), SUBDIR)
    os.makedirs(directory, exist_ok=True)
    return directory


def _key(lowered: jax.stages.Lowered, devices: Sequence) -> str:
    h = hashlib.sha256()
    for part in (
        f"format {_FORMAT} jax {jax.__version__} jaxlib {jaxlib.__version__}",
        # The compilers read these (XLA's flags, libtpu's) from the environment.
        *(f"{k}={os.environ.get(k, '')}" for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")),
        *(f"{d.platform} {d.device_kind} {d.id} {d.client.platform_version}" for d in devices),
        lowered.as_text(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _record_of(compiled: jax.stages.Compiled) -> dict[str, Any]:
    memory = compiled.memory_analysis()
    return {
        "format": _FORMAT,
        "cost": compiled.cost_analysis(),
        "module_cost": module_cost(compiled),
        "memory": {
            name: getattr(memory, name)
            for name in dir(memory)
            if not name.startswith("_") and isinstance(getattr(memory, name), int | float)
        },
        "text": compiled.as_text(),
        "payload": pickle.dumps(serialize_executable.serialize(compiled)),
    }


def _no_jax_cache_write():
    """JAX's own cache would store the compile-only executable too, which no process
    can load back: a write of megabytes for nothing. (The setting's context manager
    is thread-local: warm-up compiles in threads.)"""
    from jax._src import config

    return config.persistent_cache_min_compile_time_secs(float("inf"))
