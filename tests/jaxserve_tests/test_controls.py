"""Control operations (`jaxserve.controls`): declared once, forwarded by every front
without a front knowing one; the named methods Python users call are the table's."""

import asyncio
import dataclasses
import inspect
import threading
from types import SimpleNamespace

import pytest
from ray_fakes import ray_replica
from test_scheduler import make_engine

from jaxserve import controls
from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.controls import CONTROLS, REQUIRED, Arg, Control, NamedControls
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.front import EngineState
from jaxserve.sampling_params import ParamError


def test_every_front_forwards_a_control_it_was_never_written_for(monkeypatch):
    """A control registered here, which no front names: a data-parallel front of a
    local replica and a Ray replica (its handle and actor, without Ray) checks its
    arguments once before any replica runs it, makes them agree from the replicas'
    states, runs it on each replica's engine thread and combines the results as
    declared."""
    calls = []

    def run(engine, label, version):
        calls.append((threading.current_thread().name, engine, label, version))
        return engine.weight_version + 1

    def check(config, args):
        if not args["label"]:
            raise ParamError("label", "label must not be empty")

    def agree(states, args):
        return {**args, "version": max(s.weight_version for s in states) + 10}

    tally = Control(
        "tally",
        run,
        (Arg("label", str), Arg("version", int, None)),
        check=check,
        combine=sum,
        agree=agree,
    )
    monkeypatch.setitem(CONTROLS, "tally", tally)
    local, remote = make_engine(), make_engine()
    handle, actor = ray_replica(remote, index=1)
    front = DataParallelEngine([AsyncLLMEngine(local), handle], local.config)

    async def main():
        assert await front.control("tally", label="x") == 2  # 1 + 1: summed
        got = sorted((engine is local, label, version) for _, engine, label, version in calls)
        assert got == [(False, "x", 10), (True, "x", 10)]  # the same, agreed, arguments
        assert {name for name, *_ in calls} == {"jaxserve-engine"}  # each engine's thread
        calls.clear()
        for args, message in [
            (dict(label=""), "label must not be empty"),
            (dict(label="x", colour="red"), r"tally takes no argument 'colour'; it takes"),
            ({}, "tally needs label"),
        ]:
            with pytest.raises(ParamError, match=message):
                await front.control("tally", **args)
        with pytest.raises(ValueError, match=r"no control operation 'nope'; known: \["):
            await front.control("nope")
        assert calls == []  # refused before any replica ran it

    try:
        asyncio.run(main())
    finally:
        front.replicas[0].close()
        actor.engine.close()


def test_a_control_s_until_holds_its_caller_until_the_engine_thread_sees_it():
    """`until` is checked between steps, on the engine thread; its error is the caller's."""
    front = AsyncLLMEngine(make_engine())
    flag = threading.Event()

    async def main():
        with pytest.MonkeyPatch.context() as m:
            wait = Control("wait", lambda e: "ran", until=lambda e: flag.is_set())
            m.setitem(CONTROLS, "wait", wait)
            m.setitem(CONTROLS, "bad", Control("bad", lambda e: None, until=lambda e: 1 / 0))
            waiting = asyncio.ensure_future(front.control("wait"))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            flag.set()
            assert await asyncio.wait_for(waiting, 10) == "ran"
            with pytest.raises(ZeroDivisionError):
                await front.control("bad")
        assert front.healthy

    try:
        asyncio.run(main())
    finally:
        front.close()


def test_the_named_methods_are_the_table_s_controls_with_its_defaults():
    """`NamedControls` has one method per control, each taking the table's arguments
    with the table's defaults (they cannot drift apart), and a property per state field."""
    named = {n: f for n, f in vars(NamedControls).items() if inspect.iscoroutinefunction(f)}
    assert set(named) == set(CONTROLS)
    for name, method in named.items():
        params = list(inspect.signature(method).parameters.values())[1:]  # (self)
        want = [
            (a.name, inspect.Parameter.empty if a.default is REQUIRED else a.default)
            for a in CONTROLS[name].args
        ]
        assert [(p.name, p.default) for p in params] == want, name
    for field in dataclasses.fields(EngineState):
        assert isinstance(vars(NamedControls)[field.name], property), field.name


def test_a_table_entry_is_checked_when_declared():
    with pytest.raises(ValueError, match="thread must be one of"):
        Control("x", lambda e: None, thread="pool")
    with pytest.raises(ValueError, match="thread 'any' runs at once"):
        Control("x", lambda e: None, thread="any", until=lambda e: True)
    with pytest.raises(ValueError, match="thread 'worker' runs at once"):
        Control("x", lambda e: None, thread="worker", read=lambda e: None)
    engine = make_engine()
    front = SimpleNamespace(model_info=engine.model_info())
    assert controls.get("sleep").bind(front, engine.config, {}) == {
        "level": 1,
        "keep_host_copy": True,
    }
