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
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineConfig
from jaxserve.distributed.progress_watch import ProgressWatch
from jaxserve.engine import LLMEngine
from jaxserve.engine.startup import use_compilation_cache
from jaxserve.engine_stats import StatsSnapshot
from jaxserve.front import EngineDeadError, EngineState
from jaxserve.generate_request import GenerateRequest
from jaxserve.outputs import ModelInfo
from jaxserve.tokenizer import Tokenizer


class ControlReply(NamedTuple):
    """What `ReplicaActor.control` answers: the control's result or error (a value: its
    own class and fields, not Ray's wrapper), and the engine's state after it, read at
    `state_at` (the actor's monotonic clock, ns)."""

    result: Any
    error: Exception | None
    state: EngineState
    state_at: int


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

    def health(self) -> tuple[EngineState, int]:
        """Raises if the engine loop died, or showed no progress for step_timeout_s: its
        loop did not come round and its process did not compute (a step that hangs; one
        that is only long, a compile or a long prefill, goes on). Else the engine's state
        and when it was read (the actor's monotonic clock, ns): the front's handle keeps
        it too, so a control still running (a "wait" pause draining) shows in it."""
        if not self.engine.healthy:
            raise EngineDeadError(f"the engine loop stopped: {self.engine.error!r}")
        stuck = self._progress.stalled_for(self.engine.last_round)
        if stuck > self.step_timeout_s:
            raise EngineDeadError(
                f"the engine loop has not come round, nor its process computed, for "
                f"{stuck:.0f}s (step_timeout_s={self.step_timeout_s:g}): stalled"
            )
        return self.engine.state, time.monotonic_ns()

    async def control(self, name: str, args: dict[str, Any]) -> ControlReply:
        """Runs a control operation on the replica's engine (`AsyncLLMEngine.control`);
        the front's handle keeps the state it answers (as `health`'s), so that reading
        it asks no actor."""
        try:
            result, error = await self.engine.control(name, **args), None
        except Exception as e:  # the caller's to raise
            result, error = None, e
        return ControlReply(result, error, self.engine.state, time.monotonic_ns())

    def shutdown(self, timeout: float) -> None:
        self.engine.close(timeout)


__all__ = ["ReplicaActor"]
