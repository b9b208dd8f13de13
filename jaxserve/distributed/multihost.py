"""Multi-host serving: one mesh over several processes, one scheduler.

Every process calls `initialize` (`jax.distributed.initialize`; on CPU with the gloo
collectives), builds the same `ModelRunner` over the global mesh (each process loads
and holds only its own devices' shards) and compiles the same step programs. The
leader (process 0) runs the engine: scheduler, tokenizer, servers. Before each step
it writes the step's plan -- the fixed-shape host arrays of the batch and of
sampling -- into the key-value store of JAX's coordination service (which process 0
runs), one key per follower and plan. Each follower (`Follower.run`) reads its plans
in order and runs the same steps, so every process enters each collective of a step
in the same order. No collective carries the plans: the leader never waits for a
follower to send one, a follower waits for the next with a deadline, and nothing is
compiled for them.

Liveness: from `initialize` on (model loading included, so that hosts loading at
different speeds do not take each other for dead), every process bumps a heartbeat
counter in the same store a few times per `step_timeout_s`. A peer whose counter has
not moved for `step_timeout_s` is lost, and so is one that does not complete a step
within it: the leader then raises `FollowerLostError` (the engine loop stops on it,
every in-flight request fails with it, and the servers report NOT_SERVING), a
follower `LeaderLostError`. Idle waits are unbounded while the peers live.

JAX shares fate itself: its coordination service ends every process some time
after one stops heartbeating, and every follower at once when process 0 dies
(SIGABRT, `Terminating process because the JAX distributed service detected fatal
errors`; `jax.distributed.initialize` takes no handler for it). Its timeout is set
well above `step_timeout_s`, so that jaxserve sees a stalled or dead follower, or a
stalled leader, first. A process whose peer is lost cannot shut the distributed runtime
down cleanly -- exit runs its shutdown barrier, which waits for the lost peer -- so
`jaxserve serve` then exits at once with the error's message.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxserve.config import EngineConfig, ParallelConfig
from jaxserve.runner.input_batch import HostBatch, SampleBranches, SamplingMetadata
from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

LEADER = 0
_STOP = b"stop"  # the plan that ends the followers' loops (a step's plan is an .npz)
# Arrays sent as what differs from their fill: `allowed` holds all-ones rows but
# where a row blocks tokens (19 KB a row for a 150k vocabulary), `history` -1 past
# its longest row of ids ([B, max_model_len] with penalties).
_SPARSE = {"allowed": 0xFFFFFFFF, "history": -1}


class FollowerLostError(RuntimeError):
    """A follower process is dead or stalled: the mesh is broken."""


class LeaderLostError(RuntimeError):
    """The leader process (0) is dead or stalled: its followers cannot go on."""


def initialize(p: ParallelConfig) -> Heartbeat | None:
    """Joins this process to the others and starts its heartbeat (None for one
    process). Must run before anything touches a JAX device."""
    if p.num_processes == 1:
        return None
    # CPU devices have cross-process collectives only through gloo (or MPI).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption notifier would take SIGTERM for itself (TPU preemptions); the
    # server drains on it and the leader then stops its followers.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(
        coordinator_address=p.coordinator_address,
        num_processes=p.num_processes,
        process_id=p.process_id,
        # JAX ends every process when one stops heartbeating this long: longer than
        # step_timeout_s, so that jaxserve reports the lost peer first.
        heartbeat_timeout_seconds=max(100, math.ceil(2 * p.step_timeout_s)),
    )
    logger.info(
        "process %d of %d: %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return Heartbeat(_coordination_store(), p.process_id, p.num_processes, p.step_timeout_s)


def _coordination_store():
    """The coordination service's key-value client (JAX has no public accessor;
    orbax reads the same attribute)."""
    from jax._src import distributed

    return distributed.global_state.client


class Heartbeat:
    """This process's sign of life for the others, and its view of theirs.

    A daemon thread bumps this process's counter every `timeout / 4` seconds. A
    peer's counter is read with a deadline (`observe`): a stalled process 0 answers
    nothing, and its store stalls with it. On the leader the thread also observes
    every follower (its reads are local); a follower observes the leader from the
    loop that waits for its plans, since its thread's writes go to the leader's
    store and hang while the leader is stopped.
    """

    def __init__(self, store, process_id: int, num_processes: int, timeout: float):
        self.store = store  # the coordination service's key-value client
        self.process_id = process_id
        self.timeout = timeout
        self.interval = timeout / 4
        now = time.monotonic()
        # peer -> (its counter as last read, when it last moved, when last asked). A
        # peer's silence runs between reads: a process that was itself not running
        # (starved, stopped) does not take its peers for silent.
        self._seen = {p: (None, now, now) for p in range(num_processes) if p != process_id}
        self.peers = list(self._seen)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        watch = self.peers if process_id == LEADER else []
        threading.Thread(
            target=self._beat, args=(watch,), name="jaxserve-heartbeat", daemon=True
        ).start()

    def _beat(self, watch: list[int]) -> None:
        for count in itertools.count(1):
            try:
                self.store.key_value_set(_key("beat", self.process_id), str(count), True)
            except jax.errors.JaxRuntimeError as e:  # the store is gone: JAX ends us soon
                logger.debug("heartbeat not written: %s", e)
            for peer in watch:
                self.observe(peer, wait_s=0.1)
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        """Ends the thread (the others then take this process for lost)."""
        self._stop.set()

    def observe(self, peer: int, wait_s: float) -> float:
        """Reads `peer`'s counter, waiting at most `wait_s` for the store; returns how
        long the counter has not moved."""
        try:
            value = self.store.blocking_key_value_get(
                _key("beat", peer), max(1, int(wait_s * 1000))
            )
        except jax.errors.JaxRuntimeError:  # not written yet, or no answer in time
            value = None
        now = time.monotonic()
        with self._lock:
            last, moved, _ = self._seen[peer]
            if value is not None and value != last:
                last, moved = value, now
            self._seen[peer] = (last, moved, now)
        return now - moved

    def silent_for(self, peer: int) -> float:
        """How long `peer`'s counter had not moved when last read."""
        with self._lock:
            _, moved, asked = self._seen[peer]
            return asked - moved


