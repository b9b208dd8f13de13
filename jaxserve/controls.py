"""Control operations: what an engine front does besides generating (pause, sleep,
weight updates, prefix-cache resets, LoRA adapters, profiles), each declared once in
`CONTROLS`: its arguments and their check, how the engine runs it, and how a
data-parallel front combines its replicas' results.

A front runs any of them by name, `EngineFront.control(name, **args)`, knowing none:
`AsyncLLMEngine` on its engine's thread, `DataParallelEngine` on every replica,
`RayReplica` in its actor. `NamedControls` gives Python users vLLM's named methods
(`await front.pause_generation("keep")`), each one call of `control`. A server serves
a control that `server.operations` names (its scope, route and RPC).

A new operation: its `Control` here (the engine's side of it beside the engine's
code), its method in `NamedControls` for Python users, and its entry in
`server.operations` if a server serves it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxserve.engine import profiling
from jaxserve.engine.adapters import lora_disabled
from jaxserve.engine.lifecycle import check_pause_mode, check_sleep_level
from jaxserve.engine.weight_sync import check_update
from jaxserve.front import EngineFront, EngineState, cannot_transfer_kv
from jaxserve.lora import LoRARequest
from jaxserve.sampling_params import ParamError

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

THREADS = ("engine", "any", "worker")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # an argument's default: it has none


@dataclasses.dataclass(frozen=True)
class Arg:
    """An argument of a control: its name, its type (what a server parses it as) and
    its default (REQUIRED: none)."""

    name: str
    kind: type
    default: Any = REQUIRED
    # A path on the engine's machine: a server requires it, takes it only under
    # --allowed_local_paths, and names it in the engine's refusal. `doc` says what it is.
    local_path: bool = False
    doc: str = ""
    # An object of the caller's process (arrays), which no server sends: a front whose
    # engine runs in another process (Ray) refuses it, saying what to send instead.
    in_process: str | None = None


def first(results: list) -> Any:
    """The replicas' results agree (a version they share; None): the first."""
    return results[0]


def each_once(results: list[list]) -> list:
    """The replicas' lists as one, in order, each item once."""
    return list(dict.fromkeys(item for result in results for item in result))


def each_adapter_once(results: list[list[LoRARequest]]) -> list[LoRARequest]:
    """The replicas' adapters as one list, each id once (the first replica's)."""
    seen: dict[int, LoRARequest] = {}
    for loras in results:
        for lora in loras:
            seen.setdefault(lora.lora_int_id, lora)
    return list(seen.values())


@dataclasses.dataclass(frozen=True)
class Control:
    """One control operation (the module docstring says where each piece is used).

    The engine runs `run(engine, **args)` on its own thread between two steps
    (`thread` "engine"), at once on the caller's (`thread` "any": a read of what the
    engine publishes for other threads), or on a worker thread, the steps going on
    (`thread` "worker": work that is safe on any thread and too long for an event
    loop). With `read`, `read(engine, **args)` runs
    first on a worker thread, the steps going on meanwhile (a large file, a slow disk),
    and `run(engine, what read returned, **args)` keeps its result. With `until`, the
    call returns once `until(engine, **args)` holds, checked between steps.

    `check(config, args)` refuses bad arguments (ParamError naming one) before anything
    is sent: every front checks, a data-parallel one before its replicas. A
    data-parallel front runs it on every replica with the same arguments (`agree`:
    those made from the replicas' states, that they must share) and answers
    `combine(the replicas' results)`. A control that moves KV pages (`kv_pages`) is
    refused by a front that cannot (`ModelInfo.can_transfer_kv`)."""

    name: str
    run: Callable[..., Any]
    args: tuple[Arg, ...] = ()
    check: Callable[[EngineConfig, dict[str, Any]], None] | None = None
    thread: str = "engine"
    read: Callable[..., Any] | None = None
    until: Callable[..., bool] | None = None
    combine: Callable[[list], Any] = first
    agree: Callable[[Sequence[EngineState], dict[str, Any]], dict[str, Any]] | None = None
    kv_pages: bool = False

    def __post_init__(self):
        if self.thread not in THREADS:
            raise ValueError(f"{self.name}: thread must be one of {THREADS}, got {self.thread!r}")
        if self.thread != "engine" and (self.read or self.until):
            raise ValueError(f"{self.name}: thread {self.thread!r} runs at once: no read, no until")

    def bind(
        self, front: EngineFront, config: EngineConfig, args: dict[str, Any]
    ) -> dict[str, Any]:
        """`args` with the defaults filled in, checked; ParamError naming an unknown,
        missing or bad argument, NotImplementedError if `front` cannot run it."""
        if self.kv_pages and not front.model_info.can_transfer_kv:
            raise NotImplementedError(cannot_transfer_kv(front))
        names = [a.name for a in self.args]
        for name in args:
            if name not in names:
                raise ParamError(
                    name, f"{self.name} takes no argument {name!r}; it takes {names or 'none'}"
                )
        bound = {}
        for a in self.args:
            if a.name not in args and a.default is REQUIRED:
                raise ParamError(a.name, f"{self.name} needs {a.name}")
            bound[a.name] = args.get(a.name, a.default)
        if self.check is not None:
            self.check(config, bound)
        return bound


