"""Where adapters live: the device slots (`SlotTable`), host memory (`AdapterCache`),
and the scheduler's use of them, driven through the engine with a mock runner whose
"device" records which adapter each slot holds (host logic: no model)."""

import types

import pytest
from lora_files import write_adapter
from mock_runner import MockRunner, mock_model

from jaxserve.config import engine_config
from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.lora import AdapterCache, LoRALayout, LoRARequest, SlotTable
from jaxserve.lora.peft import Adapter
from jaxserve.sampling_params import ParamError, SamplingParams

# ----------------------------------------------------------------- SlotTable


def test_empty_slots_first_then_the_least_recently_used_unpinned_one():
    t = SlotTable(2)
    assert t.claim("a") == 1 and t.claim("b") == 2
    assert t.take_loads() == [(1, "a"), (2, "b")]
    assert t.claim("a") == 1 and t.take_loads() == []  # resident: nothing to write
    t.pin(1)
    assert t.claim("c") == 2  # b unpinned: evicted; a is pinned
    assert t.take_loads() == [(2, "c")] and t.num_evictions == 1
    t.unpin(1)
    assert t.claim("d") == 1  # a now least recently used
    assert t.keys == [None, "d", "c"]


def test_a_waiting_adapter_reserves_the_slot_that_drains_first():
    t = SlotTable(2)
    t.pin(t.claim("a", arrival=0))
    t.pin(t.claim("a", arrival=1))
    t.pin(t.claim("b", arrival=2))  # slot 1: two of a's running, slot 2: one of b's
    assert t.claim("c", arrival=3, horizon=4) is None
    assert t.reserved == {2: "c"}  # the fewest running
    # A reserved slot admits no sequence of its adapter that came after the reservation,
    assert t.claim("b", arrival=5) is None
    t.pin(t.claim("b", arrival=4))  # ... those queued before it still join
    assert t.claim("a", arrival=6) == 1  # ... and the other slots go on
    assert t.claim("c", arrival=3) is None  # b's sequences still run
    t.unpin(2)
    t.unpin(2)
    assert t.claim("c", arrival=3) == 2 and t.reserved == {}
    assert t.take_loads()[-1] == (2, "c")


def test_reservations_of_adapters_that_stopped_waiting_are_dropped():
    t = SlotTable(1)
    t.pin(t.claim("a"))
    assert t.claim("b") is None and t.reserved == {1: "b"}
    t.keep_reservations({"a"})  # b's requests were aborted
    assert t.reserved == {} and t.claim("a") == 1


def test_pins_are_counted():
    t = SlotTable(1)
    with pytest.raises(RuntimeError, match="unpinned more often"):
        t.unpin(1)
    t.pin(t.claim("a"))
    with pytest.raises(AssertionError, match="1 pins, 0 running"):
        t.check_invariant({})
    assert not t.forget("a")  # pinned
    t.unpin(1)
    assert t.forget("a") and t.keys == [None, None]


# -------------------------------------------------------------- AdapterCache


def _loader(reads):
    def load(request):
        reads.append(request.lora_int_id)
        return Adapter(request, f"key-{request.lora_path}", 4, {})

    return load


def test_host_cache_keeps_what_live_requests_use():
    reads = []
    cache = AdapterCache(2, _loader(reads))
    a, b, c = (LoRARequest(n, i, f"/{n}") for i, n in enumerate("abc", 1))
    cache.get(a)
    cache.acquire(1)
    cache.get(b)
    cache.get(c)  # over capacity: b (unused, least recent) goes, a stays (in use)
    assert [x.request for x in cache.adapters()] == [a, c]
    cache.get(a)
    assert reads == [1, 2, 3]  # a was not read again
    with pytest.raises(ValueError, match="used by 1 live request"):
        cache.remove(1)
    cache.release(1)
    assert cache.remove(1).request == a and cache.remove(1) is None


def test_an_id_names_one_adapter_while_it_is_used():
    cache = AdapterCache(4, _loader([]))
    cache.get(LoRARequest("a", 1, "/a"))
    cache.acquire(1)
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'a'.*give another adapter"):
        cache.get(LoRARequest("other", 1, "/other"))
    cache.release(1)  # unused now: the id may name another adapter
    assert cache.get(LoRARequest("other", 1, "/other")).key == "key-/other"


