"""Data parallelism: replicas behind one front (`jaxserve.distributed.data_parallel`)."""

import pytest
from fake_devices import run_on_8_devices

from jaxserve.distributed.data_parallel import PrefixRouter


def test_router_sends_a_prefix_where_it_went_and_others_to_the_least_loaded():
    router = PrefixRouter(2, page_size=4, capacity=100)
    a, b = list(range(10, 22)), list(range(50, 62))
    assert router.route(a + [1], [0, 0]) == 0
    assert router.route(b + [2], [1, 0]) == 1  # no shared prefix: the least loaded
    assert router.route(a + [3, 4], [1, 1]) == 0  # shares a's three pages
    assert router.route(b[:5] + [9] * 8, [2, 1]) == 1  # shares b's first page
    assert router.affinity_hits == 2
    # The prompt's last token is always computed: a prompt of exactly one page has
    # no page to share.
    assert router.page_keys(a[:4]) == []
    # Too busy: affinity gives way to load beyond max_imbalance.
    busy = PrefixRouter(2, page_size=4, capacity=100, max_imbalance=2)
    assert busy.route(a + [1], [0, 0]) == 0
    assert busy.route(a + [1], [5, 0]) == 1
    # A salt (cache_salt) separates tenants' prefixes.
    assert router.page_keys(a, salt="t1") != router.page_keys(a, salt="t2")


def test_router_forgets_the_least_recently_routed_pages():
    router = PrefixRouter(2, page_size=2, capacity=3)
    router.route([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0])  # 4 pages: the first forgotten
    assert router.route([1, 2, 3], [0, 0]) in (0, 1)
    assert router.affinity_hits == 0


@pytest.mark.sharded
@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(2, 4)])
def test_replicas_answer_each_request_once_like_one_engine(dp, tp, hf_model_dir):
    path, _ = hf_model_dir("llama2_mha")
    stdout = run_on_8_devices("dp_check.py", path, dp, tp)
    assert f"dp={dp} tp={tp}: 30 requests answered once, equal to one engine" in stdout
    assert "LLM.generate inside a running event loop: equal to one engine" in stdout


@pytest.mark.sharded
@pytest.mark.slow
def test_replicas_on_a_ray_cluster_serve_like_one_engine_and_fail_alone(hf_model_dir):
    """Two replicas (TP 2 each) on two nodes of a local Ray cluster: outputs equal one
    engine's, affinity routing; a stalled replica's requests fail within the bound,
    the other replica's finish; a killed one's fail at once (`ray_dp_check.py`)."""
    pytest.importorskip("ray")
    path, _ = hf_model_dir("llama2_mha")
    stdout = run_on_8_devices("ray_dp_check.py", path, 2)
    assert "ray dp=2 tp=2 on 2 nodes: 30 requests answered once, equal to one engine" in stdout
    assert "request id reused after a cancel: the new request's tokens" in stdout
    assert "stalled replica: its 2 requests failed" in stdout
    assert "killed replica: its request failed" in stdout


def _mock_replicas(n=2):
    """`n` local replicas over mock engines (no devices): a `DataParallelEngine`."""
    from test_scheduler import make_engine

    from jaxserve.async_engine import AsyncLLMEngine
    from jaxserve.distributed.data_parallel import DataParallelEngine

    engines = [make_engine(num_pages=64, max_num_seqs=8, budget=32) for _ in range(n)]
    return DataParallelEngine([AsyncLLMEngine(e) for e in engines], engines[0].config), engines


def _requests(n=6):
    from test_scheduler import params

    from jaxserve.generate_request import GenerateRequest

    return [GenerateRequest(str(i), [3 + i, 5, 7], params(4 + i)) for i in range(n)]


def test_stream_all_works_inside_a_running_event_loop():
    """`LLM.generate` over replicas from code that runs in an event loop (Jupyter): it
    used `asyncio.run`, which refuses to run there. Its calls now share the front's
    own loop thread, which shutdown closes."""
    import asyncio
    import threading

    from mock_runner import expected_tokens
    from test_scheduler import VOCAB

    from jaxserve.distributed.data_parallel import stream_all
    from jaxserve.front import EngineDeadError

    front, engines = _mock_replicas()
    requests = _requests()
    finals = {}

    def keep(i, out):
        if out.finished:
            finals[i] = out

    async def inside_a_loop():
        stream_all(front, requests, keep)  # (blocks this loop, as a sync call does)

    asyncio.run(inside_a_loop())
    asyncio.run(inside_a_loop())  # again: the same loop thread serves it
    stream_all(front, requests, keep)  # and outside any loop
    for i, r in enumerate(requests):
        want = expected_tokens(r.prompt_token_ids, r.params.max_tokens, VOCAB)
        assert finals[i].outputs[0].token_ids == want
    assert all(e.stats().requests_finished > 0 for e in engines)  # both replicas served
    loops = [t for t in threading.enumerate() if t.name == "jaxserve-data-parallel-loop"]
    assert len(loops) == 1
    front.close()
    loops[0].join(5)
    assert not loops[0].is_alive()
    with pytest.raises(EngineDeadError, match="shut down"):
        stream_all(front, requests, keep)
    assert not [t for t in threading.enumerate() if t.name == "jaxserve-data-parallel-loop"]


def test_stream_all_returns_a_request_the_engine_failed_with_the_others(monkeypatch):
    from mock_runner import expected_tokens
    from test_scheduler import VOCAB

    from jaxserve.distributed.data_parallel import stream_all
    from jaxserve.request_state import RequestState

    check_stop = RequestState.check_stop

    def failing(self, *args):
        if self.request_id == "2":
            raise RuntimeError("injected")
        return check_stop(self, *args)

    monkeypatch.setattr(RequestState, "check_stop", failing)
    front, _ = _mock_replicas()
    requests, finals = _requests(), {}

    def keep(i, out):
        if out.finished:
            finals[i] = out

    stream_all(front, requests, keep)
    assert "RuntimeError: injected" in finals[2].error
    for i, r in enumerate(requests):
        if i != 2:
            want = expected_tokens(r.prompt_token_ids, r.params.max_tokens, VOCAB)
            assert finals[i].outputs[0].token_ids == want and finals[i].error is None
    assert front.healthy
    front.close()


def test_closing_the_loop_ends_a_synchronous_call_still_running_on_it():
    """`close` stopped the loop under a coroutine still running for a synchronous
    caller (`run_sync`), whose wait then never ended."""
    import asyncio
    import threading

    from jaxserve.distributed import data_parallel
    from jaxserve.front import EngineDeadError

    loop, ended, running = data_parallel._LoopThread(), [], threading.Event()

    async def forever():
        running.set()
        await asyncio.sleep(3600)

    def caller():
        try:
            loop.run(forever())
        except EngineDeadError as e:
            ended.append(e)

    thread = threading.Thread(target=caller)
    thread.start()
    assert running.wait(10)  # the call is on the loop when it closes
    loop.close(timeout=5)
    thread.join(5)
    assert not thread.is_alive() and "closed" in str(ended[0])
