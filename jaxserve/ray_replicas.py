"""Data-parallel replicas on a Ray cluster (`data_parallel_backend="ray"`): each
replica an `LLMEngine` in its own Ray actor process, placed on a machine of the
cluster, behind the same `DataParallelEngine` front as local replicas.

The front (the process that serves gRPC/HTTP, tokenizes prompts and routes) holds
one `RayReplica` per actor. It validates requests itself (`validate_request`, with
the replica's pool size), streams each request's outputs from its actor (a Ray
streaming generator over the actor's `AsyncLLMEngine`), aborts by cancelling that
stream, and checks every replica's health every `HEALTH_INTERVAL_S`: a replica whose
actor died, whose engine stopped, or that does not answer within
`ParallelConfig.step_timeout_s` is failed, and so is every request in flight on it
(EngineDeadError naming the replica); the front then reports unhealthy (the servers
go NOT_SERVING), as a dead local replica or multi-host follower does.

Why Ray: it is what vLLM uses for the same job, so operators of GPU/TPU clusters
already run it; it places each replica by the resources it needs (GPUs, TPU chips,
CPUs) on whichever machine has them, sets the actor's visible devices, restarts
nothing behind our back, tells the caller at once when an actor's process or node
dies, and carries Python objects (the requests' parameters, the streamed outputs)
without a protocol of ours. JAX's own distributed runtime is for one program over
one mesh (multi-host TP, `jaxserve.multihost`), not for independent replicas that
come and go.

Each replica takes `tensor_parallel_size` GPUs (`num_gpus`) or TPU chips (resource
"TPU") when the cluster has them, else one CPU; replicas are spread over the
machines. Every machine needs jaxserve installed and the model directory at the same
path (as multi-host serving does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator

from jaxserve.async_engine import AsyncLLMEngine, EngineDeadError
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine, validate_request
from jaxserve.metrics import StatsSnapshot
from jaxserve.outputs import ModelInfo, RequestOutput
from jaxserve.request import ResumedSample
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0  # how often the front asks each replica whether it is alive
STATS_TIMEOUT_S = 5.0  # a metrics scrape waits this long for a replica's counters


class ReplicaActor:
    """One replica's engine, in its own Ray actor process (an async actor: these
    methods run on the actor's event loop; the engine steps on its own thread)."""

    def __init__(self, config: EngineConfig, tokenizer_dir: str | None):
        import ray

        tokenizer = Tokenizer(tokenizer_dir) if tokenizer_dir else None
        self.engine = AsyncLLMEngine(LLMEngine(config, tokenizer))
        node = ray.get_runtime_context().get_node_id()
        self.where = f"{socket.gethostname()} pid {os.getpid()} node {node[:12]}"
        self.node_id = node

    def describe(self) -> tuple[ModelInfo, int, str, str]:
        """(model info, the pool's pages, where it runs, its Ray node id)."""
        return self.engine.model_info, self.engine.engine.pool.capacity, self.where, self.node_id

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, kw: dict
    ) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(request_id, prompt_token_ids, params, **kw):
            yield out

    def stats(self) -> StatsSnapshot:
        return self.engine.stats()

    def health(self) -> None:
        if not self.engine.healthy:
            raise EngineDeadError(f"the engine loop stopped: {self.engine.error!r}")

    def shutdown(self, timeout: float) -> None:
        self.engine.shutdown(timeout)


@dataclasses.dataclass(eq=False)
class _Waiter:
    """A request in flight on a replica: its stream, and how to wake its reader."""

    loop: asyncio.AbstractEventLoop
    dead: asyncio.Future
    stream: object  # ray's ObjectRefGenerator


