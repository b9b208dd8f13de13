"""Multi-host serving with two local processes (4 fake CPU devices each, gloo
collectives): outputs equal one device's, and a killed follower fails requests
cleanly within the step timeout (`multihost_check.py`)."""

import os
import socket
import subprocess
import sys

import pytest

from jaxserve.config import ParallelConfig

HERE = os.path.dirname(os.path.dirname(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.sharded
@pytest.mark.slow
def test_two_processes_serve_one_model_and_a_lost_follower_fails_cleanly(hf_model_dir):
    path, _ = hf_model_dir("llama2_mha")
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env["JAX_PLATFORMS"] = "cpu"
    script = os.path.join(HERE, "multihost_check.py")
    follower = subprocess.Popen(
        [sys.executable, script, path, coordinator, "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        leader = subprocess.run(
            [sys.executable, script, path, coordinator, "0", str(follower.pid)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        follower.kill()
        follower_out = follower.communicate()[0]
    out = leader.stdout + leader.stderr
    assert leader.returncode == 0, out + "\nfollower:\n" + follower_out
    assert "TP 8: 6 outputs equal to one device" in leader.stdout, out
    assert "follower killed: request failed after" in leader.stdout, out


@pytest.mark.parametrize(
    "kw,error",
    [
        (dict(num_processes=2), "needs coordinator_address"),
        (dict(num_processes=2, coordinator_address="h:1", process_id=2), "process_id must be"),
        (dict(num_processes=0), "num_processes must be a positive integer"),
        (
            dict(num_processes=2, coordinator_address="h:1", data_parallel_size=2),
            "a replica spans one host",
        ),
        (dict(step_timeout_s=0), "step_timeout_s must be positive"),
    ],
)
def test_multihost_config_errors_name_the_field(kw, error):
    with pytest.raises(ValueError, match=error):
        ParallelConfig(**kw)