# ------------------------------------------------ the scheduler, through the engine

MODEL = mock_model()
MODULES = {"layers.0.self_attn.q_proj": (8, 8)}


class LoRAMockRunner(MockRunner):
    """The mock runner with a device of LoRA slots: which adapter each one holds."""

    def __init__(self, config, num_pages):
        super().__init__(config, num_pages)
        self.lora = types.SimpleNamespace(layout=lambda: LoRALayout(MODULES, max_rank=8))
        self.device_slots = {}
        self.writes = 0

    def load_lora(self, slot, adapter):
        self.device_slots[slot] = adapter.key
        self.writes += 1


def lora_engine(*, max_loras, async_scheduling=False, **kw) -> LLMEngine:
    config = engine_config(
        "mock",
        MODEL,
        max_model_len=256,
        block_size=4,
        num_kv_pages=kw.pop("num_pages", 64),
        max_num_seqs=kw.pop("max_num_seqs", 8),
        max_num_batched_tokens=32,
        min_token_bucket=16,
        warmup=False,
        enable_lora=True,
        max_loras=max_loras,
        async_scheduling=async_scheduling,
        **kw,
    )
    engine = LLMEngine(config, runner=LoRAMockRunner(config, config.cache.num_pages))
    dispatch = engine.pipeline.dispatch
    engine.steps = []  # per step: the adapter keys of its sequences
    engine.sizes = []  # per step: how many sequences

    def checked(plan, rows, prev=None):
        # Every sequence's slot holds its adapter on the device when its step runs,
        # the batch lists sequences by slot, and no more adapters run than slots.
        slots = [item.seq.lora_slot for item in plan.scheduled]
        assert slots == sorted(slots)
        for item in plan.scheduled:
            seq = item.seq
            if seq.lora_key is None:
                assert seq.lora_slot == 0
            else:
                assert engine.runner.device_slots[seq.lora_slot] == seq.lora_key
        keys = {item.seq.lora_key for item in plan.scheduled} - {None}
        assert len(keys) <= max_loras
        engine.steps.append(keys)
        engine.sizes.append(len(plan.scheduled))
        return dispatch(plan, rows, prev)

    engine.pipeline.dispatch = checked
    return engine


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [write_adapter(root / f"a{i}", MODULES, seed=i) for i in range(4)]


def _request(i, lora, max_tokens=6, prompt_len=5):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [(7 * i + j) % 900 + 3 for j in range(prompt_len)]
    return GenerateRequest(str(i), prompt, params, lora=lora)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_more_adapters_than_slots_all_run_and_slots_hold_theirs(adapter_dirs, async_scheduling):
    engine = lora_engine(max_loras=2, async_scheduling=async_scheduling)
    loras = [None] + [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(adapter_dirs)]
    for i in range(15):
        engine.add_request(_request(i, loras[i % 5]))
    done = {}
    engine.run(lambda out: done.__setitem__(out.request_id, out) if out.finished else None)
    assert sorted(done, key=int) == [str(i) for i in range(15)]
    assert all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    slots = engine.adapters.slots
    slots.check_invariant({})
    assert slots.num_evictions > 0 and engine.runner.writes == slots.num_loads
    engine.pool.check_invariant()
    # The adapters' pages never stay pinned in host memory once their requests are done.
    assert all(engine.adapters.cache.in_use(i) == 0 for i in range(1, 5))


def test_an_adapter_waiting_for_a_slot_is_not_starved(adapter_dirs):
    """One slot; adapter A's requests keep coming, one each step; B's request arrives
    early and gets the slot once the A requests queued when it reserved the slot
    finish, before the A requests that came after."""
    engine = lora_engine(max_loras=1, max_num_seqs=4)
    a = LoRARequest("a", 1, adapter_dirs[0])
    b = LoRARequest("b", 2, adapter_dirs[1])
    engine.add_request(_request(0, a, max_tokens=8))
    engine.step()
    engine.add_request(_request(1, b, max_tokens=3))
    b_key = engine.requests["1"].seqs[0].lora_key
    finished = []
    for i in range(2, 14):  # another A request every step
        engine.add_request(_request(i, a, max_tokens=8))
        finished += [o.request_id for o in engine.step() if o.finished]
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    # B (3 tokens) reserved the slot at the step after it came, when A's request 2 was
    # queued too: it ran as soon as requests 0 and 2 finished, before every A request
    # that came after its reservation, alone in the slot.
    assert finished[:3] == ["0", "2", "1"] and len(finished) == 14
    b_steps = [i for i, keys in enumerate(engine.steps) if b_key in keys]
    assert len(b_steps) == 3 and all(engine.steps[i] == {b_key} for i in b_steps)
    assert b_steps[0] == 9  # request 2's 8 steps (from step 1), then B's


