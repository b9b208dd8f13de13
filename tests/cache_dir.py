"""Where the test runs keep what outlives one run: JAX's persistent compilation cache
(`tests/conftest.py`) and the last run's test durations (`tools/run_tests.py`).
Outside the clone, so a second run on the same machine, from any clone, finds them."""

import os
import subprocess
import sys

DEFAULT = "~/.cache/jaxserve-tests"


def test_cache_dir() -> str:
    """`JAXSERVE_TEST_CACHE`, or the default; empty: none (every program compiled
    afresh, nothing recorded)."""
    return os.path.expanduser(os.environ.get("JAXSERVE_TEST_CACHE", DEFAULT))


test_cache_dir.__test__ = False  # (not a test: its name only says what it returns)


def with_xla_flags(*flags: str) -> str:
    """This process's XLA_FLAGS and `flags`: for a process a test starts with flags of
    its own (fake devices)."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


def env_without_compilation_cache() -> dict[str, str]:
    """This process's environment less JAX's persistent-cache settings: for a process
    a test starts that must compile what it saves (XLA:CPU cannot serialize a program it
    loaded from a cache again), or that tests who sets the cache."""
    return {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}


def python_with_its_own_cache(code: str, directory) -> list[str]:
    """The lines `code` prints, run in a fresh process with `directory` as its argument,
    and with no cache but the one it sets (the test runs' own, which tests/conftest.py
    puts in the environment, left out)."""
    proc = subprocess.run(
        [sys.executable, "-c", code, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env_without_compilation_cache(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()
