"""`EngineFront`: what the servers and `LLM` may use of an engine that serves asyncio
code. `AsyncLLMEngine` (one engine on its own thread), `DataParallelEngine`
(replicas behind a router) and `RayReplica` (one replica in a Ray actor) implement
it; a data-parallel front's replicas are fronts themselves.

The servers use nothing else: no reaching into the engine behind a front. An
operation a front cannot do, it says so in advance (`can_transfer_kv`), so that a
server refuses at start-up a role it could not serve (`server.disagg.check_role`).

Beside a trainer (RL rollouts), a front pauses generation around a weight update and
gives the device memory back (`pause_generation`, `sleep`; `jaxserve.engine.lifecycle`
says what each mode and level does), and takes new weights (`update_weights`:
`jaxserve.engine.weight_sync` says what becomes of the requests running and of the
KV). A request sent while the engine is paused waits for `resume_generation`, at most
`EngineConfig.pause_wait_s`; one sent while it sleeps is refused at once: both with
`EngineUnavailableError` (HTTP 503, gRPC UNAVAILABLE).

An engine started with `enable_lora` serves PEFT LoRA adapters (vLLM's `add_lora`,
`remove_lora`, `list_loras`): a request names its adapter (`GenerateRequest.lora`), and
an adapter may be read and checked before its first request (`add_lora`). A server
keeps the names its clients use (`server.lora_registry`); a front knows adapters by
`lora_int_id` only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, Self, runtime_checkable

from jaxserve.engine_stats import StatsSnapshot
from jaxserve.generate_request import GenerateRequest
from jaxserve.lora.request import LoRARequest
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

    async def export_prefix(
        self, token_ids: Sequence[int], salt: str | None, lora: LoRARequest | None = None
    ) -> list[bytes]:
        """The encoded KV pages the engine holds of the prompt's full pages, in order up
        to the first it lacks (a prefill instance pushes them to a decode instance);
        `lora`: the request's adapter, under which they were computed."""
        ...

    async def import_pages(self, pages: list[bytes]) -> int:
        """Checks pushed KV pages and keeps them where admission finds them; returns
        how many. Raises ValueError (none kept) for a bad page or no tier."""
        ...

    @property
    def is_paused(self) -> bool:
        """Whether generation is paused (`pause_generation`; any replica)."""
        ...

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (`sleep`; any replica)."""
        ...

    def unavailable(self) -> EngineUnavailableError | None:
        """The error a request sent now gets at once: the engine sleeps, or is paused
        with `pause_wait_s` 0 (a server answers it before streaming). None when the
        request would be served, or would wait for `resume_generation`."""
        ...

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pauses generation on the engine (every replica). `mode`: "abort" ends the
        requests in flight now (finish_reason "abort", stop_reason "paused"); "wait"
        lets them finish, returning once they have; "keep" freezes them with their KV
        until `resume_generation`. New requests wait for the resume. Raises ValueError
        (its `field` "mode") for another mode."""
        ...

    async def resume_generation(self) -> None:
        """Ends a pause: kept requests go on where they stopped, waiting ones start."""
        ...

    async def sleep(self, level: int = 1, keep_host_copy: bool = True) -> None:
        """Gives the device memory back (every replica): level 1 the KV cache, level 2
        the weights too (kept in host memory unless `keep_host_copy` is False: new
        weights come with `update_weights`). Raises ValueError (`field` "level") for
        another level, EngineStateError while requests run unpaused."""
        ...

    async def wake_up(self) -> None:
        """Takes the device memory again (the KV cache zeroed, the weights from their
        host copy); no program is compiled again."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the weights served (`update_weights`; 0: those loaded at
        start-up). Data-parallel: the oldest any replica serves."""
        ...

    async def update_weights(
        self, params: Any = None, *, path: str | None = None, weight_version: int | None = None
    ) -> int:
        """Serves new weights from the next step on (every replica); returns their
        version (`weight_version`, else the previous one + 1). Exactly one of `params`
        (the float model's state or HF-named tensors) and `path` (a model directory);
        `LLMEngine.update_weights` says what each may be. Requests running go on, their
        KV recomputed with the new weights; paused or asleep, the weights are served
        from the resume or wake-up. Raises ValueError naming the first mismatch, the
        weights unchanged."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drops every cached KV page (prefix cache and KV tier, every replica); True
        once done. Running requests keep theirs."""
        ...

    async def add_lora(self, request: LoRARequest) -> bool:
        """Reads and checks the adapter at `request.lora_path` and keeps it in host
        memory (every replica), ahead of the requests that name it; True once done.
        Raises ValueError naming what does not fit (`ParamError`, field "lora"), or, for
        an engine without `enable_lora`, naming that."""
        ...

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets the adapter of that id (every replica; its device slot emptied);
        False if no replica knew it. Raises ValueError while live requests use it (they
        keep it: remove it once they finished), or for an engine without `enable_lora`.
        A request that names it later reads it again from its path."""
        ...

    def list_loras(self) -> list[LoRARequest]:
        """The adapters in host memory (added, or read for a request, and not dropped
        since; data-parallel: on any replica, each id once). Empty without `enable_lora`."""
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
