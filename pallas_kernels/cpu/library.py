"""Builds, loads and registers the C++ kernels for XLA:CPU (`*.cc` beside this file).

The kernels are compiled on the machine that runs them (`g++ -O3 -march=native`:
the vector width is the CPU's own) against the XLA FFI headers that jaxlib ships,
into a per-user cache directory (`cache`: private, checked before every load, built
under a lock). A library is keyed by everything it depends on (`build_key`): the
sources, the flags, jaxlib's version and the FFI API version of its headers, the
compiler's version and the CPU's flags. Later processes load the built library.

Without a C++ compiler (or if the build fails or times out) `load` says why in the
log and returns False: callers then use their XLA formulation, which computes the
same thing more slowly. A cache directory that another user could have written is
refused (the log names it and why) and the kernels are built into a private
temporary directory for this process instead.

The FFI targets are registered with JAX once per process (JAX's registry is
process-wide); `is_loaded()` tells the layers, at trace time, whether to call them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import jax
import jaxlib

from pallas_kernels.cpu import cache, features

logger = logging.getLogger(__name__)

SOURCES = ("matmul.cc", "attention.cc", "write_kv.cc")  # one library (with the headers beside them)
TARGETS = {  # FFI target name -> the handler symbol in the library
    "jaxserve_matmul_s8": "JaxserveMatmulS8",
    "jaxserve_matmul_f32": "JaxserveMatmulF32",
    "jaxserve_matmul_bf16": "JaxserveMatmulBf16",
    "jaxserve_matmul_s4": "JaxserveMatmulS4",
    "jaxserve_matmul_s4_zero": "JaxserveMatmulS4Zero",
    "jaxserve_attention_f32": "JaxserveAttentionF32",
    "jaxserve_attention_bf16": "JaxserveAttentionBf16",
    "jaxserve_attention_s8": "JaxserveAttentionS8",
    "jaxserve_attention_f8e4m3fn": "JaxserveAttentionF8e4m3fn",
    "jaxserve_attention_f8e5m2": "JaxserveAttentionF8e5m2",
    "jaxserve_write_slots": "JaxserveWriteSlots",
}
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
# One build takes 6-7 s on two cores of a loaded EPYC (README, "CPU kernels"): the
# limits only stop a compiler or a lock holder that hangs.
BUILD_TIMEOUT_S = 300.0
LOCK_TIMEOUT_S = 120.0

_lock = threading.Lock()
_loaded: str | None = None  # where the registered library was loaded from
_failure: str | None = None  # why the build or load failed (not retried)


def is_loaded() -> bool:
    """Whether the kernels are registered in this process, so that a program traced
    now may call them. Whether it does is its engine's choice (`native_cpu_kernels`,
    carried by its model: `models.layers.without_cpu_kernels` and the "reference"
    attention backend), never a switch of the process."""
    return _loaded is not None


@functools.cache
def compiler_version(compiler: str) -> str:
    """The first line of `compiler --version`. Raises RuntimeError if there is no
    such compiler."""
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
    proc = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return (proc.stdout.splitlines() or ["?"])[0].strip()


@functools.cache
def ffi_api_version() -> str:
    """XLA_FFI_API_MAJOR.MINOR of jaxlib's FFI headers, which the kernels are compiled
    against ("unknown" if the header does not say; jaxlib's version covers it)."""
    try:
        with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
    except OSError:
        return "unknown"
    found = [re.search(rf"#define XLA_FFI_API_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR")]
    return ".".join(m.group(1) for m in found) if all(found) else "unknown"


def build_key(arch: str = "native", compiler: str = "g++") -> dict[str, str]:
    """Everything a built library depends on (`library_path` hashes it)."""
    h = hashlib.sha256()
    here = os.path.dirname(__file__)
    for name in sorted(os.listdir(here)):
        if name.endswith((".cc", ".h")):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + f.read())
    return {
        "sources": h.hexdigest()[:16],
        "flags": " ".join((*FLAGS, f"-march={arch}")),
        "jaxlib": jaxlib.__version__,
        "xla_ffi_api": ffi_api_version(),
        "compiler": compiler_version(compiler),
        "cpu_flags": " ".join(sorted(features.cpu_flags())),
    }


def library_path(cache_dir: str, arch: str = "native", compiler: str = "g++") -> str:
    """Where the library for this `build_key` is built in `cache_dir`."""
    key = json.dumps(build_key(arch, compiler), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"jaxserve_cpu_kernels_{digest}.so")


