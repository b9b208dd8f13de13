"""Sleep and wake-up (`LLMEngine.sleep`, `jaxserve.engine.lifecycle`, `runner.residency`)
and pausing with "keep" on real models: the device buffers are deleted at once and the
process's live arrays shrink by their bytes; after the wake-up the engine gives the same
greedy tokens as before, and nothing was compiled again."""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import SMALL_LLM, engine_config, greedy
from fake_devices import run_on_8_devices

from jaxserve import LLM
from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.engine import LLMEngine
from jaxserve.front import EngineStateError, EngineUnavailableError
from jaxserve.generate_request import GenerateRequest
from jaxserve.runner import residency
from jaxserve.sampling_params import ParamError, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [7] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(params=["sync", "async"])
def engine(request):
    config = engine_config(
        EMBEDDED_MODELS["demo-model-tiny"],
        num_pages=256,
        max_num_batched_tokens=32,
        async_scheduling=request.param == "async",
    )
    engine = LLMEngine(config)
    yield engine
    engine.close()


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_sleep_level_1_frees_the_kv_cache_and_the_engine_wakes_up_the_same(engine):
    want = greedy(engine, PROMPTS, 8)  # (compiles the programs these shapes need)
    compiles = engine.runner.compiles.count
    caches = list(engine.runner.kv_caches)
    kv_bytes = residency.live_bytes(caches)
    assert engine.pool.num_cached > 0
    before = live_bytes()
    engine.sleep(1)
    assert engine.is_sleeping and all(x.is_deleted() for x in caches)
    assert before - live_bytes() >= kv_bytes > 0
    report = engine.device_memory()
    assert report["kv_cache_bytes"] == 0 and report["weights_bytes"] > 0
    assert engine.pool.num_cached == 0  # the prefix cache's pages went with the caches
    with pytest.raises(EngineUnavailableError, match=r"sleeping \(level 1\).*wake_up"):
        engine.add_request(GenerateRequest("r", [1, 2], GREEDY))
    assert not engine.requests and not engine.has_unfinished()
    engine.sleep(1)  # asleep already: nothing
    engine.wake_up()
    assert not engine.is_sleeping and engine.device_memory()["kv_cache_bytes"] == kv_bytes
    assert greedy(engine, PROMPTS, 8) == want
    assert engine.runner.compiles.count == compiles  # no program compiled again


def test_sleep_level_2_frees_the_weights_too_and_wakes_from_their_host_copy(engine):
    want = greedy(engine, PROMPTS, 8)
    compiles = engine.runner.compiles.count
    weights = list(engine.runner.weights)
    freed = residency.live_bytes(weights) + residency.live_bytes(engine.runner.kv_caches)
    before = live_bytes()
    engine.sleep(2)
    assert all(x.is_deleted() for x in weights)
    assert before - live_bytes() >= freed
    report = engine.device_memory()
    assert report["weights_bytes"] == report["kv_cache_bytes"] == 0
    assert report["host_weights_bytes"] == sum(x.nbytes for x in weights)
    engine.wake_up()
    assert [x.committed for x in engine.runner.weights] == [x.committed for x in weights]
    assert engine.device_memory()["host_weights_bytes"] == 0
    assert greedy(engine, PROMPTS, 8) == want
    assert engine.runner.compiles.count == compiles


def test_weights_dropped_without_a_host_copy_wait_for_new_ones(engine):
    want = greedy(engine, PROMPTS, 8)
    compiles = engine.runner.compiles.count
    trained = jax.device_get(engine.runner.weights)  # what a trainer would send back
    engine.sleep(2, keep_host_copy=False)
    assert engine.device_memory()["host_weights_bytes"] == 0
    engine.wake_up()
    assert all(not np.asarray(x).any() for x in engine.runner.weights)  # zeros, placed
    assert engine.needs_weights
    with pytest.raises(EngineUnavailableError, match="without weights.*update_weights"):
        engine.add_request(GenerateRequest("r", [1, 2], GREEDY))
    # What update_weights does: new arrays in the runner, then the flag cleared.
    engine.runner.weights = [jnp.asarray(w) for w in trained]
    engine.weights_loaded()
    assert greedy(engine, PROMPTS, 8) == want
    assert engine.runner.compiles.count == compiles


