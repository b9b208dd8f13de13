"""What every front end (gRPC, HTTP) does around the engine, in one place.

A front end turns its request into a prompt (`jaxserve.inputs.parse_prompt`) and
`SamplingParams`, builds one `GenerateRequest`, then calls `admit` and `stream`:
they refuse requests the same way for every protocol (`Refused`, with a reason each
front end maps to its own status code) and record the same latency metrics.
A refused value's field travels as data (`jaxserve.sampling_params.ParamError`);
each front end reports it under its own name for it. A request's model name selects
its LoRA adapter the same way for both (`ServingState.lora_of`).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from jaxserve import controls
from jaxserve.front import (
    EngineDeadError,
    EngineFront,
    EngineStateError,
    EngineUnavailableError,
    RequestFailedError,
)
from jaxserve.generate_request import GenerateRequest
from jaxserve.lora import LoRARequest
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import ParamError
from jaxserve.tokenizer import Tokenizer
from server.lora_registry import LoRARegistry
from server.prometheus import ServerMetrics


class Reason(enum.Enum):
    INVALID = "invalid"  # a bad field: gRPC INVALID_ARGUMENT, HTTP 400
    OVERLOADED = "overloaded"  # past max_pending: RESOURCE_EXHAUSTED, 429
    UNAVAILABLE = "unavailable"  # loading, draining, paused, asleep, dead: UNAVAILABLE, 503
    CONFLICT = "conflict"  # the engine's state forbids it now: FAILED_PRECONDITION, 409
    FAILED = "failed"  # the engine failed this request alone (its cause named): INTERNAL, 500


class Refused(Exception):
    """A request the server will not serve; `reason` says why, the message how to fix it,
    and `param` names the request field at fault, where a front end knows it."""

    def __init__(self, reason: Reason, message: str, param: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.param = param


@dataclasses.dataclass
class ServingState:
    """What the front ends serve with; `engine` is None until the model is loaded."""

    tokenizer: Tokenizer | None = None
    engine: EngineFront | None = None
    model_name: str = ""
    max_pending: int = 1024
    draining: bool = False  # SIGTERM: running requests finish, new ones are refused
    # Roots under which an admin call may name a file of this machine (update_weights'
    # path, a LoRA adapter's lora_path); none: no call may (`--allowed_local_paths`).
    allowed_local_paths: tuple[str, ...] = ()
    loras: LoRARegistry = dataclasses.field(init=False)  # the adapters served, by name

    def __post_init__(self):
        self.loras = LoRARegistry(self.model_name)

    def lora_of(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model name selects: None for the base model (no
        name, the served name, or the model's directory). Raises
        `server.lora_registry.UnknownModelError` for any other name not loaded."""
        engine = self.engine
        if model is None or model == self.model_name:
            return None
        if engine is not None and model == engine.model_info.model_dir:
            return None
        return self.loras.named(model)


def ready(state: ServingState) -> EngineFront:
    """The engine, if it can take work; else raises Refused(UNAVAILABLE)."""
    engine = state.engine
    if engine is None:
        raise Refused(Reason.UNAVAILABLE, "the model is still loading")
    if not engine.healthy:
        raise Refused(Reason.UNAVAILABLE, f"the engine has stopped: {engine.error!r}")
    if state.draining:
        raise Refused(Reason.UNAVAILABLE, "the server is shutting down")
    return engine


def admit(state: ServingState, metrics: ServerMetrics, *, extra: int = 0) -> EngineFront:
    """The engine, if it is ready, takes requests now (not asleep; not paused with
    pause_wait_s 0: refused before a stream starts) and has room for `1 + extra` more."""
    engine = ready(state)
    refused = engine.unavailable()
    if refused is not None:
        metrics.rejected.labels("unavailable").inc()
        raise Refused(Reason.UNAVAILABLE, str(refused))
    if 1 + extra > state.max_pending:  # no retry could ever admit it
        raise invalid(
            metrics,
            f"prompt: a batch of {1 + extra} prompts is more than this server holds pending "
            f"at once ({state.max_pending}); send at most that many per request",
            "prompt",
        )
    if engine.num_requests + extra >= state.max_pending:
        metrics.rejected.labels("overloaded").inc()
        raise Refused(
            Reason.OVERLOADED,
            f"{engine.num_requests} requests pending (the bound is "
            f"{state.max_pending}); retry later",
        )
    return engine


def invalid(metrics: ServerMetrics, message: str, param: str | None = None) -> Refused:
    """Counts an invalid request; returns the Refused to raise."""
    metrics.rejected.labels("invalid").inc()
    return Refused(Reason.INVALID, message, param)