def test_a_batch_over_more_adapters_than_slots_runs_in_two_waves(adapter_dirs, tmp_path):
    """16 requests over 8 adapters, 4 slots, all queued at once: the first wave runs
    every request of the 4 resident adapters (8), the second the other 8 (the slots'
    reservations hold back only requests that come after them)."""
    dirs = adapter_dirs + [write_adapter(tmp_path / f"b{i}", MODULES, seed=9 + i) for i in range(4)]
    engine = lora_engine(max_loras=4, max_num_seqs=16, max_cpu_loras=8)
    loras = [LoRARequest(f"x{i}", i + 1, d) for i, d in enumerate(dirs)]
    for i in range(16):
        engine.add_request(_request(i, loras[i % 8], max_tokens=4))
    engine.run(lambda out: None)
    # 8 at a time (not 4: one request per adapter); two waves of 4 tokens, a step
    # more each where the 32-token budget chunks a prompt.
    assert max(engine.sizes) == 8 and len(engine.sizes) <= 10
    assert engine.adapters.slots.num_loads == 8


def test_requests_without_adapters_pass_one_waiting_for_a_slot(adapter_dirs):
    engine = lora_engine(max_loras=1)
    a, b = (LoRARequest(n, i + 1, adapter_dirs[i]) for i, n in enumerate("ab"))
    engine.add_request(_request(0, a, max_tokens=10))
    engine.step()
    engine.add_request(_request(1, b))  # waits for the slot
    engine.add_request(_request(2, None))  # no adapter: admitted at once
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert running == {"0", "2"}


def test_bad_adapters_are_refused_at_add_and_the_engine_keeps_serving(adapter_dirs, tmp_path):
    engine = lora_engine(max_loras=1)
    bad = write_adapter(tmp_path / "bad", {"layers.0.self_attn.q_proj": (8, 9)})
    with pytest.raises(ParamError, match="maps 8 -> 9 features") as e:
        engine.add_request(_request(0, LoRARequest("bad", 7, bad)))
    assert e.value.field == "lora"
    with pytest.raises(ParamError, match="not a directory"):
        engine.add_request(_request(1, LoRARequest("gone", 8, str(tmp_path / "gone"))))
    assert not engine.requests and not engine.has_unfinished()
    engine.add_request(_request(2, LoRARequest("good", 1, adapter_dirs[0])))
    engine.add_request(_request(3, None))
    done = []
    engine.run(lambda out: done.append(out.request_id) if out.finished else None)
    assert sorted(done) == ["2", "3"]


def test_add_remove_and_list_adapters(adapter_dirs):
    engine = lora_engine(max_loras=1)
    a = LoRARequest("a", 1, adapter_dirs[0])
    assert engine.adapters.add(a) and engine.adapters.list() == {1}
    engine.add_request(_request(0, a, max_tokens=20))
    engine.step()
    with pytest.raises(ValueError, match="used by 1 live request"):
        engine.adapters.remove(1)
    engine.abort("0")
    assert engine.adapters.remove(1) and engine.adapters.list() == set()
    assert engine.adapters.slots.keys == [None, None]  # its slot emptied
    assert not engine.adapters.remove(1)


def test_an_engine_without_lora_refuses_adapters():
    config = engine_config(
        "mock", MODEL, max_model_len=256, block_size=4, num_kv_pages=16, warmup=False
    )
    engine = LLMEngine(config, runner=MockRunner(config, 16))
    assert engine.adapters is None
    with pytest.raises(ParamError, match="serves no LoRA adapters.*enable_lora") as e:
        engine.add_request(_request(0, LoRARequest("a", 1, "/a")))
    assert e.value.field == "lora"
