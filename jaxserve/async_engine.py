"""AsyncLLMEngine: the engine behind asyncio code (the gRPC server).

One thread owns the engine and runs its loop (`LLMEngine.run`); nothing else
touches it. Coroutines hand it commands (add, abort) through a thread-safe queue
and read their request's outputs from their own asyncio queue. An add command
carries its stream, and the engine thread keeps its own map from the requests it
accepted to their streams (`_live`), so an output never reaches another request's
stream, even one that reuses the id of a request aborted a moment earlier. A
stream that is closed or cancelled before its request finished aborts the
request, which frees its pages within a step.

Control operations (`jaxserve.controls`: pause and sleep, weight updates, LoRA
adapters, ...) run on the engine thread like any command, as the table says (an
added adapter's files are read and checked on a worker thread first). A request that
arrives while generation is paused is held by the engine until the resume; the engine
thread gives up on it after `pause_wait_s` (aborting it, its stream ending with
EngineUnavailableError). While paused or asleep the loop waits for commands; it does
not spin.

Front ends use it only as a `jaxserve.front.EngineFront`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from jaxserve import controls
from jaxserve.controls import NamedControls
from jaxserve.engine import LLMEngine
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

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class OutputStream:
    """One request's outputs on their way from another thread to the coroutine that
    reads them on `loop`."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    closed: bool = False  # the client stopped reading (finished, cancelled or failed)

    def put(self, item) -> bool:
        """Hands `item` to the reader's loop; False if it was dropped: the reader
        stopped, or its loop is closed (or closes meanwhile). Never raises."""
        if self.closed:
            return False
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody will read this stream again
            self.closed = True
            return False
        return True


