"""Running a check script with 8 fake CPU devices (a fresh process: the device
count is fixed when JAX starts)."""

import os
import subprocess
import sys

from cache_dir import with_xla_flags

HERE = os.path.dirname(__file__)
# The script as `python script args` would run it, with the garbage collector tuned as
# in the test processes (conftest.py) and jaxserve's command line, and the test cache
# shared as the test processes share it (conftest.py).
_LAUNCH = """
import gc, os, runpy, sys
from jaxserve.compile_cache import use_file_cache
from server.cli.main import GC_THRESHOLDS
use_file_cache()
gc.set_threshold(*GC_THRESHOLDS)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_on_8_devices(script: str, *args) -> str:
    """Runs tests/`script` with `args` in a subprocess with 8 fake CPU devices (the
    device count is fixed when JAX starts); asserts it succeeded, returns its stdout."""
    env = dict(
        os.environ,
        XLA_FLAGS=with_xla_flags("--xla_force_host_platform_device_count=8"),
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCH, os.path.join(HERE, script), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