async def stream(
    engine: EngineFront, metrics: ServerMetrics, request: GenerateRequest
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request, with latency metrics recorded.

    Raises Refused (INVALID) if the engine's validation refuses the request, before
    anything ran, Refused (UNAVAILABLE) if the engine dies, and Refused (FAILED) if
    the engine failed this request alone. Closing the iterator
    early (a client that went away) aborts the request.
    """
    start = last = time.monotonic()
    first = True
    try:
        async for out in engine.generate(request):
            now = time.monotonic()
            if any(c.delta_token_ids for c in out.outputs):
                (metrics.ttft if first else metrics.itl).observe(now - last)
                first, last = False, now
            yield out
            if out.finished:
                metrics.e2e.observe(now - start)
                for c in out.outputs:
                    metrics.requests.labels(c.finish_reason).inc()
    except ValueError as e:
        raise invalid(metrics, str(e), getattr(e, "field", None)) from None
    except (EngineDeadError, EngineUnavailableError) as e:  # (a pause held it too long)
        raise Refused(Reason.UNAVAILABLE, str(e)) from None
    except RequestFailedError as e:  # the engine serves on
        raise Refused(Reason.FAILED, str(e)) from None


async def lifecycle(
    state: ServingState, metrics: ServerMetrics, call: Callable[[EngineFront], Awaitable[object]]
) -> EngineFront:
    """Runs `call(engine)`, an engine control (`control`) or a LoRA adapter load or
    unload (`server.lora_registry`) of the ready engine, for either protocol; returns
    the engine. Raises Refused: INVALID for a bad mode, level, path or adapter (naming
    it), CONFLICT where the engine's state forbids it (sleep with requests running),
    UNAVAILABLE if the engine is not ready or dies meanwhile."""
    engine = ready(state)
    try:
        await call(engine)
    except ValueError as e:
        raise invalid(metrics, str(e), getattr(e, "field", None)) from None
    except EngineStateError as e:
        raise Refused(Reason.CONFLICT, str(e)) from None
    except (EngineDeadError, EngineUnavailableError) as e:
        raise Refused(Reason.UNAVAILABLE, str(e)) from None
    return engine


def local_path(state: ServingState, field: str, path: str) -> str:
    """`path`, a file of this machine that a call names, resolved (links followed) if
    it lies under one of `state.allowed_local_paths`; else ParamError naming `field`.
    The refusal is the same whether the path exists or not (it probes nothing)."""
    real = os.path.realpath(path)
    for root in state.allowed_local_paths:
        root = os.path.realpath(root)
        if os.path.commonpath([real, root]) == root:
            return real
    roots = ", ".join(state.allowed_local_paths) or "none given"
    raise ParamError(
        field,
        f"{field} {path!r} is not under the roots this server reads from "
        f"(--allowed_local_paths: {roots})",
    )


async def control(
    state: ServingState, metrics: ServerMetrics, name: str, args: dict[str, Any]
) -> EngineFront:
    """Runs the engine control `name` (`jaxserve.controls`) with the arguments a request
    gave (the others take the table's defaults), through `lifecycle`; returns the
    engine. A path argument (`Arg.local_path`: a trainer's checkpoint) is required and
    taken only under `allowed_local_paths`, and an engine refusal that names no field
    names it (a bad directory, a checkpoint of another model)."""
    paths = [a for a in controls.get(name).args if a.local_path]

    async def call(engine: EngineFront) -> object:
        given = dict(args)
        for a in paths:
            if not given.get(a.name):
                raise ParamError(a.name, f"{a.name} is required: {a.doc}")
            given[a.name] = local_path(state, a.name, given[a.name])
        try:
            return await engine.control(name, **given)
        except ValueError as e:
            if getattr(e, "field", None) is not None or not paths:
                raise
            field, value = paths[0].name, args[paths[0].name]
            message = str(e) if str(e).startswith(field) else f"{field} {value!r}: {e}"
            notes = getattr(e, "__notes__", [])  # (which data-parallel replica)
            raise ParamError(field, " ".join([message, *notes])) from None

    return await lifecycle(state, metrics, call)


def load_lora(state: ServingState, name: str, path: str) -> Callable[[EngineFront], Awaitable]:
    """Loading the adapter at `path` (under `allowed_local_paths`) as `name`, for
    `lifecycle` (`server.lora_registry` checks the rest)."""

    async def call(engine: EngineFront):
        return await state.loras.load(
            engine, name, path, resolve=lambda p: local_path(state, "lora_path", p)
        )

    return call


def deltas(out: RequestOutput, reported: set[int]) -> Iterator[CompletionOutput]:
    """The samples of `out` a stream sends now: those with new tokens, and those that
    finished without one. A sample's finish is sent once (`reported` holds the indexes
    sent): with n > 1 an output carries every sample, finished ones too."""
    for c in out.outputs:
        if not c.delta_token_ids and (not c.finished or c.index in reported):
            continue
        if c.finished:
            reported.add(c.index)
        yield c