class Leader:
    """Process 0's side: writes each step's plan for the followers before the step
    runs (`send`, the runner's `plan_sink`), bounds each step by `step_timeout_s`
    (`wait`, the runner's `step_wait`), and tells the followers to stop (at the
    latest when the interpreter exits)."""

    def __init__(self, heartbeat: Heartbeat):
        self.heartbeat = heartbeat
        self.timeout = heartbeat.timeout  # step_timeout_s
        self.followers = heartbeat.peers
        self._store = heartbeat.store
        self._lock = threading.Lock()  # the engine's thread sends plans; anyone stops
        self._next = 0  # the next plan's number
        self._stopped = False
        self._error: FollowerLostError | None = None
        atexit.register(self.stop_followers)  # (before JAX's shutdown, registered earlier)

    @property
    def lost(self) -> FollowerLostError | None:
        """Why the mesh is broken, or None: a follower silent for `step_timeout_s`, a
        step not completed within it, a plan that could not be sent."""
        if self._error is None:
            for peer in self.followers:
                silent = self.heartbeat.silent_for(peer)
                if silent > self.timeout:
                    self._error = FollowerLostError(
                        f"follower process {peer} sent no heartbeat for {silent:.1f}s "
                        f"(step_timeout_s={self.timeout}): it is dead or stalled"
                    )
        return self._error

    def _silent(self) -> str:
        """The followers that look lost, to name in an error (a live one's counter
        moves every `timeout / 4` seconds)."""
        silent = [p for p in self.followers if self.heartbeat.silent_for(p) > self.timeout / 2]
        return f"follower process {', '.join(map(str, silent)) or '(unknown)'}"

    def _put(self, plan: bytes) -> None:
        with self._lock:
            n, self._next = self._next, self._next + 1
            try:
                for peer in self.followers:
                    self._store.key_value_set_bytes(_key("plan", peer, n), plan)
            except jax.errors.JaxRuntimeError as e:
                self._error = FollowerLostError(
                    f"the step's plan could not be sent to {self._silent()}: {e}"
                )

    def send(self, batch: HostBatch, sampling: SamplingMetadata) -> None:
        if self.lost is not None:
            raise FollowerLostError(f"the mesh is broken: {self.lost}")
        self._put(_encode(batch, sampling))
        if self._error is not None:
            raise self._error

    def wait(self, arrays) -> None:
        """Waits until a step's arrays are computed: at most `step_timeout_s`, less if
        a follower is lost meanwhile (the step never completes then). A step whose
        collective failed (a follower's connection dropped before its heartbeat went
        silent) raises FollowerLostError once the heartbeat names the follower."""
        try:
            done = _wait_ready(arrays, self.timeout, lambda: self.lost)
        except jax.errors.JaxRuntimeError as e:
            lost = _within(self.timeout + 2 * self.heartbeat.interval, lambda: self.lost)
            if lost is None:
                raise  # not a lost follower: the step's own error
            raise FollowerLostError(f"{lost}; the step failed: {e}") from e
        if not done:
            self._error = FollowerLostError(
                f"a step did not complete within step_timeout_s={self.timeout}s: "
                f"{self._silent()} is dead or stalled"
            )
            raise self._error

    def stop_followers(self) -> None:
        """Tells the followers to return from `Follower.run` once they have run the
        steps sent before. Never waits for them."""
        if self._stopped:
            return
        self._stopped = True
        self._put(_STOP)

    def close(self) -> None:
        """`LLM.close`: tells the followers to stop (their `Follower.run` returns) and
        ends this process's heartbeat. Never waits for them."""
        self.stop_followers()
        self.heartbeat.stop()


