"""Running a check script with 8 fake CPU devices (a fresh process: the device
count is fixed when JAX starts)."""

import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def run_on_8_devices(script: str, *args) -> str:
    """Runs tests/`script` with `args` in a subprocess with 8 fake CPU devices (the
    device count is fixed when JAX starts); asserts it succeeded, returns its stdout."""
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
