"""A Ray replica's two sides without Ray: the front's handle (`RayReplica`) and the
actor (`ReplicaActor`) over an engine in this process, the handle calling the actor's
methods directly (a Ray actor handle's `method.remote(...)` is awaitable: the
coroutine stands in). Their `__init__`s need a Ray worker, so neither runs."""

from __future__ import annotations

import collections
import threading
import types

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.distributed.ray_actor import ReplicaActor
from jaxserve.distributed.ray_replicas import RayReplica
from jaxserve.engine import LLMEngine
from jaxserve.front import EngineState


def ray_actor(engine: LLMEngine) -> ReplicaActor:
    actor = object.__new__(ReplicaActor)
    actor.engine = AsyncLLMEngine(engine)
    actor._outbox, actor._tasks = None, {}
    actor._early_aborts = collections.OrderedDict()
    return actor


def ray_replica(engine: LLMEngine, index: int = 0) -> tuple[RayReplica, ReplicaActor]:
    """The handle and the actor (shut the actor's `engine` down after)."""
    actor = ray_actor(engine)
    handle = object.__new__(RayReplica)
    handle.index, handle.config, handle.where = index, engine.config, "here"
    handle.model_info = engine.model_info()
    handle._state, handle._state_at, handle._lock = EngineState(), -1, threading.Lock()
    handle.actor = types.SimpleNamespace(control=types.SimpleNamespace(remote=actor.control))
    return handle, actor
