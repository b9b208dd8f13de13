"""Run in a subprocess with 8 fake CPU devices: data-parallel replicas on a Ray
cluster of two machines serve like one engine, and a replica that stalls or dies
fails only its own requests, within the bound.

Usage: python ray_dp_check.py MODEL_DIR TP

A Ray cluster of a head (no CPUs: it runs no replica) and two worker nodes of one CPU
each (`ray.cluster_utils.Cluster`: separate raylets, as on two machines; each worker
process sees 8 fake devices) takes `LLM(data_parallel_size=2,
data_parallel_backend="ray", tensor_parallel_size=TP)`: one replica a node. dp_check's
mixed workload, twice: every request answered once, outputs equal one local engine's,
requests sharing a prefix routed by affinity. Then, with requests in flight on both
replicas: replica 0's process is stopped (SIGSTOP): its requests fail with
EngineDeadError within step_timeout_s + the health interval, the front reports
unhealthy and refuses new requests, and replica 1's requests finish; then replica 1's
process is killed (SIGKILL) mid-stream: its requests fail at once.
"""

import asyncio
import contextlib
import os
import signal
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))

from dp_check import BASE, outputs, workload

from jaxserve import LLM, SamplingParams
from jaxserve.distributed.data_parallel import DataParallelEngine
from jaxserve.distributed.ray_replicas import HEALTH_INTERVAL_S
from jaxserve.front import EngineDeadError
from jaxserve.generate_request import GenerateRequest

# Long enough that a healthy replica's loop comes round on a loaded 2-core machine (4 s
# failed twice there, with the test run and a compile beside it); short enough to wait.
STEP_TIMEOUT_S = 15.0
KILL_DEADLINE_S = 30.0  # for a killed actor's process to be gone
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)  # dp_check's greedy requests


def pid_of(replica) -> int:
    return int(replica.where.split(" pid ")[1].split()[0])


async def stream(front, request_id: str, ids: list[int], started: asyncio.Event | None = None):
    """('done', tokens) or ('dead', error message, seconds after the first output)."""
    params = SamplingParams(temperature=0.0, max_tokens=128 - len(ids) - 1, ignore_eos=True)
    first = None
    try:
        async for out in front.generate(GenerateRequest(request_id, ids, params)):
            last = out
            if first is None:
                first = time.monotonic()
                if started is not None:
                    started.set()
        return "done", last.outputs[0].token_ids
    except EngineDeadError as e:
        return "dead", str(e), time.monotonic()


async def reuse_after_cancel(front, ids: list[int], want: list[int]) -> None:
    """A client that goes away mid-stream and sends its request id again at once gets
    the new request's tokens only (the replica keys requests apart from their ids)."""
    long = SamplingParams(temperature=0.0, max_tokens=128 - len(ids) - 1, ignore_eos=True)
    first = front.generate(GenerateRequest("again", ids, long))
    await first.__anext__()
    await first.aclose()  # the client went away: aborted on its replica
    outs = [
        o async for o in front.generate(GenerateRequest("again", ids, SamplingParams(**GREEDY)))
    ]
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want, outs[-1]
    assert all(o.request_id == "again" for o in outs)
    deadline = time.monotonic() + 10
    while any(s.num_running for s in front.replica_stats()):
        assert time.monotonic() < deadline, front.replica_stats()
        time.sleep(0.1)
    print("request id reused after a cancel: the new request's tokens, nothing left running")