def _reply(future: asyncio.Future, result, error) -> None:
    """Settles `future` on its loop (from another thread); dropped if the loop closed."""
    with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits for it
        future.get_loop().call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class AsyncLLMEngine(NamedControls):
    """One engine behind the `EngineFront` interface; it exports and imports KV pages
    (disaggregated prefill and decode)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_info: ModelInfo = engine.model_info()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # the event loop's: ids in use by clients
        self._live: dict[str, OutputStream] = {}  # the engine thread's: requests it accepted
        # The engine thread's: requests a pause holds -> when they give up (monotonic),
        # and the callers waiting for a condition on the engine (a control's `until`).
        self._held: dict[str, float] = {}
        self._waiting: list[tuple[Callable[[LLMEngine], bool], asyncio.Future]] = []
        self._pause_wait_s = engine.config.pause_wait_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.last_round = time.monotonic()  # when the engine loop last took commands
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ client

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stats(self) -> StatsSnapshot:
        """A snapshot of the engine's counters (read from another thread: each value is
        current, the set may straddle a step)."""
        return self.engine.stats()

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished (queued commands included)."""
        return len(self._streams)

    def replica_stats(self) -> list[StatsSnapshot]:
        return []  # one engine, no replicas

    def validate(self, request: GenerateRequest) -> None:
        """Raises ValueError naming the field if the engine would refuse this request
        (`generate` checks the same; a front end that must answer before its first
        output, e.g. a stream's status line, checks first)."""
        self.engine.validate(request)  # reads only immutable state

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs until it finishes.

        Raises ValueError (before anything is queued) for an invalid request,
        and EngineDeadError if the engine loop has died.
        """
        if not self.healthy:
            raise self._dead()
        self.validate(request)
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        adapters = self.engine.adapters
        if (
            request.lora is not None
            and adapters is not None
            and request.lora not in adapters.loaded()
        ):
            # An adapter the engine does not hold (first named, or dropped from host
            # memory since) is read on a worker thread, the steps going on; the engine
            # thread keeps it. (Dropped again before the request is queued, it is read
            # there, bounded and checked all the same.)
            await self.control("add_lora", request=request.lora)
        stream = OutputStream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            stream.closed = True
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine's thread between two steps; its result."""
        if not self.healthy:
            raise self._dead()
        future = asyncio.get_running_loop().create_future()
        self._send(("call", fn, future))
        return await future

    # ----------------------------------------------------------------- controls

    @property
    def state(self) -> EngineState:
        return EngineState.of(self.engine)  # (values the engine thread sets)

    def unavailable(self) -> EngineUnavailableError | None:
        error = self.engine.refusal()
        if error is None and self.engine.is_paused and self._pause_wait_s <= 0:
            error = paused_error(0)
        return error

    async def control(self, name: str, **args: Any) -> Any:
        """Runs the control `name` as `jaxserve.controls` declares it: its arguments
        checked here, its `read` on a worker thread, its `run` on the engine thread
        between two steps (or here, for a read of what the engine publishes; or on a
        worker thread); returns once its `until` holds."""
        op = controls.get(name)
        args = op.bind(self, self.engine.config, args)
        if op.thread == "any":
            return op.run(self.engine, **args)
        if op.thread == "worker":
            return await asyncio.to_thread(op.run, self.engine, **args)
        if op.read is None:
            result = await self.call(lambda e: op.run(e, **args))
        else:
            read = await asyncio.to_thread(op.read, self.engine, **args)
            result = await self.call(lambda e: op.run(e, read, **args))
        if op.until is not None:
            future = asyncio.get_running_loop().create_future()
            self._send(("until", lambda e: op.until(e, **args), future))
            await future
        return result

    def close(self, timeout: float = 10.0) -> None:
        """Stops the engine thread, waiting at most about `timeout` seconds for the step
        it is in, then closes the engine (`LLMEngine.close`: a disk KV tier saved for a
        restart; its threads, JAX listeners and device buffers released). Streams still
        open end with EngineDeadError. Idempotent. If the step outlasts `timeout`, the
        engine thread closes the engine when the step ends."""
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(
                "the engine thread did not stop within %.0fs; it closes the engine when its "
                "step ends",
                timeout,
            )
            return
        self.engine.close()  # (done already by the thread, as it stopped)

    def __enter__(self) -> AsyncLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _dead(self) -> EngineDeadError:
        if self.error is None:
            return EngineDeadError("the engine was shut down")
        return EngineDeadError(f"the engine loop stopped: {self.error!r}")

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------ engine thread

    def _drain_commands(self) -> None:
        self.last_round = time.monotonic()  # once a step, or every _idle wait
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "until":
                self._waiting.append((command[1], command[2]))
            elif command[0] == "call":
                _, fn, future = command
                try:
                    result, error = fn(self.engine), None
                except Exception as e:  # the caller's error; the engine is fine
                    result, error = None, e
                _reply(future, result, error)
            elif command[0] == "add":
                _, request, stream = command
                if stream.closed:
                    continue  # cancelled before it reached the engine
                refused = self.unavailable()  # asleep; paused, with no wait allowed
                if refused is not None:
                    stream.put(refused)
                    continue
                try:
                    self.engine.add_request(request)
                except EngineUnavailableError as e:
                    stream.put(e)
                except (ValueError, TypeError) as e:  # this request is bad; the engine is fine
                    stream.put(e if isinstance(e, ValueError) else ValueError(str(e)))
                except Exception as e:  # this request failed alone; the engine is fine
                    message = (
                        f"request {request.request_id!r} failed on the engine while being "
                        f"added: {type(e).__name__}: {e}"
                    )
                    logger.exception("%s", message)
                    stream.put(RequestFailedError(message))
                else:
                    self._live[request.request_id] = stream
                    if self.engine.is_paused:  # held until the resume, or given up
                        self._held[request.request_id] = time.monotonic() + self._pause_wait_s
            else:
                self.engine.abort(command[1])
                self._live.pop(command[1], None)
                self._held.pop(command[1], None)
        self._expire_held()
        if self._waiting:
            self._waiting = [w for w in self._waiting if not self._settled(*w)]

    def _settled(self, holds: Callable[[LLMEngine], bool], future: asyncio.Future) -> bool:
        """Answers `future` if `holds(engine)` (or raised); whether it did."""
        try:
            if not holds(self.engine):
                return False
            _reply(future, None, None)
        except Exception as e:  # the caller's condition failed; the engine is fine
            _reply(future, None, e)
        return True

    def _expire_held(self) -> None:
        """Aborts the requests a pause has held for `pause_wait_s`; their streams end
        with EngineUnavailableError. (One the engine no longer holds started.)"""
        now = time.monotonic()
        for request_id, deadline in list(self._held.items()):
            if not self.engine.holds(request_id):
                del self._held[request_id]
            elif now >= deadline:
                del self._held[request_id]
                stream = self._live.pop(request_id, None)
                self.engine.abort(request_id)
                if stream is not None:
                    stream.put(paused_error(self._pause_wait_s))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._live.get(out.request_id)
        if stream is not None:
            item = out if out.error is None else RequestFailedError(out.error, out)
            if not stream.put(item):
                # Its reader is gone: a closed event loop never ran generate's cleanup,
                # which would have forgotten the stream (it counts in num_requests).
                if self._streams.get(out.request_id) is stream:
                    self._streams.pop(out.request_id, None)
                if not out.finished:
                    self.engine.abort(out.request_id)
                    self._live.pop(out.request_id, None)
        if out.finished:
            self._live.pop(out.request_id, None)

    def _idle(self) -> None:
        timeout = 0.5  # (also how often `last_round` shows the loop alive)
        if self._held:  # a held request gives up on time
            timeout = min(timeout, max(min(self._held.values()) - time.monotonic(), 0.0))
        self._wake.wait(timeout=timeout)
        self._wake.clear()

    def _loop(self) -> None:
        try:
            self.engine.run(
                self._deliver, poll=self._drain_commands, idle=self._idle, stop=self._stop.is_set
            )
            end = EngineDeadError("the engine was shut down")
        except BaseException as e:  # the engine is broken: fail every stream, stay dead
            logger.exception("engine loop died")
            self.error = e
            end = EngineDeadError(f"the engine loop stopped: {e!r}")
        for stream in list(self._streams.values()):  # nobody waits forever
            stream.put(end)
        for _, future in self._waiting:
            _reply(future, None, end)
        if self._stop.is_set():  # closing: the engine's own thread releases it
            try:
                self.engine.close()
            except Exception:
                logger.exception("closing the engine failed")