def test_weights_given_while_asleep_stay_at_the_wake_up(engine):
    want = greedy(engine, PROMPTS, 8)
    trained = jax.device_get(engine.runner.weights)
    engine.sleep(2, keep_host_copy=False)
    engine.runner.weights = [jnp.asarray(w) for w in trained]  # update_weights, asleep
    engine.weights_loaded()
    engine.wake_up()  # (not zeros over them)
    assert not engine.needs_weights
    assert greedy(engine, PROMPTS, 8) == want


def other_weights(engine: LLMEngine):
    """Other weights for `engine`'s model (float32, served as they are): its own with
    noise, as a trainer's step would change them."""
    rng = np.random.default_rng(0)
    state = engine.runner.model_def.state(jax.device_get(engine.runner.weights))
    return jax.tree.map(lambda x: x + rng.normal(0, 0.5 * x.std() + 1e-3, x.shape), state)


@pytest.mark.parametrize("level, keep_host_copy", [(1, True), (2, True), (2, False)])
def test_an_update_while_asleep_is_served_after_the_wake_up(engine, level, keep_host_copy):
    """The first update comes while the engine sleeps (at level 2 the runner's weights
    are deleted arrays: only their shapes, dtypes and placements are read); after the
    wake-up the engine gives what an engine updated awake gives, compiling nothing."""
    old = greedy(engine, PROMPTS, 8)
    compiles = engine.runner.compiles.count
    params = other_weights(engine)
    with LLMEngine(engine.config) as awake:
        assert awake.update_weights(params) == 1
        want = greedy(awake, PROMPTS, 8)
    assert want != old
    engine.sleep(level, keep_host_copy)
    assert engine.update_weights(params) == 1
    assert engine.is_sleeping and engine.device_memory()["kv_cache_bytes"] == 0
    engine.wake_up()
    assert not engine.needs_weights and engine.device_memory()["host_weights_bytes"] == 0
    assert greedy(engine, PROMPTS, 8) == want
    assert engine.runner.compiles.count == compiles


def test_an_update_after_a_wake_up_without_weights_serves_again(engine):
    """Woken from sleep(2, keep_host_copy=False), the engine refuses requests until
    `update_weights` has loaded weights; then it serves them."""
    want = greedy(engine, PROMPTS, 8)
    trained = engine.runner.model_def.state(jax.device_get(engine.runner.weights))
    engine.sleep(2, keep_host_copy=False)
    engine.wake_up()
    assert engine.needs_weights
    assert engine.update_weights(trained, weight_version=5) == 5
    assert not engine.needs_weights and engine.refusal() is None
    assert greedy(engine, PROMPTS, 8) == want


