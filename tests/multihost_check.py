"""Two local processes with 4 fake CPU devices each serve one model with TP over all 8
(run by tests/jaxserve_tests/test_multihost.py).

Usage: python multihost_check.py MODEL_DIR COORDINATOR PROCESS_ID [FOLLOWER_PID]

The follower (process 1) runs the leader's steps until it is stopped or killed. The
leader (process 0) generates greedy outputs with tensor_parallel_size=8 over both
processes and checks them against one device of its own; then it streams a long
request through an AsyncLLMEngine, kills the follower, and checks that the request
fails with a clear error and the engine reports unhealthy within the step timeout.
"""

import asyncio
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import SMALL_LLM_IDS

from jaxserve import LLM, SamplingParams
from jaxserve.generate_request import GenerateRequest

STEP_TIMEOUT_S = 10.0
BASE = dict(SMALL_LLM_IDS, max_num_seqs=4, max_num_batched_tokens=32)


def prompts():
    rs = np.random.RandomState(0)
    system = rs.randint(3, 128, size=17).tolist()
    return [{"prompt_token_ids": system + rs.randint(3, 128, size=n).tolist()} for n in (2, 9, 30)]


async def kill_follower_mid_stream(llm: LLM, follower_pid: int) -> None:
    from jaxserve.async_engine import AsyncLLMEngine

    front = AsyncLLMEngine(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    killed_at = None
    try:
        async for _ in front.generate(
            GenerateRequest("long", prompts()[0]["prompt_token_ids"], params)
        ):
            if killed_at is None:
                os.kill(follower_pid, signal.SIGKILL)
                killed_at = time.monotonic()
        raise AssertionError("the request finished though the follower is dead")
    except Exception as e:  # EngineDeadError naming the lost follower
        waited = time.monotonic() - killed_at
        assert "follower process" in str(e), e
        assert not front.healthy
        assert waited < STEP_TIMEOUT_S + 20, waited
        print(f"follower killed: request failed after {waited:.1f}s, unhealthy: {e}", flush=True)


def main(model_dir: str, coordinator: str, process_id: str, follower_pid: str = "") -> None:
    llm = LLM(
        model_dir,
        tensor_parallel_size=8,
        coordinator_address=coordinator,
        num_processes=2,
        process_id=int(process_id),
        step_timeout_s=STEP_TIMEOUT_S,
        async_scheduling=True,  # the followers read the step before's tokens on device
        **BASE,
    )
    if llm.follower is not None:
        print(f"follower ran {llm.follow()} steps", flush=True)
        return
    import jax

    assert jax.process_count() == 2 and len(jax.devices()) == 8
    assert llm.engine.model_info().num_processes == 2
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(
        temperature=0.8, seed=3, max_tokens=8, frequency_penalty=0.5, ignore_eos=True
    )

    def outputs(engine: LLM) -> list[list[int]]:
        return [
            o.outputs[0].token_ids
            for params in (greedy, seeded)
            for o in engine.generate(prompts(), params, use_tqdm=False)
        ]

    got = outputs(llm)
    one = LLM(model_dir, **BASE)  # one local device, no collectives, synchronous steps
    assert one.engine.runner.mesh is None
    want = outputs(one)
    assert got == want, (got, want)
    print(f"2 processes x 4 devices, TP 8: {len(got)} outputs equal to one device", flush=True)
    asyncio.run(kill_follower_mid_stream(llm, int(follower_pid)))
    os._exit(0)  # the distributed runtime would wait for the dead follower at exit


if __name__ == "__main__":
    main(*sys.argv[1:])