async def failures(front, vocab: int) -> None:
    r0, r1 = front.replicas
    ids = [[3 + (7 * i + j) % (vocab - 3) for j in range(9)] for i in range(4)]
    # Two requests on each replica (equal loads: the router alternates). Each one's
    # replica is read as it is routed, and replica 0 is stopped once its own two have
    # streamed: waiting for replica 1's too let replica 0 finish its two first on a
    # loaded machine (CI: they were gone from the front's table).
    started = [asyncio.Event() for _ in ids]
    tasks, owners = [], {}
    for i, p in enumerate(ids):
        tasks.append(asyncio.create_task(stream(front, f"f{i}", p, started[i])))
        while f"f{i}" not in front._owner:  # routed when the task first runs
            await asyncio.sleep(0)
        owners[f"f{i}"] = front._owner[f"f{i}"]
    assert sorted(owners.values()) == [0, 0, 1, 1], owners
    await asyncio.gather(*(started[i].wait() for i in range(len(ids)) if owners[f"f{i}"] == 0))
    os.kill(pid_of(r0), signal.SIGSTOP)  # stalls: no answer, no error
    stopped = time.monotonic()
    results = await asyncio.gather(*tasks)
    for i, result in enumerate(results):
        if owners[f"f{i}"] == 0:
            assert result[0] == "dead" and "replica 0" in result[1], result
            waited = result[2] - stopped
            assert waited <= STEP_TIMEOUT_S + 2 * HEALTH_INTERVAL_S + 2, waited
            assert "health check" in result[1], result
        else:
            assert result[0] == "done" and len(result[1]) == 128 - 9 - 1, result[0]
    assert not front.healthy and "health check" in repr(front.error)
    try:
        async for _ in front.generate(
            GenerateRequest("late", ids[0], SamplingParams(max_tokens=2))
        ):
            pass
        raise AssertionError("an unhealthy front took a request")
    except EngineDeadError as e:
        assert "health check" in str(e), e
    print(f"stalled replica: its 2 requests failed {waited:.1f}s after SIGSTOP, the other 2 done")

    # Replica 1 is still healthy: a request sent to it directly, killed mid-stream.
    started = asyncio.Event()
    task = asyncio.create_task(stream(r1, "k", ids[1], started))
    await started.wait()
    os.kill(pid_of(r1), signal.SIGKILL)
    killed = time.monotonic()
    result = await task
    assert result[0] == "dead" and "replica 1" in result[1], result
    print(f"killed replica: its request failed {result[2] - killed:.1f}s after SIGKILL")
    # The front killed the stalled actor when it failed it: nothing to resume. Ray's
    # kill is asynchronous (the raylet ends and reaps the process), and a loaded machine
    # may take seconds, so the process is given until a deadline to be gone.
    pid = pid_of(r0)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + KILL_DEADLINE_S
    while _alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the stalled replica's process was not killed within {KILL_DEADLINE_S} s"
            )
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def main(model_dir: str, tp: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    assert len(jax.devices()) == 8, jax.devices()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    front = None
    try:
        one = LLM(model_dir, **BASE)
        prompts, params = workload(one.config.model.vocab_size)
        want = outputs(one, prompts, params)
        llm = LLM(
            model_dir,
            data_parallel_size=2,
            tensor_parallel_size=int(tp),
            data_parallel_backend="ray",
            ray_address=cluster.address,
            step_timeout_s=STEP_TIMEOUT_S,
            **BASE,
        )
        front = llm.engine
        assert isinstance(front, DataParallelEngine) and len(front.replicas) == 2
        nodes = {r.node_id for r in front.replicas}
        assert len(nodes) == 2, [r.where for r in front.replicas]  # one replica a machine
        assert all(r.model_info.tensor_parallel_size == int(tp) for r in front.replicas)
        for rnd in range(2):
            assert outputs(llm, prompts, params) == want, rnd
        router, total = front.router, front.stats()
        per_replica = front.replica_stats()
        assert sum(router.routed) == 2 * len(prompts) and all(n > 0 for n in router.routed)
        assert total.requests_finished == 2 * len(prompts)
        assert router.affinity_hits >= 2 * 12 - 3, router.affinity_hits
        assert sum(s.prefix_cache_hits for s in per_replica) == total.prefix_cache_hits > 0
        try:
            llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=500))
            raise AssertionError("a request over max_model_len was taken")
        except ValueError as e:
            assert "max_model_len" in str(e), e
        print(
            f"ray dp=2 tp={tp} on 2 nodes: {2 * len(prompts)} requests answered once, equal "
            f"to one engine; routed {router.routed}, affinity "
            f"{router.affinity_hits}/{2 * len(prompts)}, prefix-cache hit rate "
            f"{total.prefix_cache_hits / total.prefix_cache_queries:.2f}"
        )
        asyncio.run(reuse_after_cancel(front, prompts[1]["prompt_token_ids"], want[1][0]))
        asyncio.run(failures(front, one.config.model.vocab_size))
    finally:
        if front is not None:
            for r in front.replicas:
                r.close(timeout=2)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