class Follower:
    """A follower's side: receives the leader's plans in order (`receive`), bounds
    each step by `step_timeout_s` (`wait`, its runner's `step_wait`), and runs the
    leader's steps until the leader stops (`run`)."""

    def __init__(self, heartbeat: Heartbeat):
        self.heartbeat = heartbeat
        self.timeout = heartbeat.timeout  # step_timeout_s
        self._store = heartbeat.store
        self._next = 0  # the next plan's number

    def _leader_lost(self, wait_s: float = 0.0) -> LeaderLostError | None:
        silent = self.heartbeat.observe(LEADER, wait_s)
        if silent <= self.timeout:
            return None
        return LeaderLostError(
            f"the leader (process 0) sent no heartbeat for {silent:.1f}s "
            f"(step_timeout_s={self.timeout}): it is dead or stalled"
        )

    def receive(self) -> tuple[HostBatch, SamplingMetadata] | None:
        """The leader's next plan (None: stop), waiting as long as the leader lives."""
        key = _key("plan", self.heartbeat.process_id, self._next)
        wait_s = min(1.0, self.heartbeat.interval)  # (a signal's handler runs between waits)
        while True:
            try:
                plan = self._store.blocking_key_value_get_bytes(key, int(wait_s * 1000))
                break
            except jax.errors.JaxRuntimeError:  # none yet, or the store did not answer
                pass
            lost = self._leader_lost(wait_s)
            if lost is not None:
                raise lost
        self._store.key_value_delete(key)
        self._next += 1
        return None if plan == _STOP else _decode(plan)

    def wait(self, arrays) -> None:
        """Waits until a step's arrays are computed, at most `step_timeout_s`."""
        try:
            done = _wait_ready(arrays, self.timeout, lambda: None)
        except jax.errors.JaxRuntimeError as e:  # a collective failed: the leader's?
            wait_s = min(1.0, self.heartbeat.interval)
            lost = _within(self.timeout + 2 * wait_s, lambda: self._leader_lost(wait_s))
            if lost is None:
                raise
            raise lost from e
        if not done:
            lost = self._leader_lost(min(1.0, self.heartbeat.interval))
            raise lost or LeaderLostError(
                f"a step did not complete within step_timeout_s={self.timeout}s: the "
                "leader or another follower is dead or stalled"
            )

    def close(self) -> None:
        """`LLM.close`: ends this process's heartbeat (the leader then takes it for
        lost, unless it stopped the followers first)."""
        self.heartbeat.stop()

    def run(self, runner: ModelRunner) -> int:
        """Runs the leader's steps on `runner` (built with `step_wait=self.wait`)
        until the leader stops; returns the steps run. Raises LeaderLostError if the
        leader is dead or stalled."""
        steps, prev = 0, None
        while (plan := self.receive()) is not None:
            # The step before's tokens, for a plan made with asynchronous scheduling (its
            # rows that read them name them; this process computed the same ones).
            prev = runner.dispatch(*plan, prev)
            runner.fetch(prev)
            steps += 1
        return steps


