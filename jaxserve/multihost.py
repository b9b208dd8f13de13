"""Multi-host serving: one mesh over several processes, one scheduler.

Every process calls `initialize` (`jax.distributed.initialize`; on CPU with the gloo
collectives), builds the same `ModelRunner` over the global mesh (each process loads
and holds only its own devices' shards) and compiles the same step programs. The
leader (process 0) runs the engine: scheduler, tokenizer, servers. Each step, before
running it, the leader sends the step's plan -- the fixed-shape host arrays of the
batch and of sampling -- to the followers with JAX's own multi-host broadcast
(`multihost_utils.broadcast_one_to_all`, a collective over all devices), first a
small fixed-size header (token bucket, row bucket, penalty history) so each follower
knows the shapes to receive. Followers (`run_follower`) only receive plans and run
the same steps, so every process enters each collective of the step in the same
order.

Failure: a follower that dies or stalls leaves the leader's broadcast or step
waiting. The leader waits at most `step_timeout_s` for either and then raises
`FollowerLostError`; the engine loop stops on it, every in-flight request fails with
that error, and the servers report NOT_SERVING (`AsyncLLMEngine.healthy`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig, ParallelConfig
from jaxserve.runner.input_batch import HostBatch, SamplingMetadata

logger = logging.getLogger(__name__)

_RUN, _STOP = 1, 2
_HEADER = 4  # [op, token bucket, row bucket, with penalty history]


class FollowerLostError(RuntimeError):
    """A follower process did not join a step in time: the mesh is broken."""


def initialize(p: ParallelConfig) -> None:
    """Joins this process to the others (no-op for one process). Must run before
    anything touches a JAX device."""
    if p.num_processes == 1:
        return
    # CPU devices have cross-process collectives only through gloo (or MPI).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=p.coordinator_address,
        num_processes=p.num_processes,
        process_id=p.process_id,
    )
    logger.info(
        "process %d of %d: %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def _header(op: int, batch: HostBatch | None, sampling: SamplingMetadata | None) -> np.ndarray:
    if batch is None:
        return np.array([op, 0, 0, 0], np.int32)
    return np.array(
        # Without penalties the history is a [B, 1] placeholder.
        [op, len(batch.input_ids), len(sampling.temperature), sampling.history.shape[1] > 1],
        np.int32,
    )


def _fields(batch: HostBatch) -> list[np.ndarray]:
    """The batch's arrays in field order (HostBatch is not a pytree)."""
    return [getattr(batch, f.name) for f in dataclasses.fields(batch)]


class Leader:
    """Process 0's side: sends each step's plan before the step runs (installed as
    the runner's `plan_sink`), within `step_timeout_s`."""

    def __init__(self, runner, config: EngineConfig):
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self.timeout = config.parallel.step_timeout_s
        self.runner = runner
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-plan")
        self.lost: BaseException | None = None
        runner.plan_sink = self.send
        runner.fetch_timeout = self.timeout

    def _send(self, op: int, batch=None, sampling=None) -> None:
        if self.lost is not None:
            raise FollowerLostError(f"the mesh is broken: {self.lost}")

        def both():
            self._broadcast(_header(op, batch, sampling))
            if batch is not None:
                self._broadcast((_fields(batch), sampling))

        future = self._pool.submit(both)
        try:
            future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            self.lost = FollowerLostError(
                f"a follower process did not take the step's plan within "
                f"step_timeout_s={self.timeout}s (dead or stalled)"
            )
            raise self.lost from None
        except Exception as e:  # the collective failed: a peer is gone
            self.lost = FollowerLostError(
                f"a follower process is lost: sending the step's plan failed: {e!r}"
            )
            raise self.lost from e

    def send(self, batch: HostBatch, sampling: SamplingMetadata) -> None:
        self._send(_RUN, batch, sampling)

    def stop_followers(self) -> None:
        """Tells the followers to return from `run_follower`."""
        if self.lost is None:
            self._send(_STOP)

    def close(self) -> None:
        """Stops the plan thread (`LLM.close`); a broadcast a lost follower never
        joined is not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def run_follower(runner) -> int:
    """A follower's loop: receive each plan from the leader and run its step, until
    the leader stops. Returns the steps run."""
    from jax.experimental import multihost_utils

    steps, prev = 0, None
    while True:
        op, tokens, rows, history = multihost_utils.broadcast_one_to_all(
            np.zeros(_HEADER, np.int32)
        )
        if op == _STOP:
            return steps
        template = (
            runner.build([], token_bucket=int(tokens)),
            runner.build_sampling([], int(rows), with_history=bool(history)),
        )
        arrays, sampling = multihost_utils.broadcast_one_to_all((_fields(template[0]), template[1]))
        # The step before's tokens, for a plan made with asynchronous scheduling (its
        # rows that read them name them; this process computed the same ones).
        prev = runner.dispatch(HostBatch(*arrays), sampling, prev)
        runner.fetch(prev)
        steps += 1


def wait_ready(tree, timeout: float) -> None:
    """Waits until every array of `tree` is computed, at most `timeout` seconds (a
    step whose collectives a dead follower never joins never completes)."""
    deadline = time.monotonic() + timeout
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    while not all(x.is_ready() for x in leaves):
        if time.monotonic() > deadline:
            raise FollowerLostError(
                f"a step did not complete within step_timeout_s={timeout}s: a follower "
                "process is dead or stalled"
            )
        time.sleep(0.0005)


def follower_runner(config: EngineConfig):
    """A follower's runner: this process's shards of the weights and KV caches, and
    the step programs compiled (`initialize` done)."""
    from jaxserve.runner.model_runner import ModelRunner

    runner = ModelRunner(config)
    if config.warmup:
        runner.warmup()
    logger.info("follower %d ready to run the leader's steps", config.parallel.process_id)
    return runner