def build(
    cache_dir: str,
    compiler: str = "g++",
    arch: str = "native",
    *,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    build_timeout_s: float = BUILD_TIMEOUT_S,
) -> str:
    """Compiles the kernels into `cache_dir` unless already built; returns the path.
    `arch` is g++'s -march (native: this CPU's vector width; tests also build the
    AVX2 and the scalar variants).

    Creates the directory (0700) and refuses one another user could write
    (`cache.UnsafeCacheError`); a library there that fails the same check is
    rebuilt. Raises `cache.LockTimeoutError` if another build holds the lock past
    `lock_timeout_s`, RuntimeError (with the compiler's output) if the build fails
    or runs past `build_timeout_s`."""
    cache.ensure_dir(cache_dir)
    path = library_path(cache_dir, arch, compiler)
    with cache.build_lock(cache_dir, lock_timeout_s):
        swept = cache.sweep_temp(cache_dir)
        if swept:
            logger.info("removed %d unfinished CPU kernel builds in %s", len(swept), cache_dir)
        if os.path.lexists(path):
            try:
                os.close(cache.open_checked(path))
                return path
            except cache.UnsafeCacheError as e:
                logger.warning("refusing the CPU kernel library %s; building it again", e)
        _compile(path, compiler, arch, build_timeout_s)
    return path


def _compile(path: str, compiler: str, arch: str, timeout_s: float) -> None:
    """Runs the compiler into a temporary file beside `path`, then renames it into
    place (atomic: a reader sees the old file or the whole new one)."""
    here = os.path.dirname(__file__)
    tmp = f"{path}.{os.getpid()}{cache.TEMP_SUFFIX}"
    cmd = [
        compiler,
        *FLAGS,
        f"-march={arch}",
        f"-I{jax.ffi.include_dir()}",
        *(os.path.join(here, name) for name in SOURCES),
        "-o",
        tmp,
    ]
    logger.info(
        "building the CPU kernels with %s (-march=%s; once per machine, 10-30 s)", compiler, arch
    )
    t0 = time.perf_counter()
    try:
        returncode, stderr = _run(cmd, timeout_s)
        if returncode != 0:
            raise RuntimeError(f"building the CPU kernels failed: {' '.join(cmd)}\n{stderr}")
        os.chmod(tmp, 0o755)  # (whatever the umask: never group- or other-writable)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    seconds = time.perf_counter() - t0
    logger.info("built the CPU kernels (-march=%s) in %.1f s: %s", arch, seconds, path)


def _run(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """Runs the compiler in its own process group; (exit status, stderr). Past the
    timeout the whole group is killed (g++'s cc1plus and ld too, which would keep
    the pipes open) and RuntimeError is raised."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(
            f"building the CPU kernels took over {timeout_s:g} s, stopped: {' '.join(cmd)}"
        ) from None
    return proc.returncode, stderr


def dlopen_checked(path: str) -> ctypes.CDLL:
    """Loads the library at `path` after checking it, through the checked descriptor."""
    fd = cache.open_checked(path)
    try:
        return ctypes.CDLL(cache.fd_path(fd, path))
    finally:
        os.close(fd)


def open_library(
    cache_dir: str | None, arch: str = "native", **build_args
) -> tuple[ctypes.CDLL, str]:
    """Builds (if needed) and loads the library; returns it and where it came from.
    `cache_dir` None, or one refused (another user's, not private, locked too long,
    not creatable), builds into a private temporary directory for this process
    instead (removed once loaded: the loaded mapping stays)."""
    if cache_dir is not None:
        try:
            path = build(cache_dir, arch=arch, **build_args)
            return dlopen_checked(path), path
        except (cache.UnsafeCacheError, cache.LockTimeoutError, OSError) as e:
            logger.warning(
                "not using the CPU kernel cache %s (%s): building the kernels into a "
                "private directory for this process",
                cache_dir,
                e,
            )
    with tempfile.TemporaryDirectory(prefix="jaxserve-kernels-") as private:
        path = build(private, arch=arch, **build_args)
        return dlopen_checked(path), f"{path} (private to this process)"


def load(cache_dir: str | None, arch: str = "native", **build_args) -> bool:
    """Builds (if needed) and registers the kernels (`open_library`); True if they can
    be called. A failure is logged once with its cause, and the process goes on
    without them."""
    global _loaded, _failure
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded is not None
        try:
            lib, where = open_library(cache_dir, arch, **build_args)
            _register(lib)
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
            _failure = str(e)
            logger.warning("CPU kernels unavailable, using XLA's formulations instead: %s", e)
            return False
        _loaded = where
        logger.info("CPU kernels loaded from %s", where)
        return True


def _register(lib: ctypes.CDLL) -> None:
    for target, symbol in TARGETS.items():
        capsule = jax.ffi.pycapsule(getattr(lib, symbol))
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")


def prepare(*, enabled: bool, cache_dir: str | None) -> bool:
    """An engine on the CPU starts: loads the kernels if it uses them (`enabled`, its
    config's `native_cpu_kernels`); True if it does. An engine without them changes
    nothing for another that has them: its model says so (the registration, which
    JAX keeps per process, stays)."""
    if not enabled:
        logger.info("CPU kernels off (native_cpu_kernels=False): XLA's formulations")
        return False
    return load(cache_dir)