def get(name: str) -> Control:
    """The control `name`; ValueError naming the known ones if there is none."""
    control = CONTROLS.get(name)
    if control is None:
        raise ValueError(f"no control operation {name!r}; known: {sorted(CONTROLS)}")
    return control


# ----------------------------------------------------------- the engine's side


def _drained(engine: LLMEngine, mode: str) -> bool:
    """A "wait" pause returns once the requests in flight finished (or a resume came)."""
    return mode != "wait" or not (engine.is_paused and engine.has_unfinished())


def _one_version(states: Sequence[EngineState], args: dict[str, Any]) -> dict[str, Any]:
    """Every replica's new weights under one version: the one given, else the newest a
    replica serves + 1 (so they agree again after an update that failed on some)."""
    if args["weight_version"] is not None:
        return args
    return {**args, "weight_version": max(s.weight_version for s in states) + 1}


def _lora_enabled(config: EngineConfig, args: dict[str, Any]) -> None:
    if not config.lora.enable_lora:
        raise lora_disabled()


CONTROLS: dict[str, Control] = {
    c.name: c
    for c in (
        Control(
            "pause_generation",
            lambda e, mode: e.pause_generation(mode),
            (Arg("mode", str, "abort"),),
            check=lambda config, a: check_pause_mode(a["mode"]),
            until=_drained,
        ),
        Control("resume_generation", lambda e: e.resume_generation()),
        Control(
            "sleep",
            lambda e, level, keep_host_copy: e.sleep(level, keep_host_copy),
            (Arg("level", int, 1), Arg("keep_host_copy", bool, True)),
            check=lambda config, a: check_sleep_level(a["level"]),
        ),
        Control("wake_up", lambda e: e.wake_up()),
        Control(
            "update_weights",
            lambda e, new, params, path, weight_version: e.install_weights(new, weight_version),
            (
                Arg(
                    "params",
                    object,
                    None,
                    in_process="takes new weights from path= (a model directory every "
                    "machine reads), not params",
                ),
                Arg(
                    "path", str, None, local_path=True, doc="a model directory of the served model"
                ),
                Arg("weight_version", int, None),
            ),
            check=lambda config, a: check_update(
                a["params"], a["path"], a["weight_version"], config.model.quantization_config
            ),
            # A checkpoint read, converted and placed on a worker thread, the steps going on.
            read=lambda e, params, path, weight_version: e.prepare_weights(
                params, path=path, weight_version=weight_version
            ),
            agree=_one_version,
        ),
        Control("reset_prefix_cache", lambda e: e.reset_prefix_cache(), combine=all),
        Control(
            "add_lora",
            lambda e, adapter, request: e.adapters.add(request, adapter),
            (Arg("request", LoRARequest),),
            check=_lora_enabled,
            read=lambda e, request: e.adapters.read(request),
            combine=all,
        ),
        Control(
            "remove_lora",
            lambda e, lora_int_id: e.adapters.remove(lora_int_id),
            (Arg("lora_int_id", int),),
            check=_lora_enabled,
            combine=any,
        ),
        Control(
            "list_loras",
            lambda e: [] if e.adapters is None else list(e.adapters.loaded()),
            thread="any",
            combine=each_adapter_once,
        ),
        Control(
            "start_profile",
            lambda e, output_dir: profiling.start(output_dir),
            (Arg("output_dir", str, local_path=True, doc="a directory to write the trace under"),),
            combine=each_once,
        ),
        Control("stop_profile", lambda e: profiling.stop(), combine=each_once),
        # Disaggregated serving's KV pages (`server.disagg`): a prefill instance's
        # engine exports the prompt's pages (under the request's adapter), a decode
        # instance's checks and keeps the pages pushed to it.
        Control(
            "export_prefix",
            lambda e, token_ids, salt, lora: e.export_prefix(list(token_ids), salt, lora),
            (Arg("token_ids", list), Arg("salt", str, None), Arg("lora", LoRARequest, None)),
            kv_pages=True,
        ),
        Control(
            "import_pages",
            lambda e, pages: e.import_pages(pages),
            (Arg("pages", list),),
            thread="worker",
            kv_pages=True,
        ),
    )
}


# ------------------------------------------------------------- for Python users


