"""Builds, loads and registers the C++ kernels for XLA:CPU (`*.cc` beside this file).

The kernels are compiled on the machine that runs them (`g++ -O3 -march=native`:
the vector width is the CPU's own) against the XLA FFI headers that jaxlib ships,
once per source, jaxlib version and CPU, into a cache directory; later processes
load the built library. Without a C++ compiler (or if the build fails) `load`
says why in the log and returns False: callers then use their XLA formulation,
which computes the same thing more slowly.

The FFI targets are registered with JAX once per process (JAX's registry is
process-wide); `is_loaded()` tells the layers, at trace time, whether to call them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import jax

logger = logging.getLogger(__name__)

SOURCES = ("matmul.cc", "attention.cc", "write_kv.cc")  # one library (with the headers beside them)
TARGETS = {  # FFI target name -> the handler symbol in the library
    "jaxserve_matmul_s8": "JaxserveMatmulS8",
    "jaxserve_matmul_f32": "JaxserveMatmulF32",
    "jaxserve_matmul_bf16": "JaxserveMatmulBf16",
    "jaxserve_attention_f32": "JaxserveAttentionF32",
    "jaxserve_attention_bf16": "JaxserveAttentionBf16",
    "jaxserve_attention_s8": "JaxserveAttentionS8",
    "jaxserve_attention_f8e4m3fn": "JaxserveAttentionF8e4m3fn",
    "jaxserve_attention_f8e5m2": "JaxserveAttentionF8e5m2",
    "jaxserve_write_slots": "JaxserveWriteSlots",
}
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")

_lock = threading.Lock()
_loaded: str | None = None  # the path of the registered library
_failure: str | None = None  # why the build or load failed (not retried)


def is_loaded() -> bool:
    return _loaded is not None


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(cache_dir: str, arch: str = "native") -> str:
    """Where the library for these sources, this jaxlib and this CPU (`-march=arch`) is
    built."""
    h = hashlib.sha256()
    here = os.path.dirname(__file__)
    for name in sorted(os.listdir(here)):
        if name.endswith((".cc", ".h")):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + f.read())
    h.update(" ".join((*FLAGS, arch)).encode())
    h.update(jax.__version__.encode())
    h.update(_cpu_flags().encode())
    return os.path.join(cache_dir, f"jaxserve_cpu_kernels_{h.hexdigest()[:16]}.so")


def build(cache_dir: str, compiler: str = "g++", arch: str = "native") -> str:
    """Compiles the kernels into `cache_dir` unless already built; returns the path.
    `arch` is g++'s -march (native: this CPU's vector width; tests also build the
    AVX2 and the scalar variants). Raises RuntimeError (with the compiler's output)
    if the build fails."""
    path = library_path(cache_dir, arch)
    if os.path.exists(path):
        return path
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
    os.makedirs(cache_dir, exist_ok=True)
    here = os.path.dirname(__file__)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    cmd = [
        compiler,
        *FLAGS,
        f"-march={arch}",
        f"-I{jax.ffi.include_dir()}",
        *(os.path.join(here, name) for name in SOURCES),
        "-o",
        tmp,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the CPU kernels failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, path)  # atomic: a concurrent builder's copy is the same
    return path


def load(cache_dir: str, arch: str = "native") -> bool:
    """Builds (if needed) and registers the kernels; True if they can be called. A
    failure is logged once with its cause, and the process goes on without them."""
    global _loaded, _failure
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded is not None
        try:
            path = build(cache_dir, arch=arch)
            lib = ctypes.cdll.LoadLibrary(path)
            for target, symbol in TARGETS.items():
                capsule = jax.ffi.pycapsule(getattr(lib, symbol))
                jax.ffi.register_ffi_target(target, capsule, platform="cpu")
        except (OSError, RuntimeError, AttributeError) as e:
            _failure = str(e)
            logger.warning("CPU kernels unavailable, using XLA's formulations instead: %s", e)
            return False
        _loaded = path
        logger.info("CPU kernels loaded from %s", path)
        return True
