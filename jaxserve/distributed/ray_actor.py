"""The actor of a data-parallel replica on a Ray cluster (`jaxserve.distributed.ray_replicas`
holds the front's side of it, `RayReplica`, and places the actors): one `LLMEngine`
behind an `AsyncLLMEngine` in the actor's process, its requests in under keys the front
gives them, their outputs out on one stream."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import os
import socket
from collections.abc import AsyncIterator

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineConfig
from jaxserve.distributed.progress_watch import ProgressWatch
from jaxserve.engine import LLMEngine
from jaxserve.engine.startup import use_compilation_cache
from jaxserve.engine_stats import StatsSnapshot
from jaxserve.front import EngineDeadError
from jaxserve.generate_request import GenerateRequest
from jaxserve.lora import LoRARequest
from jaxserve.outputs import ModelInfo
from jaxserve.tokenizer import Tokenizer


class ReplicaActor:
    """One replica's engine, in its own Ray actor process (an async actor: these
    methods run on the actor's event loop; the engine steps on its own thread).

    Requests come in through `add` and `abort`, each under a key the front gives it
    (unique for the actor's life: a request id the client reuses is another request);
    every request's outputs go out through one stream, `outputs`, as (key, payload)
    pairs in batches of all that are ready: one Ray object for a step's outputs, not
    one a token, whose cost would take the CPU the engines need."""

    def __init__(self, config: EngineConfig, tokenizer_dir: str | None):
        import ray

        if config.compilation_cache_dir and not config.compiled_dir:
            # This process's edge: the front's cache (an engine never sets it).
            use_compilation_cache(config.compilation_cache_dir)
        tokenizer = Tokenizer(tokenizer_dir) if tokenizer_dir else None
        self.engine = AsyncLLMEngine(LLMEngine(config, tokenizer))
        self.step_timeout_s = config.parallel.step_timeout_s
        self._progress = ProgressWatch(window_s=self.step_timeout_s)
        node = ray.get_runtime_context().get_node_id()
        self.where = f"{socket.gethostname()} pid {os.getpid()} node {node[:12]}"
        self.node_id = node
        self._outbox: asyncio.Queue | None = None  # made on the actor's event loop
        self._tasks: dict[int, asyncio.Task] = {}
        # Keys aborted before their add ran (Ray does not order an async actor's
        # calls); a few stay behind when an abort crosses the request's end.
        self._early_aborts: collections.OrderedDict[int, None] = collections.OrderedDict()

    def describe(self) -> tuple[ModelInfo, int, str, str]:
        """(model info, the pool's pages, where it runs, its Ray node id)."""
        return (
            self.engine.model_info,
            self.engine.engine.scheduler.kv.capacity,
            self.where,
            self.node_id,
        )

    def _queue(self) -> asyncio.Queue:
        if self._outbox is None:
            self._outbox = asyncio.Queue()
        return self._outbox

    async def add(self, key: int, request: GenerateRequest) -> None:
        if key in self._early_aborts:
            del self._early_aborts[key]
            self._queue().put_nowait((key, None))
            return
        task = asyncio.create_task(self._run(key, request))
        self._tasks[key] = task
        task.add_done_callback(functools.partial(self._done, key))

    async def _run(self, key: int, request: GenerateRequest) -> None:
        outbox = self._queue()
        # Unique in the engine, the client's id readable.
        request = dataclasses.replace(request, request_id=f"{request.request_id}#{key}")
        try:
            async for out in self.engine.generate(request):
                outbox.put_nowait((key, out))
        except asyncio.CancelledError:  # aborted: the engine dropped it
            outbox.put_nowait((key, None))
        except Exception as e:  # this request's error, or the engine's end
            outbox.put_nowait((key, e))

    def _done(self, key: int, task: asyncio.Task) -> None:
        self._tasks.pop(key, None)
        if task.cancelled():  # aborted before it started: _run said nothing
            self._queue().put_nowait((key, None))

    async def abort(self, key: int) -> None:
        task = self._tasks.get(key)
        if task is not None:
            task.cancel()
            return
        self._early_aborts[key] = None
        while len(self._early_aborts) > 10_000:
            self._early_aborts.popitem(last=False)

    async def outputs(self) -> AsyncIterator[list]:
        """Every request's (key, RequestOutput | error | None for aborted) pairs, in
        batches of all that are ready."""
        outbox = self._queue()
        while True:
            batch = [await outbox.get()]
            while not outbox.empty():
                batch.append(outbox.get_nowait())
            yield batch

    def stats(self) -> StatsSnapshot:
        return self.engine.stats()

    def health(self) -> None:
        """Raises if the engine loop died, or showed no progress for step_timeout_s: its
        loop did not come round and its process did not compute (a step that hangs; one
        that is only long, a compile or a long prefill, goes on)."""
        if not self.engine.healthy:
            raise EngineDeadError(f"the engine loop stopped: {self.engine.error!r}")
        stuck = self._progress.stalled_for(self.engine.last_round)
        if stuck > self.step_timeout_s:
            raise EngineDeadError(
                f"the engine loop has not come round, nor its process computed, for "
                f"{stuck:.0f}s (step_timeout_s={self.step_timeout_s:g}): stalled"
            )

    # Pause, sleep and weight updates: the replica's engine does them (`AsyncLLMEngine`);
    # the front's handle keeps their state (`RayReplica.is_paused`, `weight_version`), so
    # that reading it asks no actor.

    async def pause_generation(self, mode: str) -> None:
        await self.engine.pause_generation(mode)

    async def resume_generation(self) -> None:
        await self.engine.resume_generation()

    async def sleep(self, level: int, keep_host_copy: bool) -> None:
        await self.engine.sleep(level, keep_host_copy)

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def update_weights(self, path: str | None, weight_version: int | None) -> int:
        return await self.engine.update_weights(path=path, weight_version=weight_version)

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def add_lora(self, request: LoRARequest) -> bool:
        return await self.engine.add_lora(request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def shutdown(self, timeout: float) -> None:
        self.engine.close(timeout)


__all__ = ["ReplicaActor"]