def test_sleep_is_refused_while_requests_run_and_preempts_kept_ones(engine):
    want = greedy(engine, PROMPTS, 8)
    for i, p in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(str(i), p, GREEDY))
    engine.step()
    engine.step()
    with pytest.raises(EngineStateError, match="3 requests are running; pause_generation"):
        engine.sleep(1)
    assert not engine.is_sleeping
    engine.pause_generation("wait")
    with pytest.raises(EngineStateError, match="draining"):
        engine.sleep(1)
    engine.pause_generation("keep")
    outs = {o.request_id: o for o in engine.step()}  # (a step in flight, applied)
    engine.sleep(1)  # the kept requests are preempted: their pages are gone
    assert engine.scheduler.num_preemptions > 0 and not engine.scheduler.running
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity
    engine.wake_up()
    assert not engine.has_unfinished()  # still paused
    engine.resume_generation()
    engine.run(lambda out: outs.__setitem__(out.request_id, out))
    # Recomputed from their tokens so far (a prefill instead of the decodes that
    # wrote them first), they go on to the same greedy tokens.
    assert [outs[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == want
    assert all(outs[str(i)].finished for i in range(len(PROMPTS)))


def test_a_bad_sleep_level_is_refused_naming_the_field(engine):
    for level in (0, 3, True, "1", 1.0):
        with pytest.raises(ParamError, match=r"level must be one of \[1, 2\]") as e:
            engine.sleep(level)
        assert e.value.field == "level"
    assert not engine.is_sleeping


def test_a_closed_engine_neither_sleeps_nor_wakes(engine):
    engine.close()
    for call in (lambda: engine.sleep(1), engine.wake_up):
        with pytest.raises(RuntimeError, match="closed"):
            call()


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_keep_pauses_the_demo_model_without_changing_a_token(async_scheduling):
    """Greedy outputs with a "keep" pause mid-generation equal those of an unpaused run,
    token for token; nothing is recomputed and nothing compiled while paused."""
    config = engine_config(
        EMBEDDED_MODELS["demo-model"],
        num_pages=128,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    with LLMEngine(config) as engine:
        want = greedy(engine, PROMPTS, 16)
        for i, p in enumerate(PROMPTS):
            engine.add_request(
                GenerateRequest(str(i), p, dataclasses.replace(GREEDY, max_tokens=16))
            )
        finals = {}

        def keep(out):
            finals[out.request_id] = out

        for _ in range(4):  # a prefill chunk or two, then decodes
            for out in engine.step():
                keep(out)
        engine.pause_generation("keep")
        for out in engine.step():
            keep(out)
        compiles = engine.runner.compiles.count
        assert not engine.has_unfinished() and engine.step() == []
        engine.resume_generation()
        engine.run(keep)
        assert [finals[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == want
        assert engine.scheduler.num_preemptions == 0
        assert engine.runner.compiles.count == compiles


def test_a_front_refuses_requests_while_its_engine_sleeps(engine):
    async def main():
        front = AsyncLLMEngine(engine)
        try:
            request = GenerateRequest("r", PROMPTS[0], GREEDY)
            want = [o async for o in front.generate(request)][-1].outputs[0].token_ids
            await front.sleep(2)
            assert front.is_sleeping and "sleeping (level 2)" in str(front.unavailable())
            with pytest.raises(EngineUnavailableError, match="sleeping"):
                [o async for o in front.generate(request)]
            await front.wake_up()
            assert front.unavailable() is None
            again = [o async for o in front.generate(request)][-1].outputs[0].token_ids
            assert again == want
        finally:
            front.close()

    asyncio.run(main())


def test_the_offline_llm_sleeps_between_generate_calls():
    with LLM("demo-model-tiny", **SMALL_LLM) as llm:
        want = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0].text
        llm.sleep(2)
        with pytest.raises(EngineUnavailableError, match="sleeping"):
            llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)
        assert not llm.engine.requests
        llm.wake_up()
        again = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0].text
        assert again == want


@pytest.mark.sharded
@pytest.mark.slow
def test_an_engine_on_a_mesh_sleeps_and_wakes_without_compiling():
    """Tensor parallel (2 of 8 fake devices): sharded, committed buffers deleted and
    placed again as they were; float32 and int8 KV, and a draft model's
    (`sleep_sharded_check.py`)."""
    stdout = run_on_8_devices("sleep_sharded_check.py")
    for name in ("float32", "int8 KV", "draft"):
        assert f"tp=2 {name}: sleep(2) freed" in stdout and "same tokens, 0 compiles" in stdout


def test_a_hybrid_kv_cache_forgets_every_groups_pages_at_sleep(hf_model_dir):
    """Sliding-window layers keep their pages in pools of their own (a hybrid KV cache):
    sleep empties every group's prefix cache, else a prompt after the wake-up would hit
    windowed pages whose contents went with the caches."""
    path, _ = hf_model_dir("gemma2_window_softcap")
    engine = LLMEngine(engine_config(path, page_size=4, num_pages=96, max_num_batched_tokens=16))
    try:
        assert len(engine.scheduler.kv.pools) == 2  # a full group and a windowed one
        prompts = [[(5 * i + 3) % 97 + 1 for i in range(30)]]
        want = greedy(engine, prompts, 6)
        assert all(pool.num_cached > 0 for pool in engine.scheduler.kv.pools)
        engine.sleep(1)
        assert all(pool.num_cached == 0 for pool in engine.scheduler.kv.pools)
        engine.wake_up()
        assert greedy(engine, prompts, 6) == want
    finally:
        engine.close()
