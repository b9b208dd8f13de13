"""Data parallelism: M engine replicas, each on its own slice of the devices, behind
one front that the servers use like an `AsyncLLMEngine`.

Locally (`data_parallel_backend="local"`) replica i serves on devices
[i * tp, (i + 1) * tp) (tp = tensor_parallel_size), with its own scheduler, page
pool and engine thread; with "ray" each replica is an engine in a Ray actor on a
machine of a Ray cluster (`jaxserve.distributed.ray_replicas`). The scheduler never knows it
has siblings. `DataParallelEngine` routes each request to a replica:

- prefix affinity: `PrefixRouter` remembers, per replica, the chained keys of the
  full prompt pages it sent there (the same keys the page pool caches under), so a
  request whose prompt starts with pages a replica has already computed goes there,
  where the prefix cache can hit;
- load: otherwise (or when that replica is busier than the least-loaded one by more
  than `max_imbalance` requests) the replica with the fewest requests in flight.

Metrics come per replica (`replica_stats()`) and in total (`stats()`). Control
operations (pause, sleep, weight updates, LoRA adapters, ...) go to every replica and
return once all have done them, their results combined as `jaxserve.controls`
declares; the front knows none of them. Every replica gets the same weight version.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any, TypeVar

import jax

from jaxserve import controls
from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineConfig
from jaxserve.controls import NamedControls
from jaxserve.distributed import meshes
from jaxserve.engine import LLMEngine
from jaxserve.engine_stats import StatsSnapshot
from jaxserve.front import (
    EngineDeadError,
    EngineFront,
    EngineState,
    EngineUnavailableError,
    RequestFailedError,
)
from jaxserve.generate_request import GenerateRequest
from jaxserve.kv.page_pool import ROOT_UID
from jaxserve.outputs import ModelInfo, RequestOutput
from jaxserve.tokenizer import Tokenizer

T = TypeVar("T")


class PrefixRouter:
    """Picks a replica for each prompt: the one that computed its longest prefix of
    full pages, unless that one is too busy; else the least loaded. Pure host logic.

    Each replica remembers at most `capacity` page keys (least recently routed
    forgotten first), about what its page pool can keep cached.
    """

    def __init__(self, num_replicas: int, *, page_size: int, capacity: int, max_imbalance: int = 8):
        self.page_size, self.capacity, self.max_imbalance = page_size, capacity, max_imbalance
        self._keys = [collections.OrderedDict() for _ in range(num_replicas)]
        self.routed = [0] * num_replicas
        self.affinity_hits = 0  # requests sent where a prefix of theirs was

    def page_keys(self, token_ids: Sequence[int], salt: Hashable = None) -> list[Hashable]:
        """The chained keys of the prompt's full pages but the last token's page (as
        the scheduler looks up: the last prompt token is always computed)."""
        keys, parent = [], ROOT_UID
        for start in range(0, len(token_ids) - self.page_size, self.page_size):
            parent = hash((parent, tuple(token_ids[start : start + self.page_size]), salt))
            keys.append(parent)
        return keys

    def route(self, token_ids: Sequence[int], loads: Sequence[int], salt: Hashable = None) -> int:
        keys = self.page_keys(token_ids, salt)
        matched = []
        for held in self._keys:
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            matched.append(n)
        least = min(range(len(loads)), key=lambda i: (loads[i], self.routed[i]))
        best = max(range(len(loads)), key=lambda i: (matched[i], -loads[i]))
        choice = least
        if matched[best] > 0 and loads[best] - loads[least] <= self.max_imbalance:
            choice = best
            self.affinity_hits += 1
        held = self._keys[choice]
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)
        self.routed[choice] += 1
        return choice


def data_parallel_engine(
    config: EngineConfig, tokenizer: Tokenizer | None, tokenizer_dir: str | None
) -> DataParallelEngine:
    """`config.parallel.data_parallel_size` replicas behind one front: in this process
    on this host's devices (`data_parallel_backend="local"`), or each in a Ray actor
    on a machine of a Ray cluster ("ray": `jaxserve.distributed.ray_replicas`, where each replica
    loads its own tokenizer from `tokenizer_dir`)."""
    if config.parallel.data_parallel_backend == "ray":
        from jaxserve.distributed.ray_replicas import ray_replicas

        return DataParallelEngine(ray_replicas(config, tokenizer_dir), config)
    engines = replica_engines(config, tokenizer)
    return DataParallelEngine([AsyncLLMEngine(e) for e in engines], config)


def replica_engines(
    config: EngineConfig, tokenizer: Tokenizer | None, devices=None
) -> list[LLMEngine]:
    """`config.parallel.data_parallel_size` engines, replica i on devices
    [i * tp, (i + 1) * tp) of `devices` (default: all of them)."""
    p = config.parallel
    devices = list(jax.devices() if devices is None else devices)
    if p.world_size > len(devices):
        raise ValueError(
            f"data_parallel_size={p.data_parallel_size} x tensor_parallel_size="
            f"{p.tensor_parallel_size} needs {p.world_size} devices; {len(devices)} are "
            f"available ({devices[0].platform})"
        )
    tp = p.tensor_parallel_size
    engines: list[LLMEngine] = []
    try:
        for i in range(p.data_parallel_size):
            mesh = meshes.make_mesh(1, tp, devices[i * tp : (i + 1) * tp])
            engines.append(LLMEngine(config, tokenizer, mesh))
    except BaseException:  # the replicas made so far are released
        for engine in engines:
            engine.close()
        raise
    return engines


class DataParallelEngine(NamedControls):
    """M replicas behind one `EngineFront`. A replica is an `EngineFront` itself: an
    `AsyncLLMEngine` (local) or a `jaxserve.distributed.ray_replicas.RayReplica`.

    It does not transfer KV pages (`model_info.can_transfer_kv` is False): which
    replica holds a prefix, or should receive pushed pages, is not routed yet, so a
    server refuses the disaggregated prefill and decode roles over it at start-up."""

    def __init__(self, replicas: list[EngineFront], config: EngineConfig):
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = list(replicas)
        self.config = config
        page_size = config.cache.page_size
        self.router = PrefixRouter(
            len(replicas),
            page_size=page_size,
            capacity=min(r.model_info.kv_cache_tokens for r in replicas) // page_size,
            max_imbalance=config.scheduler.max_num_seqs,
        )
        self._lock = threading.Lock()  # routing may come from several event loops
        self._owner: dict[str, int] = {}  # request id -> its replica, while it runs
        self._loop: _LoopThread | None = None  # synchronous callers' (`run_sync`)
        self._closed = False
        info = self.replicas[0].model_info
        self.model_info: ModelInfo = dataclasses.replace(
            info,
            kv_cache_tokens=sum(r.model_info.kv_cache_tokens for r in self.replicas),
            data_parallel_size=len(replicas),
            num_devices=sum(r.model_info.num_devices for r in self.replicas),
            can_transfer_kv=False,
        )

    @property
    def healthy(self) -> bool:
        return all(r.healthy for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        """An error naming the first replica that failed or was shut down; None while
        all serve."""
        for i, r in enumerate(self.replicas):
            if r.error is not None:
                return EngineDeadError(f"data-parallel replica {i} stopped: {r.error!r}")
            if not r.healthy:
                return EngineDeadError(f"data-parallel replica {i} was shut down")
        return None

    @property
    def num_requests(self) -> int:
        return sum(r.num_requests for r in self.replicas)

    def replica_stats(self) -> list[StatsSnapshot]:
        return [r.stats() for r in self.replicas]

    def stats(self) -> StatsSnapshot:
        """The replicas' counters summed (requests per LoRA adapter by name); fractions
        averaged; compilations counted once (every replica's counter sees the whole
        process's)."""
        parts = self.replica_stats()
        total = {}
        for field in dataclasses.fields(StatsSnapshot):
            values = [getattr(s, field.name) for s in parts]
            if field.name in ("kv_cache_usage", "kv_waste_at_peak"):
                total[field.name] = sum(values) / len(values)
            elif field.name == "num_compiles":
                total[field.name] = max(values)
            elif field.name.startswith("lora_requests_"):  # (name, requests) pairs
                by_name: collections.Counter[str] = collections.Counter()
                for pairs in values:
                    by_name.update(dict(pairs))
                total[field.name] = tuple(sorted(by_name.items()))
            elif isinstance(values[0], list | tuple):
                width = max(len(v) for v in values)
                total[field.name] = type(values[0])(
                    sum(v[i] for v in values if i < len(v)) for i in range(width)
                )
            else:
                total[field.name] = sum(values)
        return StatsSnapshot(**total)

    def validate(self, request: GenerateRequest) -> None:
        self.replicas[0].validate(request)  # the replicas are identical

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Routes the request to a replica and streams its outputs from there."""
        if not self.healthy:
            raise self.error
        request_id = request.request_id
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request_id {request_id!r} is already in use")
            loads = [r.num_requests for r in self.replicas]
            i = self.router.route(request.prompt_token_ids, loads, request.cache_salt)
            self._owner[request_id] = i
        stream = self.replicas[i].generate(request)
        try:
            async for out in stream:
                yield out
        finally:
            # Closed now, not when the event loop finalizes it: a client that went away
            # is aborted at once, and may send its request id again at once.
            await stream.aclose()
            with self._lock:
                self._owner.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)

    # ----------------------------------------------------------------- controls

    @property
    def state(self) -> EngineState:
        return EngineState.combine([r.state for r in self.replicas])

    def unavailable(self) -> EngineUnavailableError | None:
        return next((e for r in self.replicas if (e := r.unavailable()) is not None), None)

    async def control(self, name: str, **args: Any) -> Any:
        """Runs the control `name` on every replica at once, as `jaxserve.controls`
        declares it: its arguments checked first and made to agree (one weight
        version), the replicas' results combined. A replica that failed keeps its
        old state and its error is raised, naming it; the others have done it."""
        op = controls.get(name)
        args = op.bind(self, self.config, args)
        if op.agree is not None:
            args = op.agree([r.state for r in self.replicas], args)
        return op.combine(await self._on_every_replica(lambda r: r.control(name, **args)))

    async def _on_every_replica(self, call: Callable[[EngineFront], Awaitable[T]]) -> list[T]:
        """Runs `call` on every replica at once and waits for all of them (none is left
        running when one fails); their results, or the first replica's error, naming it."""
        results = await asyncio.gather(*(call(r) for r in self.replicas), return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                if len(self.replicas) > 1:
                    result.add_note(f"(data-parallel replica {i} of {len(self.replicas)})")
                raise result
        return results  # type: ignore[return-value]  (no exception among them)

    def close(self, timeout: float = 10.0) -> None:
        """Closes every replica (each waits at most about `timeout` seconds), then the
        event loop thread of synchronous callers. Idempotent."""
        for r in self.replicas:
            r.close(timeout)
        with self._lock:
            loop, self._loop = self._loop, None
            self._closed = True
        if loop is not None:
            loop.close()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` to its end on this front's own event loop thread, for synchronous
        callers, which may be inside a running event loop themselves (Jupyter), where
        `asyncio.run` fails. The one loop serves every call until `close`. If the
        caller is interrupted, the coroutine is cancelled (its requests aborted)."""
        if not self.healthy:  # (shut down: no loop is started again)
            coro.close()
            raise self.error
        with self._lock:
            if self._closed:  # (closed meanwhile)
                coro.close()
                raise EngineDeadError("the data-parallel engine was closed")
            if self._loop is None:
                self._loop = _LoopThread()
            loop = self._loop
        return loop.run(coro)


class _LoopThread:
    """An event loop running on a thread of its own until `close`."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="jaxserve-data-parallel-loop", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise EngineDeadError("the data-parallel engine was closed") from None
        except BaseException:  # KeyboardInterrupt included: stop the coroutine too
            future.cancel()
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Cancels what still runs on the loop (its callers get EngineDeadError, rather
        than waiting forever on a stopped loop), then stops it."""

        async def cancel_the_rest() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(concurrent.futures.TimeoutError):
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def stream_all(
    front: DataParallelEngine,
    requests: Sequence[GenerateRequest],
    on_output: Callable[[int, RequestOutput], None],
) -> None:
    """Sends every request through the front at once and calls `on_output(i, out)` for
    each output of request i, until all finished: for synchronous callers
    (`LLM.generate`, the offline bench), on the front's own loop (`run_sync`). A
    request the engine failed alone (`RequestFailedError`) gives its last output,
    whose `error` names the cause; any other error ends every request and is raised."""

    async def one(i: int) -> None:
        try:
            async for out in front.generate(requests[i]):
                on_output(i, out)
        except RequestFailedError as e:
            if e.output is None:
                raise
            on_output(i, e.output)

    async def run_all() -> None:
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(requests))]
        try:
            await asyncio.gather(*tasks)
        finally:  # on an error, the other requests stop too (aborted)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    front.run_sync(run_all())
