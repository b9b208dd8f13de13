"""`EngineFront`: what the servers and `LLM` may use of an engine that serves asyncio
code. `AsyncLLMEngine` (one engine on its own thread), `DataParallelEngine`
(replicas behind a router) and `RayReplica` (one replica in a Ray actor) implement
it; a data-parallel front's replicas are fronts themselves.

The servers use nothing else: no reaching into the engine behind a front. An
operation a front cannot do, it says so in advance (`ModelInfo.can_transfer_kv`), so
that a server refuses at start-up a role it could not serve
(`server.disagg.check_role`).

Besides generating, a front runs control operations by name (`control`): pause and
resume, sleep and wake-up beside a trainer (RL rollouts), weight updates, prefix-cache
resets, LoRA adapters, profiles, and the KV pages disaggregated serving moves
(`export_prefix`, `import_pages`). `jaxserve.controls` declares each once (its
arguments, how the engine runs it, how replicas' results combine), so a front knows
none of them; its `NamedControls` gives Python users vLLM's named methods
(`pause_generation()`, `sleep()`, `update_weights()`, `add_lora()`, ...). A request
sent while the engine is paused waits for the resume, at most
`EngineConfig.pause_wait_s`; one sent while it sleeps is refused at once: both with
`EngineUnavailableError` (HTTP 503, gRPC UNAVAILABLE). `state` says which, without
asking the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from jaxserve.engine_stats import StatsSnapshot
from jaxserve.generate_request import GenerateRequest
from jaxserve.outputs import ModelInfo, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an unexpected error; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request: an unexpected error in its host work
    (detokenizer, grammar, logprobs, stop checks, sampler rows), named in the message.
    The engine serves on. `output` is the request's last output (`error` set, its
    unfinished samples "abort"), where there is one."""

    def __init__(self, message: str, output: RequestOutput | None = None):
        super().__init__(message)
        self.output = output


class EngineUnavailableError(RuntimeError):
    """The engine takes no request now: it is paused (`pause_generation`; a request
    waited `pause_wait_s` for `resume_generation` in vain) or sleeping (`sleep`), or it
    woke without weights and waits for `update_weights`. The message says which. It
    serves again once resumed, woken, or given weights: retry then."""


class EngineStateError(RuntimeError):
    """A pause, sleep or wake-up the engine's state forbids now, e.g. `sleep` while
    requests run (pause or abort them first); the message says what to do."""


@dataclasses.dataclass(frozen=True)
class EngineState:
    """A front's engine state (`EngineFront.state`): what the servers answer after a
    control, field for field. Each field's `combine` makes a data-parallel front's
    from its replicas'."""

    is_paused: bool = dataclasses.field(default=False, metadata={"combine": any})
    is_sleeping: bool = dataclasses.field(default=False, metadata={"combine": any})
    # The version of the weights served (0: those loaded at start-up); data-parallel:
    # the oldest a replica serves (all the same once an update returned).
    weight_version: int = dataclasses.field(default=0, metadata={"combine": min})

    @classmethod
    def of(cls, engine: Any) -> EngineState:
        """An `LLMEngine`'s (it has each field as an attribute)."""
        return cls(**{f.name: getattr(engine, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def combine(cls, states: Sequence[EngineState]) -> EngineState:
        """Replicas' states as one, each field by its `combine`."""
        return cls(
            **{
                f.name: f.metadata["combine"](getattr(s, f.name) for s in states)
                for f in dataclasses.fields(cls)
            }
        )


@runtime_checkable
class EngineFront(Protocol):
    @property
    def model_info(self) -> ModelInfo:
        """The served model and the engine's limits (fixed after start-up)."""
        ...

    @property
    def healthy(self) -> bool:
        """False once the engine (any replica) died or was shut down."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Why it is not healthy (None while it serves, or after a clean shutdown)."""
        ...

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished."""
        ...

    def stats(self) -> StatsSnapshot:
        """The engine's counters (summed over replicas)."""
        ...

    def replica_stats(self) -> list[StatsSnapshot]:
        """Each data-parallel replica's counters; empty for a front of one engine."""
        ...

    def validate(self, request: GenerateRequest) -> None:
        """Raises ValueError naming the field if the engine would refuse `request`
        (`generate` checks the same; a front end that must answer before the first
        output checks first)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs until it finishes. Raises ValueError for an
        invalid request, EngineDeadError once the engine died. Closing the stream
        before the end aborts the request."""
        ...

    def abort(self, request_id: str) -> None:
        """Stops a running request and frees its pages (unknown ids are ignored)."""
        ...

    @property
    def state(self) -> EngineState:
        """Whether the engine is paused or asleep, and the weights' version, read
        without asking the engine (data-parallel: the replicas' combined)."""
        ...

    def unavailable(self) -> EngineUnavailableError | None:
        """The error a request sent now gets at once: the engine sleeps, or is paused
        with `pause_wait_s` 0 (a server answers it before streaming). None when the
        request would be served, or would wait for `resume_generation`."""
        ...

    async def control(self, name: str, **args: Any) -> Any:
        """Runs the control operation `name` of `jaxserve.controls.CONTROLS` (pause,
        sleep, weights, adapters, ...: the table says what each takes and does) on the
        engine (every replica) with `args`; its result. Raises ValueError naming an
        unknown name or a bad argument before anything is sent, and what the engine
        raises (`EngineStateError`: its state forbids it now)."""
        ...

    def close(self, timeout: float = 10.0) -> None:
        """Stops the engine (every replica), waiting at most about `timeout` seconds, and
        releases what it holds: threads, executors, JAX monitoring listeners, device
        buffers, Ray actors (a disk KV tier is saved first). Idempotent."""
        ...


def cannot_transfer_kv(front: EngineFront) -> str:
    """What a front that cannot export or import KV pages says when asked to."""
    return (
        f"this engine front ({type(front).__name__}) does not transfer KV pages "
        "(the export_prefix and import_pages controls)"
    )
