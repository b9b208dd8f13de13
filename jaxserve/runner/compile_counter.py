"""Counts the XLA executables a process builds, for the runner's stats and the
tests that assert a serving loop compiles nothing."""

from __future__ import annotations

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts the XLA executables this process builds (compiled, or loaded from the
    persistent compilation cache: `cache_hits` of them), with JAX monitoring listeners.

    The listeners are process-wide (JAX keeps them in global lists, and calls each on
    every compilation) until `close` removes them: the runner that made the counter
    closes it."""

    def __init__(self):
        self.count = 0
        self.cache_hits = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        self._listening = True

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            self.count += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:
            self.cache_hits += 1

    def close(self) -> None:
        """Removes the listeners (idempotent): the counts stop there."""
        if self._listening:
            self._listening = False
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)
