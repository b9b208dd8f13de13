"""The native CPU kernels' build cache: nothing is loaded from where another local
user could have written, builds are locked and bounded in time, the key names
everything a build depends on, other architectures build the portable code, and the
kernels can be turned off.

Most tests replace the compiler by a copy of one real build (`real_build`), so that
they check the cache's logic in milliseconds; `jaxserve kernels build` and the
cross-architecture builds run the real compiler.
"""

import ctypes
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import time

import jax
import pytest
from test_cpu_attention import float_case

from pallas_kernels import backends
from pallas_kernels.cpu import cache, features, library

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "pallas_kernels", "cpu")
OTHER_UID = 4321  # a user that is not this one (root can chown to it)


@pytest.fixture(scope="module")
def real_build(tmp_path_factory) -> str:
    """One real build of the kernels (g++ -march=native)."""
    try:
        return library.build(str(tmp_path_factory.mktemp("real")))
    except RuntimeError as e:
        pytest.fail(f"the CPU kernels did not build (g++ and the jaxlib headers are needed): {e}")


@pytest.fixture
def compiles(monkeypatch, real_build) -> list[str]:
    """The compiler, replaced: each build copies the real one into place the way
    `_compile` does (a temporary file renamed); returns the paths built."""
    built = []

    def compile_(path, compiler, arch, timeout_s):
        tmp = f"{path}.{os.getpid()}{cache.TEMP_SUFFIX}"
        shutil.copyfile(real_build, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
        built.append(path)

    monkeypatch.setattr(library, "_compile", compile_)
    return built


def _private_dir(tmp_path, name="kernels") -> str:
    path = str(tmp_path / name)
    cache.ensure_dir(path)
    return path


def _plant(path: str, marker: str) -> None:
    """Another user's library at `path`: loading it would create `marker`."""
    src = os.path.join(os.path.dirname(path), "evil.cc")
    with open(src, "w") as f:
        f.write(
            "#include <cstdio>\n"
            f'__attribute__((constructor)) static void Run() {{ std::fopen("{marker}", "w"); }}\n'
        )
    subprocess.run(["g++", "-shared", "-fPIC", src, "-o", path], check=True, timeout=120)
    os.unlink(src)


# ------------------------------------------------------------ the directory


def test_a_world_writable_directory_is_refused_and_the_build_goes_private(
    tmp_path, compiles, caplog
):
    """What another local user sees when the first made the directory 0777 (or
    when they made it themselves, 0777, to plant a library in it)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(cache.UnsafeCacheError, match=r"shared: mode 0777 \(needs 0700\)"):
        library.build(str(shared))
    with caplog.at_level(logging.WARNING):
        lib, where = library.open_library(str(shared))
    assert hasattr(lib, "JaxserveMatmulS8") and "private to this process" in where
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert str(shared) in warned and "mode 0777" in warned
    assert os.listdir(shared) == []  # nothing built or locked there
    assert not os.path.exists(compiles[0])  # the private directory is gone once loaded


def test_a_group_readable_directory_is_refused_too(tmp_path):
    d = tmp_path / "group"
    d.mkdir()
    os.chmod(d, 0o750)
    with pytest.raises(cache.UnsafeCacheError, match="mode 0750"):
        cache.check_dir(str(d))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another uid")
def test_a_directory_of_another_uid_is_refused(tmp_path, compiles):
    """A second local user made the directory first (a real chown)."""
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(cache.UnsafeCacheError, match=f"owned by uid {OTHER_UID}"):
        library.build(str(d))
    assert "private to this process" in library.open_library(str(d))[1]
    assert os.listdir(d) == []


def test_a_directory_of_another_uid_is_refused_through_the_owner_seam(
    tmp_path, monkeypatch, compiles
):
    """The same as any user: this process's own directory, seen as another uid's."""
    d = _private_dir(tmp_path)
    monkeypatch.setattr(cache, "_euid", lambda: os.geteuid() + 1)
    with pytest.raises(cache.UnsafeCacheError, match=f"owned by uid {os.geteuid()}, not"):
        library.build(d)


def test_a_private_directory_under_a_group_writable_one_is_refused(tmp_path):
    """Another member of the group could rename the checked directory away and put
    their own in its place before the library is loaded from it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    with pytest.raises(cache.UnsafeCacheError, match=r"ancestor .*shared \(mode 0775\)"):
        cache.ensure_dir(str(shared / "kernels"))
    os.chmod(shared, 0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    cache.ensure_dir(str(shared / "kernels2"))


def test_a_symlinked_directory_is_refused(tmp_path):
    real = _private_dir(tmp_path, "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(cache.UnsafeCacheError, match="not a directory"):
        cache.ensure_dir(str(link))


def test_the_directory_is_made_private(tmp_path, compiles):
    d = tmp_path / "new" / "kernels"
    path = library.build(str(d))
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.stat(d.parent).st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o022 == 0
    assert os.path.dirname(path) == str(d)


# ------------------------------------------------------------ the library


@pytest.mark.parametrize("how", ["mode", "owner", "symlink"])
def test_a_planted_library_is_never_loaded(tmp_path, compiles, caplog, how):
    """A library at the predictable name that another user could have written (group-
    and world-writable), that another uid owns, or a link to one elsewhere, is rebuilt
    before anything loads; its code never runs."""
    if how == "owner" and os.geteuid() != 0:
        pytest.skip("only root can give a file to another uid")
    d = _private_dir(tmp_path)
    path = library.library_path(d)
    marker = str(tmp_path / "their-code-ran")
    if how == "symlink":
        _plant(str(tmp_path / "theirs.so"), marker)
        os.symlink(tmp_path / "theirs.so", path)
    else:
        _plant(path, marker)
    if how == "mode":
        os.chmod(path, 0o666)
    elif how == "owner":
        os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(cache.UnsafeCacheError):
        os.close(cache.open_checked(path))
    with caplog.at_level(logging.WARNING):
        lib, where = library.open_library(d)
    assert not os.path.exists(marker)
    assert where == path and compiles == [path] and hasattr(lib, "JaxserveMatmulS8")
    st = os.stat(path)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o022 == 0
    assert any("refusing the CPU kernel library" in r.getMessage() for r in caplog.records)


def test_a_trusted_library_is_loaded_without_building(tmp_path, compiles):
    d = _private_dir(tmp_path)
    first = library.build(d)
    assert library.open_library(d)[1] == first
    assert compiles == [first]  # built once, loaded twice


def test_a_library_swapped_in_after_the_check_is_not_the_one_loaded(
    tmp_path, real_build, monkeypatch
):
    """Between the check and the load, the name is given to another library: what is
    loaded is still the checked file (loading by the name would run the other)."""
    path = str(tmp_path / "checked.so")
    shutil.copyfile(real_build, path)
    marker, evil = str(tmp_path / "their-code-ran"), str(tmp_path / "evil.so")
    _plant(evil, marker)
    open_checked = cache.open_checked

    def check_then_swap(p):
        fd = open_checked(p)
        os.replace(evil, p)  # (the open descriptor keeps the checked file)
        return fd

    monkeypatch.setattr(cache, "open_checked", check_then_swap)
    lib = library.dlopen_checked(path)
    assert not os.path.exists(marker) and hasattr(lib, "JaxserveMatmulS8")


def test_loads_the_checked_file_itself(tmp_path, real_build):
    """The library is loaded through the descriptor that was checked (Linux), so it
    cannot be swapped between the check and the load."""
    fd = cache.open_checked(real_build)
    try:
        name = cache.fd_path(fd, real_build)
        assert name == f"/proc/self/fd/{fd}" and os.path.samefile(name, real_build)
        assert hasattr(ctypes.CDLL(name), "JaxserveWriteSlots")
    finally:
        os.close(fd)


# ------------------------------------------------------------ lock, timeouts, leftovers


def test_a_held_lock_times_out(tmp_path, compiles, caplog):
    d = _private_dir(tmp_path)
    holder = os.open(os.path.join(d, cache.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another build, stuck
    try:
        t0 = time.monotonic()
        with pytest.raises(cache.LockTimeoutError, match="held the build lock for 0.3 s"):
            library.build(d, lock_timeout_s=0.3)
        assert time.monotonic() - t0 < 5
        with caplog.at_level(logging.WARNING):  # the engine builds its own copy meanwhile
            assert "private" in library.open_library(d, lock_timeout_s=0.3)[1]
        assert compiles and not compiles[-1].startswith(d)
    finally:
        os.close(holder)
    assert library.build(d, lock_timeout_s=0.3).startswith(d)  # released: builds there


def test_a_hung_compiler_is_stopped(tmp_path):
    """Past the timeout the compiler and its children are killed; nothing is left."""
    compiler = tmp_path / "slow-g++"
    compiler.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo "slow-g++ 1.0"; exit 0; fi\nsleep 60\n'
    )
    compiler.chmod(0o755)
    d = _private_dir(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="took over 1 s, stopped"):
        library.build(d, str(compiler), build_timeout_s=1)
    assert time.monotonic() - t0 < 30  # (the child sleep would hold the pipes 60 s)
    assert sorted(os.listdir(d)) == [cache.LOCK_NAME]


def test_a_crashed_build_leaves_nothing_and_is_swept(tmp_path, compiles):
    d = _private_dir(tmp_path)
    stale = os.path.join(d, f"jaxserve_cpu_kernels_0123.so.999{cache.TEMP_SUFFIX}")
    with open(stale, "wb") as f:
        f.write(b"half a library")
    path = library.build(d)
    assert sorted(os.listdir(d)) == sorted([cache.LOCK_NAME, os.path.basename(path)])


def test_a_failed_compile_leaves_no_file(tmp_path, caplog):
    compiler = tmp_path / "bad-g++"
    compiler.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo bad 1 && exit 0\necho no >&2\nexit 1\n'
    )
    compiler.chmod(0o755)
    d = _private_dir(tmp_path)
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(RuntimeError, match="building the CPU kernels failed"),
    ):
        library.build(d, str(compiler))
    assert os.listdir(d) == [cache.LOCK_NAME]
    # The build says so before it starts (a first run was silent for 10-15 s: issue 42).
    assert any(r.getMessage().startswith("building the CPU kernels") for r in caplog.records)


# ------------------------------------------------------------ the key


def test_the_key_names_jaxlib_the_ffi_api_and_the_compiler(tmp_path, monkeypatch):
    import jaxlib

    key = library.build_key()
    assert key["jaxlib"] == jaxlib.__version__
    assert key["xla_ffi_api"].count(".") == 1  # the headers' XLA_FFI_API_MAJOR.MINOR
    assert key["compiler"].startswith("g++") and key["flags"].endswith("-march=native")
    d = str(tmp_path)
    base = library.library_path(d)
    monkeypatch.setattr(jaxlib, "__version__", "0.0.1")
    assert library.library_path(d) != base
    monkeypatch.undo()
    monkeypatch.setattr(library, "compiler_version", lambda compiler: "g++ 99.0")
    assert library.library_path(d) != base
    monkeypatch.setattr(library, "ffi_api_version", lambda: "9.9")
    assert library.library_path(d) != library.library_path(d, arch="x86-64")


def test_default_directory(tmp_path):
    assert cache.default_dir({"XDG_CACHE_HOME": "/x/c", "HOME": "/h"}) == "/x/c/jaxserve/kernels"
    assert cache.default_dir({"HOME": "/h"}) == "/h/.cache/jaxserve/kernels"
    # A relative XDG_CACHE_HOME is ignored (the base-directory specification).
    assert cache.default_dir({"XDG_CACHE_HOME": "c", "HOME": "/h"}) == "/h/.cache/jaxserve/kernels"


def test_cpu_flags_of_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nflags\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert features.cpu_flags(str(x86)) == {"fpu", "avx2", "avx512_bf16"}
    assert features.cpu_flags(str(arm)) == {"fp", "asimd", "bf16"}
    assert features.cpu_flags(str(tmp_path / "none")) == frozenset()


# ------------------------------------------------------------ other architectures


def test_without_x86_the_portable_code_builds(tmp_path):
    """simd.h and the kernels compile without any x86 intrinsic: a poisoned
    <immintrin.h> first on the include path, and JAXSERVE_PORTABLE (what a non-x86
    target gets) with this CPU's -march, whose __AVX512F__ etc. stay defined."""
    (tmp_path / "immintrin.h").write_text('#error "x86 intrinsics on a non-x86 target"\n')
    sources = [os.path.join(HERE, name) for name in library.SOURCES]
    cmd = ["g++", "-fsyntax-only", "-std=c++17", "-march=native", "-DJAXSERVE_PORTABLE", "-w"]
    cmd += [f"-I{tmp_path}", f"-I{jax.ffi.include_dir()}", *sources]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(not shutil.which("aarch64-linux-gnu-g++"), reason="no aarch64 cross g++")
def test_builds_for_aarch64(tmp_path):
    """A real aarch64 build (a cross compiler): an Arm library with every handler."""
    out = tmp_path / "kernels.so"
    sources = [os.path.join(HERE, name) for name in library.SOURCES]
    cmd = ["aarch64-linux-gnu-g++", *library.FLAGS, "-O1", "-w", f"-I{jax.ffi.include_dir()}"]
    proc = subprocess.run([*cmd, *sources, "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:4] == b"\x7fELF" and int.from_bytes(data[18:20], "little") == 183  # EM_AARCH64
    assert all(symbol.encode() in data for symbol in library.TARGETS.values())


# ------------------------------------------------------------ the switch


def test_an_engine_without_the_kernels_loads_nothing_and_switches_nothing_off(
    tmp_path, monkeypatch
):
    """`prepare(enabled=False)` neither builds nor unloads: whether a program calls
    the kernels is its engine's (test_cpu_bfloat16.py: two engines in a process)."""
    assert library.load(str(tmp_path / "kernels"))
    args, _ = float_case("mixed")
    backend = backends.BACKENDS["cpu"]
    attention = jax.jit(lambda *a: backend.ragged_paged_attention(*a, sm_scale=0.25))
    monkeypatch.setattr(library, "load", lambda *a, **k: pytest.fail("loaded while off"))
    assert library.prepare(enabled=False, cache_dir=str(tmp_path)) is False
    assert library.is_loaded()
    assert "jaxserve_attention_f32" in attention.lower(*args).as_text()


def test_the_switch_in_the_config_and_on_the_command_line():
    from absl import flags

    from jaxserve.config import EngineConfig, ModelConfig
    from server.cli import engine_flags

    model = ModelConfig.from_hf(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    )
    with pytest.raises(ValueError, match="native_kernels_dir must be a directory or None, got ''"):
        EngineConfig("m", model, native_kernels_dir="")
    with pytest.raises(ValueError, match="native_cpu_kernels must be a bool, got 'no'"):
        EngineConfig("m", model, native_cpu_kernels="no")
    flags.FLAGS(["jaxserve", "--nonative_cpu_kernels"])
    try:
        kw = engine_flags.engine_kwargs()
    finally:
        flags.FLAGS.unparse_flags()
    assert kw["native_cpu_kernels"] is False
    assert kw["native_kernels_dir"] == cache.default_dir(os.environ)


# ------------------------------------------------------------ jaxserve kernels build


def _kernels_build(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "server.cli.main", "kernels", "build", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_jaxserve_kernels_build(tmp_path):
    """Builds into the per-user cache ($XDG_CACHE_HOME), says what and where; a
    second run finds it; a directory others can write is refused."""
    proc = _kernels_build(env={"XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"built {tmp_path}/jaxserve/kernels/jaxserve_cpu_kernels_")
    path = first.split()[1]
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    for field in ("jaxlib", "xla_ffi_api", "compiler", "-march=native", "jaxserve_matmul_s8"):
        assert field in proc.stdout
    proc = _kernels_build(f"--native_kernels_dir={tmp_path}/jaxserve/kernels")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"already built: {path}\n")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    proc = _kernels_build(f"--native_kernels_dir={shared}")
    assert proc.returncode != 0 and f"{shared}: mode 0777" in proc.stderr
    assert os.listdir(shared) == []


def test_jaxserve_kernels_needs_build():
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "kernels", "clean"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode != 0 and "usage: jaxserve kernels build" in proc.stderr
