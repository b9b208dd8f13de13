"""Multi-host serving.

In one process, over an in-memory key-value store: a plan's round trip, plans in
order and the stop, and a silent peer taken for lost. With two local processes (4
fake CPU devices each, gloo collectives): outputs equal one device's, a killed
follower fails requests cleanly within the step timeout (`multihost_check.py`);
and `jaxserve serve`'s lifecycle: the leader stops its followers, and either side
exits with a message naming a peer that is stopped (SIGSTOP) or killed.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import jax
import numpy as np
import pytest
from cache_dir import with_xla_flags
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ports import free_port

from jaxserve.config import ParallelConfig
from jaxserve.distributed import multihost
from jaxserve.runner.input_batch import (
    WARM_BRANCHES,
    SampleRow,
    SeqWork,
    build_batch,
    build_sampling,
)
from jaxserve.sampling_params import SamplingParams

HERE = os.path.dirname(os.path.dirname(__file__))


@pytest.mark.sharded
@pytest.mark.slow
def test_two_processes_serve_one_model_and_a_lost_follower_fails_cleanly(hf_model_dir):
    path, _ = hf_model_dir("llama2_mha")
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, XLA_FLAGS=with_xla_flags("--xla_force_host_platform_device_count=4"))
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


STEP_TIMEOUT_S = 3.0  # `jaxserve serve`'s pairs below: a peer silent this long is lost
EXIT_S = STEP_TIMEOUT_S + 20  # (+ detection, exit, busy cores)


class Served:
    """A `jaxserve serve` process of a two-process mesh, its output in a file."""

    def __init__(self, args: list[str], log, env: dict):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server.cli.main", "serve", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=os.path.dirname(HERE),
            )

    def output(self) -> str:
        return self.log.read_text()

    def exit_status(self, timeout: float) -> tuple[int, float]:
        """Waits for the process to end: its status, and the seconds waited."""
        t0 = time.monotonic()
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout}s:\n{self.output()}") from None
        return status, time.monotonic() - t0


@pytest.fixture
def served_pair(hf_model_dir, tmp_path):
    """`jaxserve serve` as leader and follower of one mesh (TP 8 over 2 processes x 4
    devices), the leader SERVING and the follower waiting for its steps; both are
    killed at the end. No warm-up: nothing is compiled until a step runs."""
    path, _ = hf_model_dir("llama2_mha")
    common = [
        f"--model={path}",
        "--skip_tokenizer_init",
        "--tensor_parallel_size=8",
        "--num_processes=2",
        f"--coordinator_address=127.0.0.1:{free_port()}",
        f"--step_timeout_s={STEP_TIMEOUT_S}",
        "--warmup=false",
        "--compilation_cache_dir=",
        "--max_model_len=64",
        "--max_num_seqs=4",
        "--max_num_batched_tokens=32",
        "--block_size=8",
    ]
    env = dict(os.environ, XLA_FLAGS=with_xla_flags("--xla_force_host_platform_device_count=4"))
    env["JAX_PLATFORMS"] = "cpu"
    follower = Served([*common, "--process_id=1"], tmp_path / "follower.log", env)
    port = free_port()
    leader = Served(
        [*common, "--process_id=0", f"--grpc_port={port}", "--port=0"], tmp_path / "leader.log", env
    )
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def serving() -> bool:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:  # not listening yet
            return False
        return status == health_pb2.HealthCheckResponse.SERVING

    try:
        deadline = time.monotonic() + 180
        while not ("ready to run the leader's steps" in follower.output() and serving()):
            for side in (leader, follower):
                assert side.proc.poll() is None, side.output()
            assert time.monotonic() < deadline, leader.output() + follower.output()
            time.sleep(0.2)
        yield leader, follower
    finally:
        for side in (leader, follower):
            if side.proc.poll() is None:
                side.proc.send_signal(signal.SIGCONT)
                side.proc.kill()
                side.proc.wait()


@pytest.mark.sharded
@pytest.mark.slow
def test_serve_stops_its_followers_when_it_stops(served_pair):
    leader, follower = served_pair
    leader.proc.send_signal(signal.SIGTERM)
    assert leader.exit_status(EXIT_S)[0] == 0, leader.output()
    assert follower.exit_status(EXIT_S)[0] == 0, follower.output()
    assert "the leader stopped; ran 0 steps" in follower.output()


@pytest.mark.sharded
@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
def test_serve_leader_exits_naming_a_stopped_or_killed_follower(served_pair, stop):
    leader, follower = served_pair
    follower.proc.send_signal(stop)
    status, waited = leader.exit_status(EXIT_S)
    assert status == 1, leader.output()
    assert "follower process 1 sent no heartbeat" in leader.output()
    assert waited >= STEP_TIMEOUT_S - 1.0  # (its last beat may be up to a quarter old)


@pytest.mark.sharded
@pytest.mark.slow
def test_serve_follower_exits_naming_a_stopped_leader(served_pair):
    leader, follower = served_pair
    leader.proc.send_signal(signal.SIGSTOP)
    status, waited = follower.exit_status(EXIT_S)
    assert status == 1, follower.output()
    assert "the leader (process 0) sent no heartbeat" in follower.output()
    assert waited >= STEP_TIMEOUT_S - 1.0


@pytest.mark.sharded
@pytest.mark.slow
def test_serve_follower_ends_at_once_when_the_leader_is_killed(served_pair):
    """JAX's coordination service, which the leader runs, ends the follower itself
    (SIGABRT) the moment the leader dies; jaxlib has no hook to exit cleanly instead."""
    leader, follower = served_pair
    leader.proc.kill()
    status, _ = follower.exit_status(EXIT_S)
    assert status != 0, follower.output()
    assert "another task died" in follower.output()


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


class FakeStore:
    """The coordination service's key-value store in memory: what `Heartbeat`,
    `Leader` and `Follower` call, with its deadlines."""

    def __init__(self):
        self.values = {}
        self.changed = threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.changed:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value
            self.changed.notify_all()

    key_value_set_bytes = key_value_set

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def key_value_delete(self, key):
        with self.changed:
            del self.values[key]


def _plan(vocab_size=5000, penalty=0.5, blocked=(2, 4999)):
    """A step's plan with one row that blocks tokens and has a penalty (so `allowed`
    and `history` each hold one row that differs from their fill)."""
    work = [SeqWork(token_ids=[5, 6, 7], start=0, pages=[1])]
    batch = build_batch(work, page_size=8, pages_per_seq=64, token_bucket=8, seq_bucket=4)
    rows = [
        SampleRow(SamplingParams(temperature=0.0), [1, 2], num_prompt=2, seed=0),
        SampleRow(
            SamplingParams(frequency_penalty=penalty, seed=3),
            [4, 5, 6],
            num_prompt=2,
            seed=3,
            blocked_ids=blocked,
        ),
    ]
    sampling = build_sampling(
        rows, seq_bucket=4, history_len=512, max_bias=4, vocab_size=vocab_size
    )
    return batch, sampling


def _arrays(*objs):
    fields = [multihost._fields(obj).items() for obj in objs]
    return [a for items in fields for name, a in items if name != "branches"]


def test_a_plan_round_trips_sending_only_what_differs_from_the_fill():
    batch, sampling = _plan()
    plan = multihost._encode(batch, sampling)
    got = multihost._decode(plan)
    for want, have in zip(_arrays(batch, sampling), _arrays(*got), strict=True):
        assert want.dtype == have.dtype and np.array_equal(want, have)
    full = sum(a.nbytes for a in _arrays(batch, sampling))
    # `allowed` [4, 157] words and `history` [4, 512] ids: one row of each is sent.
    assert len(plan) < full / 3, (len(plan), full)
    # A plain batch (no penalty, no blocked id): a [B, 1] history and a [B, 0] bitmask.
    plain = multihost._decode(multihost._encode(*_plan(penalty=0.0, blocked=())))[1]
    assert plain.history.shape == (4, 1) and plain.allowed.shape == (4, 0)
    # The sampling program's key, where the host decides it (a GPU's): the followers
    # run the leader's program.
    assert got[1].branches is None
    for branches in WARM_BRANCHES[False]:
        keyed = dataclasses.replace(sampling, branches=branches)
        assert multihost._decode(multihost._encode(batch, keyed))[1].branches == branches


def test_a_plans_page_copies_reach_the_followers():
    """Copy-on-write's page pairs travel with the batch: a follower copies the same
    pages before the same step (and a plan without copies carries an empty list)."""
    batch, sampling = _plan()
    assert multihost._decode(multihost._encode(batch, sampling))[0].copies.shape == (0, 2)
    batch = dataclasses.replace(batch, copies=np.array([[3, 9], [4, 12]], np.int32))
    got = multihost._decode(multihost._encode(batch, sampling))[0].copies
    assert got.tolist() == [[3, 9], [4, 12]] and got.dtype == np.int32


def _pair(timeout):
    store = FakeStore()
    leader = multihost.Leader(multihost.Heartbeat(store, 0, 2, timeout))
    follower = multihost.Follower(multihost.Heartbeat(store, 1, 2, timeout))
    return store, leader, follower


def test_a_follower_receives_the_plans_in_order_then_the_stop():
    store, leader, follower = _pair(timeout=5.0)
    first, second = _plan(), _plan(vocab_size=64)
    leader.send(*first)
    leader.send(*second)
    leader.stop_followers()
    leader.stop_followers()  # (once only: also at exit)
    for want in (first, second):
        assert all(map(np.array_equal, _arrays(*want), _arrays(*follower.receive())))
    assert follower.receive() is None
    assert not [k for k in store.values if "/plan/" in k]  # each read plan deleted
    assert leader.lost is None
    for side in (leader, follower):
        side.heartbeat.stop()


def test_a_silent_leader_is_lost_within_the_timeout():
    _, leader, follower = _pair(timeout=0.4)
    leader.heartbeat.stop()  # as a stopped (SIGSTOP) or dead leader: its counter stops
    t0 = time.monotonic()
    with pytest.raises(multihost.LeaderLostError, match=r"leader \(process 0\) sent no heartbeat"):
        follower.receive()
    assert time.monotonic() - t0 < 3.0
    follower.heartbeat.stop()


def test_silence_runs_between_reads_so_a_starved_reader_takes_no_peer_for_lost():
    store = FakeStore()
    heartbeat = multihost.Heartbeat(store, 1, 2, timeout=0.2)  # (a follower's: reads on demand)
    store.key_value_set("jaxserve/beat/0", "1", True)
    assert heartbeat.observe(0, wait_s=0.01) < 0.1
    time.sleep(0.5)  # this process does not run (starved, or stopped itself)
    assert heartbeat.silent_for(0) < 0.1
    assert heartbeat.observe(0, wait_s=0.01) >= 0.5  # asked now: the counter has not moved
    heartbeat.stop()


def test_a_silent_follower_is_lost_and_named_and_no_plan_goes_out():
    store, leader, follower = _pair(timeout=0.4)
    time.sleep(0.3)
    assert leader.lost is None  # both beat
    follower.heartbeat.stop()
    deadline = time.monotonic() + 3.0
    while leader.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "follower process 1 sent no heartbeat" in str(leader.lost)
    with pytest.raises(multihost.FollowerLostError, match="follower process 1"):
        leader.send(*_plan())
    assert not [k for k in store.values if "/plan/" in k]
    leader.heartbeat.stop()


@pytest.mark.parametrize("follower_dies", [True, False])
def test_a_step_whose_collective_failed_names_the_lost_follower(monkeypatch, follower_dies):
    """A collective fails as soon as a dead follower's connection drops, before its
    heartbeat goes silent (CI saw 'Gloo collective permute failed: Connection reset by
    peer' reach the client). The leader names the follower once its heartbeat is
    silent; a step that failed with every follower alive raises its own error."""
    collective = jax.errors.JaxRuntimeError("UNKNOWN: Gloo collective permute failed")

    def failed_step(*_):
        raise collective

    monkeypatch.setattr(multihost, "_wait_ready", failed_step)
    _, leader, follower = _pair(timeout=0.4)
    if follower_dies:
        follower.heartbeat.stop()
        with pytest.raises(multihost.FollowerLostError, match="follower process 1") as e:
            leader.wait([])
        assert "Gloo collective permute failed" in str(e.value)
    else:
        with pytest.raises(jax.errors.JaxRuntimeError) as e:
            leader.wait([])
        assert e.value is collective
        follower.heartbeat.stop()
    leader.heartbeat.stop()
