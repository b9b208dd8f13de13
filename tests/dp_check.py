"""Run in a subprocess with 8 fake CPU devices: data-parallel replicas serve like one
engine.

Usage: python dp_check.py MODEL_DIR DP TP

`LLM(data_parallel_size=DP, tensor_parallel_size=TP)` serves a mixed workload
(groups of prompts sharing a system prefix, and unrelated prompts; greedy and
seeded sampling, n=2) twice, and once more from inside a running event loop; every
request is answered exactly once, outputs equal one engine's on one device, and
requests sharing a prefix land on the replica that holds it (the router's affinity
hits, and the replicas' prefix-cache hits).
"""

import asyncio
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import SMALL_LLM_IDS

from jaxserve import LLM, SamplingParams
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.generate_request import GenerateRequest
from server.prometheus import ServerMetrics
from server.serving import stream

BASE = SMALL_LLM_IDS


def workload(vocab: int):
    rs = np.random.RandomState(1)
    prompts = []
    for _ in range(3):  # 3 groups of 4 prompts sharing 24 tokens (3 full pages)
        system = rs.randint(3, vocab, size=24).tolist()
        prompts += [system + rs.randint(3, vocab, size=n).tolist() for n in (3, 7, 11, 5)]
    prompts += [rs.randint(3, vocab, size=n).tolist() for n in (9, 30, 4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=6, n=2, seed=3, ignore_eos=True)
    params = [greedy if i % 3 else sampled for i in range(len(prompts))]
    return [{"prompt_token_ids": p} for p in prompts], params


def outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted({o.request_id for o in outs}, key=int)
    assert all(o.finished for o in outs)
    return [[c.token_ids for c in o.outputs] for o in outs]


def main(model_dir: str, dp: str, tp: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    one = LLM(model_dir, **BASE)
    prompts, params = workload(one.config.model.vocab_size)
    want = outputs(one, prompts, params)
    llm = LLM(model_dir, data_parallel_size=int(dp), tensor_parallel_size=int(tp), **BASE)
    front = llm.engine
    assert isinstance(front, DataParallelEngine) and len(front.replicas) == int(dp)
    devices = [set(r.engine.runner.mesh.devices.flat) for r in front.replicas]
    assert all(len(d) == int(tp) for d in devices) and not set.intersection(*devices)
    for rnd in range(2):  # the second round finds each group's prefix where it went
        assert outputs(llm, prompts, params) == want, rnd
    router = front.router
    per_replica = front.replica_stats()
    total = front.stats()
    assert sum(router.routed) == 2 * len(prompts) and all(n > 0 for n in router.routed)
    assert total.requests_finished == 2 * len(prompts)
    # Of the 2 x 12 group requests, all but each group's first land by affinity.
    assert router.affinity_hits >= 2 * 12 - 3, router.affinity_hits
    hits = sum(s.prefix_cache_hits for s in per_replica)
    assert hits == total.prefix_cache_hits > 0
    print(
        f"dp={dp} tp={tp}: {2 * len(prompts)} requests answered once, equal to one engine; "
        f"routed {router.routed}, affinity {router.affinity_hits}/{2 * len(prompts)}, "
        f"prefix-cache hit rate {total.prefix_cache_hits / total.prefix_cache_queries:.2f} "
        f"(per replica {[s.prefix_cache_hits for s in per_replica]})"
    )
    # What the servers call (server.serving.stream) over the replicas: the same tokens.
    metrics = ServerMetrics("m", front.stats, replicas_fn=front.replica_stats)
    greedy = params[1]

    async def through_server(i: int) -> list[int]:
        request = GenerateRequest(f"s{i}", prompts[i]["prompt_token_ids"], greedy)
        outs = [o async for o in stream(front, metrics, request)]
        return outs[-1].outputs[0].token_ids

    async def all_through_server() -> list[list[int]]:
        return await asyncio.gather(*(through_server(i) for i in (1, 2, 4)))

    assert asyncio.run(all_through_server()) == [want[i][0] for i in (1, 2, 4)]

    async def inside_a_running_loop():  # as Jupyter runs a cell
        return outputs(llm, prompts, params)

    assert asyncio.run(inside_a_running_loop()) == want
    print("LLM.generate inside a running event loop: equal to one engine")
    for r in front.replicas:
        r.close()
    assert not front.healthy and "was shut down" in str(front.error), front.error


if __name__ == "__main__":
    main(*sys.argv[1:])