class RayReplica:
    """The front's handle on one `ReplicaActor`, with the interface of an
    `AsyncLLMEngine` that `DataParallelEngine` uses."""

    def __init__(self, actor, config: EngineConfig, has_tokenizer: bool, index: int):
        import ray

        self.actor, self.config, self.index = actor, config, index
        self.has_tokenizer = has_tokenizer
        info, self.pool_capacity, self.where, self.node_id = ray.get(actor.describe.remote())
        self.model_info: ModelInfo = info
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._last_stats: StatsSnapshot = ray.get(actor.stats.remote())
        self._stop = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch, name=f"jaxserve-ray-replica-{index}", daemon=True
        )
        self._monitor.start()

    @property
    def healthy(self) -> bool:
        return self.error is None

    @property
    def num_requests(self) -> int:
        return len(self._waiters)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(
            self.config, self.pool_capacity, self.has_tokenizer, list(prompt_token_ids), params
        )

    def stats(self) -> StatsSnapshot:
        """The replica's counters (its last known ones if it does not answer in time)."""
        import ray

        if self.healthy:
            try:
                self._last_stats = ray.get(self.actor.stats.remote(), timeout=STATS_TIMEOUT_S)
            except Exception as e:  # the health check decides whether it is dead
                logger.warning("replica %d (%s): no stats: %r", self.index, self.where, e)
        return self._last_stats

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        resume: list[ResumedSample] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs from the replica until it finishes; raises
        EngineDeadError as soon as the replica is failed."""
        import ray

        self._check_alive()
        self.validate(prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        kw = dict(prompt=prompt, priority=priority, cache_salt=cache_salt, resume=resume)
        stream = self.actor.generate.options(num_returns="streaming").remote(
            request_id, list(prompt_token_ids), params, kw
        )
        waiter = _Waiter(loop, loop.create_future(), stream)
        with self._lock:
            if request_id in self._waiters:
                ray.cancel(stream)
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._waiters[request_id] = waiter
        finished = False
        try:
            while not finished:
                ref = asyncio.ensure_future(stream.__anext__())
                await asyncio.wait({ref, waiter.dead}, return_when=asyncio.FIRST_COMPLETED)
                if not ref.done():
                    ref.cancel()
                    self._check_alive()
                try:
                    out = await (await ref)
                except StopAsyncIteration:
                    return  # cancelled (aborted) before it finished
                except ray.exceptions.TaskCancelledError:
                    return
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause
                    if isinstance(cause, ray.exceptions.TaskCancelledError):
                        return  # aborted
                    if isinstance(cause, ValueError) and not isinstance(cause, EngineDeadError):
                        raise cause from None  # this request was bad; the replica is fine
                    self._fail(cause or e)
                    self._check_alive()
                except ray.exceptions.RayError as e:  # the actor, or its machine, is gone
                    self._fail(e)
                    self._check_alive()
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._waiters.pop(request_id, None)
            if not finished:
                ray.cancel(stream)  # the actor's stream closes: its engine aborts it

    def abort(self, request_id: str) -> None:
        import ray

        waiter = self._waiters.get(request_id)
        if waiter is not None:
            ray.cancel(waiter.stream)

    def shutdown(self, timeout: float = 10.0) -> None:
        import ray

        self._stop.set()
        try:
            ray.get(self.actor.shutdown.remote(timeout), timeout=timeout + 5)
        except Exception as e:
            logger.warning("replica %d (%s): shutdown: %r", self.index, self.where, e)
        ray.kill(self.actor)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(
                f"data-parallel replica {self.index} on {self.where} failed: {self.error!r}"
            )

    def _fail(self, error: BaseException) -> None:
        """Marks the replica dead (once) and wakes every request in flight on it."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            waiters = list(self._waiters.values())
        logger.error("data-parallel replica %d on %s failed: %r", self.index, self.where, error)
        for w in waiters:
            w.loop.call_soon_threadsafe(_wake, w.dead)

    def _watch(self) -> None:
        import ray

        timeout = self.config.parallel.step_timeout_s
        while not self._stop.wait(HEALTH_INTERVAL_S) and self.error is None:
            try:
                ray.get(self.actor.health.remote(), timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                self._fail(TimeoutError(f"no answer to a health check within {timeout:.0f}s"))
            except ray.exceptions.RayTaskError as e:
                self._fail(e.cause or e)
            except Exception as e:  # the actor or its node died
                if not self._stop.is_set():
                    self._fail(e)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


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
        ray.init(address=p.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    cluster = ray.cluster_resources()
    tp = p.tensor_parallel_size
    if cluster.get("GPU", 0) >= 1:
        resources = dict(num_cpus=1, num_gpus=tp)
    elif cluster.get("TPU", 0) >= 1:
        resources = dict(num_cpus=1, resources={"TPU": tp})
    else:
        resources = dict(num_cpus=1)
    one = dataclasses.replace(config, parallel=dataclasses.replace(p, data_parallel_size=1))
    actor_cls = ray.remote(ReplicaActor).options(
        **resources, scheduling_strategy="SPREAD", max_concurrency=100_000
    )
    actors = [actor_cls.remote(one, tokenizer_dir) for _ in range(p.data_parallel_size)]
    try:
        replicas = [RayReplica(a, one, tokenizer_dir is not None, i) for i, a in enumerate(actors)]
    except Exception:
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
