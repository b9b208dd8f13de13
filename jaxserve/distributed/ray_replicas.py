"""Data-parallel replicas on a Ray cluster (`data_parallel_backend="ray"`): each
replica an `LLMEngine` in its own Ray actor process, placed on a machine of the
cluster, behind the same `DataParallelEngine` front as local replicas.

The front (the process that serves gRPC/HTTP, tokenizes prompts and routes) holds
one `RayReplica` per actor. It validates requests itself (`validate_request`, with
the replica's pool size) and sends each to its actor (`ReplicaActor.add`); the
actor's outputs come back on one Ray streaming generator, a batch per engine step
for all its requests, and a thread of the front hands each to its request's stream.
The front asks every replica whether it is alive every `HEALTH_INTERVAL_S`: a
replica whose actor died, whose engine stopped, that does not answer within
`ParallelConfig.step_timeout_s`, or whose engine showed no progress for that long
(`progress_watch`: a long step, a compile or a long prefill, is not a stall) is
failed, and so is every request in flight on it (EngineDeadError naming the
replica); the front then reports unhealthy (the servers go NOT_SERVING), as a dead
local replica or multi-host follower does.

Why Ray: it is what vLLM uses for the same job, so operators of GPU/TPU clusters
already run it; it places each replica by the resources it needs (GPUs, TPU chips,
CPUs) on whichever machine has them, sets the actor's visible devices, restarts
nothing behind our back, tells the caller at once when an actor's process or node
dies, and carries Python objects (the requests' parameters, the streamed outputs)
without a protocol of ours. JAX's own distributed runtime is for one program over
one mesh (multi-host TP, `jaxserve.distributed.multihost`), not for independent replicas that
come and go.

Each replica takes `tensor_parallel_size` GPUs (`num_gpus`) or TPU chips (resource
"TPU") when the cluster has them, else one CPU; replicas are spread over the
machines. Every machine needs jaxserve installed and the model directory at the same
path (as multi-host serving does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxserve import controls
from jaxserve.async_engine import OutputStream
from jaxserve.config import EngineConfig
from jaxserve.controls import NamedControls
from jaxserve.distributed.ray_actor import ControlReply, ReplicaActor
from jaxserve.engine import validate_request
from jaxserve.engine.lifecycle import paused_error
from jaxserve.engine_stats import StatsSnapshot
from jaxserve.front import (
    EngineDeadError,
    EngineState,
    EngineUnavailableError,
    RequestFailedError,
)
from jaxserve.generate_request import GenerateRequest
from jaxserve.outputs import ModelInfo, RequestOutput
from jaxserve.sampling_params import ParamError

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0  # how often the front asks each replica whether it is alive
STATS_TIMEOUT_S = 1.0  # a metrics scrape waits this long for a replica's counters
STATS_MAX_AGE_S = 0.25  # counters fetched more recently are used again
STARTUP_REPORT_S = 60.0  # while replicas load, say every minute what they wait for


class RayReplica(NamedControls):
    """The front's handle on one `ReplicaActor`: an `EngineFront` (that does not
    transfer KV pages), a replica of `DataParallelEngine`. A thread receives the
    actor's output batches and hands each output to its request's stream; another
    checks the replica's health."""

    def __init__(self, actor, config: EngineConfig, has_tokenizer: bool, index: int, described):
        import ray

        self.actor, self.config, self.index = actor, config, index
        self.has_tokenizer = has_tokenizer
        info, self.pool_capacity, self.where, self.node_id = described
        # (it holds one engine, but which replica holds a prefix is the router's choice)
        self.model_info: ModelInfo = dataclasses.replace(info, can_transfer_kv=False)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._streams: dict[int, OutputStream] = {}  # key -> its stream
        self._key_of: dict[str, int] = {}  # request id -> its key, while it runs
        # The actor's engine state as its newest control reply or health check said (it
        # starts awake, unpaused, with the weights of version 0), and when it was read.
        self._state, self._state_at = EngineState(), -1
        self._last_stats: StatsSnapshot = ray.get(actor.stats.remote())
        self._stats_at = time.monotonic()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=fn, name=f"jaxserve-ray-replica-{index}", daemon=True)
            for fn in (self._receive, self._watch)
        ]
        for t in self._threads:
            t.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._stop.is_set()

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def validate(self, request: GenerateRequest) -> None:
        validate_request(self.config, self.pool_capacity, self.has_tokenizer, request)

    def replica_stats(self) -> list[StatsSnapshot]:
        return []  # one engine, no replicas

    def stats(self) -> StatsSnapshot:
        """The replica's counters, at most STATS_MAX_AGE_S old (its last known ones if
        it does not answer within STATS_TIMEOUT_S: a metrics scrape must not hang)."""
        import ray

        if self.healthy and time.monotonic() - self._stats_at > STATS_MAX_AGE_S:
            try:
                self._last_stats = ray.get(self.actor.stats.remote(), timeout=STATS_TIMEOUT_S)
                self._stats_at = time.monotonic()
            except Exception as e:  # the health check decides whether it is dead
                logger.warning("replica %d (%s): no stats: %r", self.index, self.where, e)
        return self._last_stats

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs from the replica until it finishes; raises
        ValueError for a request it refuses, EngineDeadError once the replica failed."""
        self.validate(request)
        request_id = request.request_id
        stream = OutputStream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # under the lock: a failure now puts its error in this stream
            if not self.healthy:
                raise self._dead()
            if request_id in self._key_of:
                raise ValueError(f"request_id {request_id!r} is already in use")
            key = next(self._keys)
            self._streams[key] = stream
            self._key_of[request_id] = key
        self.actor.add.remote(key, request)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if item is None:  # aborted
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, RequestFailedError) and item.output is not None:
                        item.output.request_id = request_id
                    raise item
                item.request_id = request_id  # the engine's was made unique with the key
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            stream.closed = True
            with self._lock:
                self._streams.pop(key, None)
                if self._key_of.get(request_id) == key:
                    del self._key_of[request_id]
            if not finished and self.healthy:
                self.actor.abort.remote(key)  # the client went away: free its pages

    def abort(self, request_id: str) -> None:
        key = self._key_of.get(request_id)
        if key is not None:
            self.actor.abort.remote(key)

    # ----------------------------------------------------------------- controls

    def unavailable(self) -> EngineUnavailableError | None:
        """Sleeping, or paused with `pause_wait_s` 0 (the actor's engine holds requests
        sent while paused, and gives up on them, itself)."""
        if self.is_sleeping:
            return EngineUnavailableError(
                f"data-parallel replica {self.index} is sleeping: it takes requests again "
                "after wake_up"
            )
        if self.is_paused and self.config.pause_wait_s <= 0:
            return paused_error(0)
        return None

    @property
    def state(self) -> EngineState:
        """The engine's state as the actor's newest control reply said (or a health
        check, within HEALTH_INTERVAL_S): read without asking the actor."""
        return self._state

    def _keep(self, state: EngineState, at: int) -> None:
        """Keeps the actor's engine state read at `at` (the actor's clock), unless one
        read later is kept (replies to calls that ran at once may cross)."""
        with self._lock:
            if at > self._state_at:
                self._state, self._state_at = state, at

    async def control(self, name: str, **args: Any) -> Any:
        """Runs the control `name` in the actor (`ReplicaActor.control`), its arguments
        checked here first (`jaxserve.controls`), and keeps the state it answers with.
        An argument that is an object of this process (`Arg.in_process`: arrays) is
        refused by name: the actor runs in another process, on another machine maybe."""
        op = controls.get(name)
        args = op.bind(self, self.config, args)
        for a in op.args:
            if a.in_process is not None and args[a.name] is not None:
                raise ParamError(
                    a.name,
                    f"{a.name}: data-parallel replica {self.index} runs in a Ray actor and "
                    f"{a.in_process}",
                )
        reply: ControlReply = await self.actor.control.remote(name, args)
        self._keep(reply.state, reply.state_at)
        if reply.error is not None:
            raise reply.error
        return reply.result

    def close(self, timeout: float = 10.0) -> None:
        """Closes the actor's engine (at most about `timeout` seconds), kills the actor,
        ends the streams still open and stops this handle's threads. Idempotent."""
        import ray

        if self._stop.is_set():
            return
        self._stop.set()
        if self.error is None:  # (a failed replica's actor is killed already)
            try:
                ray.get(self.actor.shutdown.remote(timeout), timeout=timeout + 5)
            except Exception as e:
                logger.warning("replica %d (%s): shutdown: %r", self.index, self.where, e)
        ray.kill(self.actor)
        self._end_streams(self._dead())  # "was shut down"
        # The receiver ends with the killed actor's stream, the watcher at its next tick.
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def __enter__(self) -> RayReplica:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _dead(self) -> EngineDeadError:
        if self.error is None:
            return EngineDeadError(f"data-parallel replica {self.index} was shut down")
        return EngineDeadError(
            f"data-parallel replica {self.index} on {self.where} failed: {self.error!r}"
        )

    def _end_streams(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(error)

    def _fail(self, error: BaseException) -> None:
        """Marks the replica dead (once), fails every request in flight on it, and
        kills its actor (a stalled one must not go on with their work)."""
        import ray

        with self._lock:
            if self.error is not None or self._stop.is_set():
                return
            self.error = error
        logger.error("data-parallel replica %d on %s failed: %r", self.index, self.where, error)
        self._end_streams(self._dead())
        try:
            ray.kill(self.actor)
        except Exception as e:
            logger.warning("replica %d (%s): kill: %r", self.index, self.where, e)

    def _receive(self) -> None:
        """Hands the actor's output batches to the requests' streams until it ends."""
        import ray

        try:
            for ref in self.actor.outputs.options(num_returns="streaming").remote():
                for key, payload in ray.get(ref):
                    if isinstance(payload, EngineDeadError):
                        self._fail(payload)
                    stream = self._streams.get(key)
                    if stream is not None and not stream.put(payload):
                        self._orphaned(key, payload)
            raise EngineDeadError("the replica's output stream ended")
        except Exception as e:  # the actor, or its machine, is gone
            self._fail(e)

    def _orphaned(self, key: int, payload) -> None:
        """A request whose reader is gone (its event loop closed without closing the
        stream): forgets its stream, and aborts it on the actor if it still runs."""
        with self._lock:
            self._streams.pop(key, None)
            for request_id in [r for r, k in self._key_of.items() if k == key]:
                del self._key_of[request_id]
        if isinstance(payload, RequestOutput) and not payload.finished:
            self.actor.abort.remote(key)

    def _watch(self) -> None:
        import ray

        timeout = self.config.parallel.step_timeout_s
        while not self._stop.wait(HEALTH_INTERVAL_S) and self.error is None:
            try:
                self._keep(*ray.get(self.actor.health.remote(), timeout=timeout))
            except ray.exceptions.GetTimeoutError:
                self._fail(TimeoutError(f"no answer to a health check within {timeout:.0f}s"))
            except ray.exceptions.RayTaskError as e:
                self._fail(e.cause or e)
            except Exception as e:  # the actor or its node died
                self._fail(e)


def ray_replicas(config: EngineConfig, tokenizer_dir: str | None) -> list[RayReplica]:
    """`config.parallel.data_parallel_size` replicas, each an actor on the Ray cluster
    at `config.parallel.ray_address` (joined or started here), each with
    `tensor_parallel_size` of its machine's devices; returns once all are loaded."""
    try:
        import ray
    except ImportError as e:
        raise ValueError(
            "data_parallel_backend='ray' needs Ray: pip install 'ray>=2.40' (on every machine)"
        ) from e
    p = config.parallel
    if not ray.is_initialized():
        # No address: a new cluster of this machine ("local"), never whatever
        # /tmp/ray/ray_current_cluster last named (a stale one makes ray.init hang).
        ray.init(
            address=p.ray_address or "local",
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    cluster = ray.cluster_resources()
    tp = p.tensor_parallel_size
    if cluster.get("GPU", 0) >= 1:
        resources = dict(num_cpus=1, num_gpus=tp)
    elif cluster.get("TPU", 0) >= 1:
        resources = dict(num_cpus=1, resources={"TPU": tp})
    else:
        resources = dict(num_cpus=1)
    one = dataclasses.replace(  # what each replica is: one engine in its process
        config,
        parallel=dataclasses.replace(
            p, data_parallel_size=1, data_parallel_backend="local", ray_address=None
        ),
    )
    actor_cls = ray.remote(ReplicaActor).options(
        **resources, scheduling_strategy="SPREAD", max_concurrency=100_000
    )
    actors = [actor_cls.remote(one, tokenizer_dir) for _ in range(p.data_parallel_size)]
    described = [a.describe.remote() for a in actors]
    replicas = []
    try:
        pending = list(described)
        while pending:  # no deadline (a big model loads and compiles for minutes): a report
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=STARTUP_REPORT_S)
            if pending:
                logger.warning(
                    "%d of %d replicas not ready after another %.0fs; each needs %s, the "
                    "cluster has %s free (a replica waits for a machine with room)",
                    len(pending),
                    len(actors),
                    STARTUP_REPORT_S,
                    resources,
                    ray.available_resources(),
                )
        for i, (actor, ref) in enumerate(zip(actors, described, strict=True)):
            replicas.append(RayReplica(actor, one, tokenizer_dir is not None, i, ray.get(ref)))
    except BaseException:
        for r in replicas:
            r.close(timeout=1)
        for a in actors:
            ray.kill(a)
        raise
    logger.info(
        "data-parallel: %d replicas on Ray (%s each): %s",
        len(replicas),
        resources,
        "; ".join(
            f"{r.where}: {r.model_info.kv_cache_tokens} KV tokens, max concurrency "
            f"{r.model_info.kv_cache_tokens / config.max_model_len:.2f}x at max_model_len"
            for r in replicas
        ),
    )
    return replicas