class NamedControls:
    """vLLM's named methods of an engine front (its `AsyncLLM`'s), each one call of
    `control`, and the state's fields: a base of every front, for Python users (the
    servers call `control`). A front defines `control` and `state`."""

    if TYPE_CHECKING:

        async def control(self, name: str, **args: Any) -> Any: ...

        @property
        def state(self) -> EngineState: ...

    @property
    def is_paused(self) -> bool:
        """Whether generation is paused (`pause_generation`; any replica)."""
        return self.state.is_paused

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (`sleep`; any replica)."""
        return self.state.is_sleeping

    @property
    def weight_version(self) -> int:
        """The version of the weights served (`update_weights`; 0: those loaded at
        start-up). Data-parallel: the oldest any replica serves."""
        return self.state.weight_version

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pauses generation on the engine (every replica). `mode`: "abort" ends the
        requests in flight now (finish_reason "abort", stop_reason "paused"); "wait"
        lets them finish, returning once they have; "keep" freezes them with their KV
        until `resume_generation`. New requests wait for the resume. Raises ValueError
        (its `field` "mode") for another mode."""
        await self.control("pause_generation", mode=mode)

    async def resume_generation(self) -> None:
        """Ends a pause: kept requests go on where they stopped, waiting ones start."""
        await self.control("resume_generation")

    async def sleep(self, level: int = 1, keep_host_copy: bool = True) -> None:
        """Gives the device memory back (every replica): level 1 the KV cache, level 2
        the weights too (kept in host memory unless `keep_host_copy` is False: new
        weights come with `update_weights`). Raises ValueError (`field` "level") for
        another level, EngineStateError while requests run unpaused."""
        await self.control("sleep", level=level, keep_host_copy=keep_host_copy)

    async def wake_up(self) -> None:
        """Takes the device memory again (the KV cache zeroed, the weights from their
        host copy); no program is compiled again."""
        await self.control("wake_up")

    async def update_weights(
        self, params: Any = None, *, path: str | None = None, weight_version: int | None = None
    ) -> int:
        """Serves new weights from the next step on (every replica, each placing
        `params` on its own devices); returns their version (`weight_version`, else the
        previous one + 1). Exactly one of `params` (the float model's state or HF-named
        tensors; not for Ray replicas) and `path` (a model directory);
        `LLMEngine.update_weights` says what each may be. Requests running go on, their
        KV recomputed with the new weights; paused or asleep, the weights are served
        from the resume or wake-up. Raises ValueError naming the first mismatch, the
        weights unchanged (a data-parallel replica that failed keeps its old weights,
        and its error names it)."""
        return await self.control(
            "update_weights", params=params, path=path, weight_version=weight_version
        )

    async def reset_prefix_cache(self) -> bool:
        """Drops every cached KV page (prefix cache and KV tier, every replica); True
        once done. Running requests keep theirs."""
        return await self.control("reset_prefix_cache")

    async def add_lora(self, request: LoRARequest) -> bool:
        """Reads and checks the adapter at `request.lora_path` (on a worker thread, the
        steps going on) and keeps it in host memory (every replica), ahead of the
        requests that name it; True once done. Raises ValueError naming what does not
        fit (`ParamError`, field "lora"), or, for an engine without `enable_lora`,
        naming that."""
        return await self.control("add_lora", request=request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets the adapter of that id (every replica; its device slot emptied);
        False if no replica knew it. Raises ValueError while live requests use it (they
        keep it: remove it once they finished; the other replicas have forgotten it),
        or for an engine without `enable_lora`. A request that names it later reads it
        again from its path."""
        return await self.control("remove_lora", lora_int_id=lora_int_id)

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters in host memory (added, or read for a request, and not dropped
        since; data-parallel: on any replica, each id once). Empty without `enable_lora`."""
        return await self.control("list_loras")

    async def start_profile(self, output_dir: str) -> list[str]:
        """Traces the device work with JAX's profiler (every replica's process) until
        `stop_profile`; returns the directories under `output_dir` the traces go to
        (`jaxserve.engine.profiling`)."""
        return await self.control("start_profile", output_dir=output_dir)

    async def stop_profile(self) -> list[str]:
        """Stops the traces and writes them; returns their directories (none if no
        trace ran)."""
        return await self.control("stop_profile")

    async def export_prefix(
        self, token_ids: Sequence[int], salt: str | None = None, lora: LoRARequest | None = None
    ) -> list[bytes]:
        """The encoded KV pages the engine holds of the prompt's full pages, in order up
        to the first it lacks (a prefill instance pushes them to a decode instance);
        `lora`: the request's adapter, under which they were computed. A front that
        cannot transfer KV pages (`model_info.can_transfer_kv` False) raises
        NotImplementedError."""
        return await self.control("export_prefix", token_ids=list(token_ids), salt=salt, lora=lora)

    async def import_pages(self, pages: list[bytes]) -> int:
        """Checks pushed KV pages and keeps them where admission finds them; returns
        how many. Raises ValueError (none kept) for a bad page or no tier."""
        return await self.control("import_pages", pages=pages)