def follower_runner(config: EngineConfig, follower: Follower) -> ModelRunner:
    """A follower's runner: this process's shards of the weights and KV caches, and
    the step programs compiled (`initialize` done)."""
    runner = ModelRunner(config, step_wait=follower.wait)
    if config.warmup:
        runner.warmup()
    logger.info("follower %d ready to run the leader's steps", config.parallel.process_id)
    return runner


def _key(kind: str, *parts: int) -> str:
    return "/".join(("jaxserve", kind, *map(str, parts)))


def _fields(obj) -> dict[str, np.ndarray]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _encode(batch: HostBatch, sampling: SamplingMetadata) -> bytes:
    arrays = {f"batch.{name}": a for name, a in _fields(batch).items()}
    for name, a in _fields(sampling).items():
        if name == "branches":  # (the program's static key: the followers run the same)
            a = np.array(() if a is None else a, np.bool_)
        elif name in _SPARSE:
            differs = a != _SPARSE[name]
            rows = np.flatnonzero(differs.any(axis=1))
            width = int(np.flatnonzero(differs.any(axis=0))[-1]) + 1 if rows.size else 0
            arrays[f"sparse.{name}.rows"] = rows
            arrays[f"sparse.{name}.shape"] = np.array(a.shape)
            a = a[rows, :width]
        arrays[f"sampling.{name}"] = a
    # A JSON header (name, dtype, shape of each array), then their bytes in order.
    header = json.dumps([(k, a.dtype.str, a.shape) for k, a in arrays.items()]).encode()
    parts = [len(header).to_bytes(4, "little"), header]
    return b"".join(parts + [np.ascontiguousarray(a).tobytes() for a in arrays.values()])


def _decode(plan: bytes) -> tuple[HostBatch, SamplingMetadata]:
    offset = 4 + int.from_bytes(plan[:4], "little")
    arrays = {}
    for name, dtype, shape in json.loads(plan[4:offset]):
        count = math.prod(shape)
        arrays[name] = np.frombuffer(plan, dtype, count, offset).reshape(shape)
        offset += count * np.dtype(dtype).itemsize
    for name, fill in _SPARSE.items():
        part = arrays[f"sampling.{name}"]
        full = np.full(arrays[f"sparse.{name}.shape"], fill, part.dtype)
        full[arrays[f"sparse.{name}.rows"], : part.shape[1]] = part
        arrays[f"sampling.{name}"] = full

    def of(cls, prefix: str):
        return cls(**{f.name: arrays[f"{prefix}.{f.name}"] for f in dataclasses.fields(cls)})

    sampling = of(SamplingMetadata, "sampling")
    flags = sampling.branches.tolist()
    branches = SampleBranches(*flags) if flags else None
    return of(HostBatch, "batch"), dataclasses.replace(sampling, branches=branches)


def _wait_ready(tree, timeout: float, lost: Callable[[], BaseException | None]) -> bool:
    """Waits until every array of `tree` is computed; False if `timeout` seconds
    pass first (a step whose collectives a lost peer never joins never completes).
    Raises `lost()` as soon as it is not None, and a step's error (JaxRuntimeError:
    a collective fails at once when a peer's connection drops)."""
    deadline = time.monotonic() + timeout
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    while not all(x.is_ready() for x in leaves):
        if (error := lost()) is not None:
            raise error
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    jax.block_until_ready(leaves)  # computed, or failed: raises the step's error
    return True


def _within(timeout: float, lost: Callable[[], BaseException | None]) -> BaseException | None:
    """`lost()` once it is not None, or None if `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while (error := lost()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return error
