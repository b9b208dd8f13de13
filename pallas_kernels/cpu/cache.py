"""The per-user directory the native CPU kernels are built into, and its safety.

Loading a shared library runs its code, so nothing is loaded from where another
local user could have written. The directory must be this user's and private
(0700), the library this user's regular file that no one else may write; both are
checked before every load (the library on the descriptor that is then loaded, so
it cannot be swapped between the check and the load). A directory that fails is
refused with `UnsafeCacheError`, naming it and why; the caller builds elsewhere.

Compiled bundles (`jaxserve.runner.bundle`: pickles and native programs) are code
too, and pass the same checks with `private=False`: the directory need not be
private, only unwritable by others, and root's files are trusted as well (a bundle
shipped in an image).

Builds take an exclusive lock on the directory (`fcntl.flock`, waited for at most a
timeout), write under a temporary name and `os.replace` it into place, so a
crashed build leaves no half-written library; the next build sweeps its leftovers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import time
from collections.abc import Iterator, Mapping

LOCK_NAME = ".lock"
TEMP_SUFFIX = ".tmp"  # a build's output until it is renamed into place


class UnsafeCacheError(RuntimeError):
    """The directory or a library in it could have been written by another user."""


class LockTimeoutError(RuntimeError):
    """Another process held the build lock past the timeout."""


def default_dir(environ: Mapping[str, str]) -> str:
    """The per-user cache: `$XDG_CACHE_HOME/jaxserve/kernels`, else
    `~/.cache/jaxserve/kernels` (the XDG base-directory default).

    The one place the default is decided. The edges call it with `os.environ` (the
    CLI's flag default, `LLM`'s argument); nothing below them reads the environment,
    and an `EngineConfig` carries the resolved path (`native_kernels_dir`).
    """
    base = environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):  # the spec: a relative value is ignored
        home = environ.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir
        base = os.path.join(home, ".cache")
    return os.path.join(base, "jaxserve", "kernels")


def _euid() -> int:
    """The user whose files are trusted (a seam for tests: another uid's files)."""
    return os.geteuid()


def _refusal(st: os.stat_result, *, directory: bool, private: bool = True) -> str | None:
    """Why a file with this (l)stat must not be trusted, or None. `private`: this
    user's alone, and a directory 0700; else root's counts too, and a directory
    needs only to be unwritable by others."""
    kind = "directory" if directory else "regular file"
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        return f"not a {kind} (mode {stat.filemode(st.st_mode)})"
    if st.st_uid != _euid() and (private or st.st_uid != 0):
        return f"owned by uid {st.st_uid}, not this user ({_euid()})"
    private_dir = directory and private
    mask = 0o077 if private_dir else 0o022  # else: unwritable by others
    if st.st_mode & mask:
        want = "0700" if private_dir else "no group or other write"
        return f"mode {stat.S_IMODE(st.st_mode):04o} (needs {want})"
    return None


def check_dir(path: str, *, private: bool = True) -> None:
    """Raises UnsafeCacheError unless `path` is this user's private directory
    (`private=False`: this user's or root's, unwritable by others; a symlink is
    refused too: its target is not what was checked) under ancestors that no other
    user can rename it in (`_ancestor_refusal`)."""
    reason = _refusal(os.lstat(path), directory=True, private=private)
    if reason:
        raise UnsafeCacheError(f"{path}: {reason}")
    reason = _ancestor_refusal(os.path.dirname(os.path.abspath(path)))
    if reason:
        raise UnsafeCacheError(f"{path}: {reason}")


def _ancestor_refusal(folder: str) -> str | None:
    """Why another user could swap a directory under `folder` after it was checked
    (and so the library loaded from it), or None: every ancestor must be root's or
    this user's, and writable by no one else unless sticky (as /tmp is: only an
    entry's owner may rename it there)."""
    while True:
        st = os.stat(folder)
        if st.st_uid not in (0, _euid()):
            return f"its ancestor {folder} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (
                f"its ancestor {folder} (mode {stat.S_IMODE(st.st_mode):04o}) is writable "
                "by other users, who could put another directory in its place"
            )
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def ensure_dir(path: str) -> None:
    """Creates `path` and its parent with mode 0700 unless they exist (further
    ancestors with the default mode), then checks it (`check_dir`). An existing
    directory is never chmod-ed: files may already have been planted in it."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_dir(path)


def open_checked(path: str, *, private: bool = True) -> int:
    """Opens the library at `path` for loading and checks the opened file
    (`private`: as `check_dir`'s); returns the descriptor (the caller closes it).
    Raises UnsafeCacheError, or FileNotFoundError if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise UnsafeCacheError(f"{path}: a symbolic link") from None
    reason = _refusal(os.fstat(fd), directory=False, private=private)
    if reason:
        os.close(fd)
        raise UnsafeCacheError(f"{path}: {reason}")
    return fd


def fd_path(fd: int, path: str) -> str:
    """A path that names the open file itself (Linux: /proc/self/fd/N), so that
    what is loaded is what was checked; `path` where there is no such name."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else path


@contextlib.contextmanager
def build_lock(directory: str, timeout_s: float) -> Iterator[None]:
    """Holds the directory's exclusive build lock; raises LockTimeoutError if another
    process holds it for `timeout_s` seconds. (flock: released if the holder dies.)"""
    fd = os.open(
        os.path.join(directory, LOCK_NAME),
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"{directory}: another process held the build lock for {timeout_s:g} s"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def sweep_temp(directory: str) -> list[str]:
    """Removes the temporary files of builds that died (call it holding the lock:
    no build is then running); returns their names."""
    swept = []
    for name in os.listdir(directory):
        if name.endswith(TEMP_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                swept.append(name)
    return swept
