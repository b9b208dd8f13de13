"""`EngineFront`: what the servers and `LLM` may use of an engine that serves asyncio
code. `AsyncLLMEngine` (one engine on its own thread), `DataParallelEngine`
(replicas behind a router) and `RayReplica` (one replica in a Ray actor) implement
it; a data-parallel front's replicas are fronts themselves.

The servers use nothing else: no reaching into the engine behind a front. An
operation a front cannot do, it says so in advance (`can_transfer_kv`), so that a
server refuses at start-up a role it could not serve (`server.disagg.check_role`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, Self, runtime_checkable

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

    @property
    def can_transfer_kv(self) -> bool:
        """Whether `export_prefix` and `import_pages` work: the disaggregated prefill
        and decode roles need them."""
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

    async def export_prefix(self, token_ids: Sequence[int], salt: str | None) -> list[bytes]:
        """The encoded KV pages the engine holds of the prompt's full pages, in order up
        to the first it lacks (a prefill instance pushes them to a decode instance)."""
        ...

    async def import_pages(self, pages: list[bytes]) -> int:
        """Checks pushed KV pages and keeps them where admission finds them; returns
        how many. Raises ValueError (none kept) for a bad page or no tier."""
        ...

    def close(self, timeout: float = 10.0) -> None:
        """Stops the engine (every replica), waiting at most about `timeout` seconds, and
        releases what it holds: threads, executors, JAX monitoring listeners, device
        buffers, Ray actors (a disk KV tier is saved first). Idempotent."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """The same as `close` (the servers' name for it): one way to stop."""
        ...

    def __enter__(self) -> Self:
        """The front itself (`with front:` closes it at the end)."""
        ...

    def __exit__(self, *exc: object) -> None:
        """`close()`."""
        ...


def cannot_transfer_kv(front: EngineFront) -> str:
    """What a front that cannot export or import KV pages says when asked to."""
    return (
        f"this engine front ({type(front).__name__}) does not transfer KV pages "
        "(export_prefix, import_pages)"
    )
