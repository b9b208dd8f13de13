"""Traces of the engine's device work with JAX's profiler (`start_profile`,
`stop_profile`: vLLM's and SGLang's), read with XProf or TensorBoard's profile plugin
(`xprof --logdir OUTPUT_DIR`).

JAX's profiler is one per process, so this module keeps which directory it writes
to: replicas in one process (local data parallelism) share one trace, the first to
start it starts it and the first to stop it stops it. Each process writes under its
own subdirectory of `output_dir`, `<host>-<pid>` (JAX names its files by host), so
that Ray replicas on one machine do not write over each other's.
"""

from __future__ import annotations

import os
import socket
import threading

import jax

from jaxserve.front import EngineStateError
from jaxserve.sampling_params import ParamError

_lock = threading.Lock()
_tracing: list[str] = []  # the directory of this process's trace, while one runs


def start(output_dir: str) -> list[str]:
    """Starts tracing this process into a subdirectory of `output_dir` (made if need
    be); returns it, in a list (a data-parallel front's lists every process's). A
    trace into it already running goes on; one into another directory is an
    EngineStateError. ParamError naming `output_dir` if it cannot be made."""
    where = os.path.join(os.fspath(output_dir), f"{socket.gethostname()}-{os.getpid()}")
    with _lock:
        if _tracing:
            if _tracing[0] == where:
                return [where]
            raise EngineStateError(
                f"a profile is being written to {_tracing[0]!r}: stop_profile first"
            )
        try:
            os.makedirs(where, exist_ok=True)
        except OSError as e:
            raise ParamError("output_dir", f"output_dir {output_dir!r}: {e}") from None
        try:
            jax.profiler.start_trace(where)
        except RuntimeError as e:  # a trace this module did not start (the program's)
            raise EngineStateError(f"JAX's profiler is busy: {e}") from None
        _tracing.append(where)
    return [where]


def stop() -> list[str]:
    """Stops this process's trace and writes it; returns its directory, in a list
    (empty: no trace ran)."""
    with _lock:
        if not _tracing:
            return []
        jax.profiler.stop_trace()
        return [_tracing.pop()]
