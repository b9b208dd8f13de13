"""Multi-LoRA through the engine with a real (tiny) model: no compilation while adapters
come and go, the prefix cache keyed by adapter, the offline API, bad adapters refused
while the engine serves on, and the combinations refused at start-up. (Parity with
PEFT: tests/models_tests/test_lora_parity.py; tensor parallelism: lora_tp_check.py.)"""

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from cache_dir import env_without_compilation_cache
from engine_utils import SMALL_LLM, engine_config
from fake_devices import run_on_8_devices
from hf_models import CASES, make_hf_model
from lora_files import adapters, write_adapter

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.config import LoRAConfig
from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import ParamError

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_llm(path, **kw):
    return LLM(path, **{**SMALL_LLM, **LORA, **kw})


def prompts(n: int, seed: int = 0, length: int = 12) -> list[dict]:
    rs = np.random.RandomState(seed)
    return [{"prompt_token_ids": rs.randint(3, 320, size=length + i).tolist()} for i in range(n)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_compilation_while_adapters_load_swap_and_unload(
    tiny_model_dir, tmp_path, async_scheduling
):
    llm = make_llm(
        tiny_model_dir,
        warmup=True,
        compile_guard=True,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_cpu_loras=4,
        async_scheduling=async_scheduling,
    )
    assert "lora slot write" in llm.engine.compiled  # compiled at warm-up
    compiled = llm.engine.runner.compiles.count
    loras = adapters(llm, tmp_path, 4)  # four adapters, two slots
    batch = prompts(6)
    for i in range(3):
        per_prompt = [loras[(i + j) % 4] if j % 3 else None for j in range(len(batch))]
        llm.generate(batch, GREEDY, lora_request=per_prompt, use_tqdm=False)
    adapters_ = llm.engine.adapters
    assert adapters_.slots.num_evictions > 0
    assert adapters_.remove(1) and adapters_.remove(2)  # unloaded ...
    llm.generate(batch, GREEDY, lora_request=loras[0], use_tqdm=False)  # ... and back
    assert llm.engine.runner.compiles.count == compiled


def test_a_step_without_adapters_runs_the_base_models_program(tiny_model_dir, tmp_path):
    llm = make_llm(tiny_model_dir, warmup=True, max_num_batched_tokens=32, max_num_seqs=4)
    runner = llm.engine.runner
    t = max(runner.token_buckets)
    assert "lora_dense" in llm.engine.compiled[f"forward T={t} lora"].as_text()
    assert "lora_dense" not in llm.engine.compiled[f"forward T={t}"].as_text()
    with_slots = []  # per step: whether the forward got the tokens' slots

    def spy(model_def, weights, kv_caches, batch, *rest):
        with_slots.append(batch.layout.shapes().lora_slots[0] > 0)  # (a packed StepInput)
        return forward(model_def, weights, kv_caches, batch, *rest)

    forward = runner.programs.forward
    runner.programs = dataclasses.replace(runner.programs, forward=spy)
    base = tokens(llm.generate(prompts(3), GREEDY, use_tqdm=False))
    assert with_slots and not any(with_slots)
    lora = adapters(llm, tmp_path, 1)[0]
    with_slots.clear()
    llm.generate(prompts(3), GREEDY, lora_request=[None, lora, None], use_tqdm=False)
    assert with_slots and all(with_slots)
    plain = LLM(tiny_model_dir, **{**SMALL_LLM, "max_num_batched_tokens": 32, "max_num_seqs": 4})
    assert base == tokens(plain.generate(prompts(3), GREEDY, use_tqdm=False))


def test_adapters_change_outputs_and_mixing_them_changes_none(tiny_model_dir, tmp_path):
    """A prompt's tokens under an adapter are the same alone or batched with other
    adapters and the base model, and differ from the base model's."""
    llm = make_llm(tiny_model_dir)
    a, b = adapters(llm, tmp_path, 2, rank=8)
    batch = prompts(3)
    alone = {
        name: tokens(llm.generate(batch, GREEDY, lora_request=lora, use_tqdm=False))
        for name, lora in (("base", None), ("a", a), ("b", b))
    }
    assert alone["a"] != alone["base"] != alone["b"] != alone["a"]
    llm.engine.pool.reset_prefix_cache()
    mixed = tokens(
        llm.generate(batch * 3, GREEDY, lora_request=[None] * 3 + [a] * 3 + [b] * 3, use_tqdm=False)
    )
    assert mixed == alone["base"] + alone["a"] + alone["b"]


def test_prefix_pages_are_shared_within_an_adapter_only(tiny_model_dir, tmp_path):
    llm = make_llm(tiny_model_dir)
    a, b = adapters(llm, tmp_path, 2)
    # The same files under another id: the same adapter, its pages shared.
    a_again = LoRARequest("a-again", 9, a.lora_path)
    prompt = prompts(1, length=30)

    def cached(lora):
        return llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0  # two adapters never share KV pages
    assert cached(None) == 0  # nor an adapter and the base model
    assert cached(a) == 24 and cached(b) == 24 and cached(None) == 24  # each its own
    assert cached(a_again) == 24


def test_generate_takes_one_adapter_per_prompt(tiny_model_dir, tmp_path):
    llm = make_llm(tiny_model_dir)
    (a,) = adapters(llm, tmp_path, 1)
    with pytest.raises(ParamError, match="got 1 lora_requests for 2 prompts"):
        llm.generate(prompts(2), GREEDY, lora_request=[a], use_tqdm=False)
    with pytest.raises(ParamError, match="lora must be a LoRARequest"):
        llm.generate(prompts(1), GREEDY, lora_request=["ad0"], use_tqdm=False)
    out = llm.generate(prompts(2), GREEDY, lora_request=[a, None], use_tqdm=False)
    assert len(out) == 2


def test_a_bad_adapter_fails_its_call_and_the_engine_serves_on(tiny_model_dir, tmp_path):
    llm = make_llm(tiny_model_dir)
    (good,) = adapters(llm, tmp_path, 1)
    too_big = write_adapter(tmp_path / "big", {"layers.0.self_attn.q_proj": (64, 64)}, rank=16)
    bad = LoRARequest("big", 5, too_big)
    with pytest.raises(ParamError, match=r"prompts\[1\].*rank 16, over max_lora_rank=8") as e:
        llm.generate(prompts(2), GREEDY, lora_request=[good, bad], use_tqdm=False)
    assert e.value.field == "lora"
    assert not llm.engine.requests and llm.engine.adapters.cache.in_use(1) == 0
    assert len(llm.generate(prompts(2), GREEDY, lora_request=good, use_tqdm=False)) == 2


def test_unsupported_combinations_are_refused_at_start_up(tiny_model_dir):
    with pytest.raises(
        ValueError, match="enable_lora with speculative_config.method 'draft_model'"
    ):
        engine_config(
            tiny_model_dir,
            enable_lora=True,
            speculative_config=dict(
                method="draft_model", model=tiny_model_dir, num_speculative_tokens=2
            ),
        )
    with pytest.raises(ValueError, match="enable_lora with num_processes=2"):
        engine_config(tiny_model_dir, enable_lora=True, num_processes=2, coordinator_address="h:1")
    # n-gram speculation works with adapters (its drafts are the sequence's own tokens).
    engine_config(
        tiny_model_dir,
        enable_lora=True,
        speculative_config=dict(method="ngram", num_speculative_tokens=2),
    )
    for bad, words in [
        (dict(max_loras=0), "max_loras must be a positive integer"),
        (dict(max_lora_rank=1024), "max_lora_rank must be at most 512"),
        (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras must be an integer >= max_loras"),
        (dict(enable_lora="yes"), "enable_lora must be a bool"),
    ]:
        with pytest.raises(ValueError, match=words):
            LoRAConfig(**bad)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3


@pytest.mark.slow
def test_ngram_speculation_with_adapters_matches_without(tiny_model_dir, tmp_path):
    plain = make_llm(tiny_model_dir)
    loras = adapters(plain, tmp_path, 2)
    spec = make_llm(
        tiny_model_dir, speculative_config=dict(method="ngram", num_speculative_tokens=3)
    )
    rs = np.random.RandomState(1)
    motif = rs.randint(3, 320, size=5).tolist()
    batch = [{"prompt_token_ids": motif * 4 + [i + 3]} for i in range(4)]
    params = dataclasses.replace(GREEDY, max_tokens=12)
    per_prompt = [loras[0], loras[1], None, loras[0]]
    want = tokens(plain.generate(batch, params, lora_request=per_prompt, use_tqdm=False))
    got = tokens(spec.generate(batch, params, lora_request=per_prompt, use_tqdm=False))
    assert got == want


@pytest.mark.slow
@pytest.mark.sharded
def test_tensor_parallel_lora_equals_one_device(tmp_path):
    """Over float, int8 and fp8 weights of a small Llama; over int4 weights of the demo
    model (the small one's 64 o_proj inputs are one group, which no split keeps
    whole)."""
    arch, base = CASES["llama2_mha"]
    make_hf_model(tmp_path, arch, base)
    stdout = run_on_8_devices("lora_tp_check.py", tmp_path, "2", tmp_path, "none,int8,fp8")
    stdout += run_on_8_devices(
        "lora_tp_check.py", EMBEDDED_MODELS["demo-model"], "2", tmp_path / "demo", "int4"
    )
    for name in ("", " int8", " fp8", " int4"):
        assert f"lora{name} tp=2: ok" in stdout, stdout


# Runs in a fresh process: `make` warms up (the LoRA slot write among the programs) and
# writes a bundle, `load` serves from it; both serve prompts under adapters swapping
# through two slots and print the tokens and the compilations of the serving loop.
BUNDLE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[4])
from lora_files import write_adapter
from jaxserve import LLM, LoRARequest, SamplingParams
mode, bundle_dir, adapter_dir = sys.argv[1], sys.argv[2], sys.argv[3]
kw = dict(compilation_cache_dir=None, compile_guard=True, skip_tokenizer_init=True,
          max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=128,
          enable_lora=True, max_loras=2, max_lora_rank=8)
if mode == "make":
    llm = LLM("demo-model-tiny", **kw)
    llm.save_compiled(bundle_dir)
    for i in range(3):
        write_adapter(f"{adapter_dir}/a{i}", llm.engine.adapters.layout.modules, seed=i)
else:
    llm = LLM("demo-model-tiny", compiled=bundle_dir, **kw)
before = llm.engine.runner.compiles.count
loras = [None] + [LoRARequest(f"a{i}", i + 1, f"{adapter_dir}/a{i}") for i in range(3)]
prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 2 * i))} for i in range(8)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                    lora_request=[loras[i % 4] for i in range(8)], use_tqdm=False)
print("RESULT " + json.dumps({
    "tokens": [o.outputs[0].token_ids for o in outs],
    "serving_compiles": llm.engine.runner.compiles.count - before,
    "programs": sorted(llm.engine.compiled),
    "swaps": llm.engine.adapters.slots.num_evictions,
}))
"""


def _bundle_run(mode: str, tmp_path) -> dict:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [mode, str(tmp_path / "bundle"), str(tmp_path), tests]
    proc = subprocess.run(  # (without the tests' cache: `make` compiles what it saves)
        [sys.executable, "-c", BUNDLE_SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env_without_compilation_cache(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_a_bundle_serves_adapters_compiling_nothing(tmp_path):
    made = _bundle_run("make", tmp_path)
    assert "lora slot write" in made["programs"] and made["swaps"] > 0
    loaded = _bundle_run("load", tmp_path)
    assert loaded["programs"] == made["programs"]
    assert loaded["serving_compiles"] == made["serving_compiles"] == 0
    assert loaded["tokens"] == made["tokens"]


def test_update_weights_is_refused_with_adapters_and_the_engine_serves_on(tiny_model_dir, tmp_path):
    """The adapters' projections wrap the base weights: an update is refused, naming
    enable_lora, and nothing changes."""
    llm = make_llm(tiny_model_dir)
    (adapter,) = adapters(llm, tmp_path, 1)
    want = tokens(llm.generate(prompts(2), GREEDY, lora_request=adapter, use_tqdm=False))
    runner = llm.engine.runner
    with pytest.raises(ValueError, match="enable_lora"):
        llm.update_weights(runner.model_def.state(runner.weights))
    with pytest.raises(ValueError, match="enable_lora"):
        llm.update_weights(path=tiny_model_dir)
    assert llm.engine.weight_version == 0
    assert tokens(llm.generate(prompts(2), GREEDY, lora_request=adapter, use_tqdm=False)) == want


def test_stats_count_slots_loads_and_requests_per_adapter(tiny_model_dir, tmp_path):
    """The stats (and so Prometheus) say which adapters' requests run and wait, the
    slots in use, and the loads and evictions; each of a request's samples counts."""
    llm = make_llm(tiny_model_dir, max_num_seqs=4, max_cpu_loras=3)
    a, b, c = adapters(llm, tmp_path, 3)
    engine = llm.engine
    assert engine.stats().lora_slots == 2 and engine.stats().lora_requests_running == ()
    two = SamplingParams(temperature=1.0, n=2, max_tokens=4, ignore_eos=True)
    for i, (lora, params) in enumerate([(a, two), (a, GREEDY), (b, GREEDY), (c, GREEDY)]):
        ids = prompts(1, seed=i)[0]["prompt_token_ids"]
        engine.add_request(GenerateRequest(f"r{i}", ids, params, lora=lora))
    engine.step()  # r0's second sample waits for its first's prompt; c for a slot
    s = engine.stats()
    assert s.lora_requests_running == (("ad0", 2), ("ad1", 1))
    assert s.lora_requests_waiting == (("ad0", 1), ("ad2", 1))
    assert (s.lora_slots_in_use, s.lora_loads, s.lora_evictions) == (2, 2, 0)
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert s.lora_requests_running == s.lora_requests_waiting == ()
    assert (s.lora_slots_in_use, s.lora_loads, s.lora_evictions) == (2, 3, 1)


def held_reads(tiny_model_dir, tmp_path, monkeypatch):
    """An async front whose adapter reads wait for `release` (`started` once one has
    begun; `readers`: the threads that read), and an adapter `a` for it to read."""
    import jaxserve.engine.adapters as engine_adapters
    from jaxserve.async_engine import AsyncLLMEngine
    from jaxserve.engine import LLMEngine

    started, release, readers = threading.Event(), threading.Event(), []
    load = engine_adapters.load_adapter

    def slow_load(*args):
        readers.append(threading.current_thread().name)
        started.set()
        release.wait(timeout=60)
        return load(*args)

    monkeypatch.setattr(engine_adapters, "load_adapter", slow_load)
    front = AsyncLLMEngine(LLMEngine(engine_config(tiny_model_dir, **LORA)))
    modules = front.engine.adapters.layout.modules
    a = LoRARequest("a", 1, write_adapter(tmp_path / "a", modules, seed=1))
    return front, a, started, release, readers


def test_the_engine_steps_while_an_added_adapter_is_read(tiny_model_dir, tmp_path, monkeypatch):
    """`add_lora` reads and checks the files on a worker thread: a request without the
    adapter streams to its end while the read is held up (a large adapter, a slow disk),
    and the engine thread only keeps what was read."""
    front, a, started, release, readers = held_reads(tiny_model_dir, tmp_path, monkeypatch)

    async def main():
        add = asyncio.create_task(front.add_lora(a))
        assert await asyncio.to_thread(started.wait, 60)
        ids = prompts(1)[0]["prompt_token_ids"]
        stream = front.generate(GenerateRequest("plain", ids, GREEDY))
        outputs = await asyncio.wait_for(_collect(stream), 60)  # (not held up by the read)
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 6
        assert not add.done() and await front.list_loras() == []
        release.set()
        assert await add is True and await front.list_loras() == [a]

    run_held(front, release, readers, main)
    assert front.engine.adapters.cache.num_reads == 1


def test_a_request_naming_an_adapter_not_held_reads_it_off_the_engine_thread(
    tiny_model_dir, tmp_path, monkeypatch
):
    """An adapter first named by a request (never added, or dropped from host memory)
    is read on a worker thread before the request is queued: another request streams
    to its end while the read is held up (it was read on the engine thread, between
    two steps, holding every request up)."""
    front, a, started, release, readers = held_reads(tiny_model_dir, tmp_path, monkeypatch)
    ids = prompts(1)[0]["prompt_token_ids"]

    async def main():
        named = asyncio.create_task(
            _collect(front.generate(GenerateRequest("a", ids, GREEDY, lora=a)))
        )
        assert await asyncio.to_thread(started.wait, 60)
        plain = front.generate(GenerateRequest("plain", ids, GREEDY))
        outputs = await asyncio.wait_for(_collect(plain), 60)  # (not held up by the read)
        assert outputs[-1].finished and not named.done()
        release.set()
        done = await asyncio.wait_for(named, 60)
        assert done[-1].finished and len(done[-1].outputs[0].token_ids) == 6

    run_held(front, release, readers, main)


def run_held(front, release, readers, main) -> None:
    """Runs `main` (which releases the held read), then closes the front: the adapter
    was read once, off the engine thread."""
    try:
        asyncio.run(main())
    finally:
        release.set()
        front.close()
    assert readers == [readers[0]] and readers[0] != "jaxserve-engine"


async def _collect(stream) -> list:
    return [out async for out in stream]


def test_disaggregated_pages_carry_their_adapter(tiny_model_dir, tmp_path):
    """Pages a prefill instance computed under an adapter are exported under it: a
    decode instance (with the same adapter files) finds them for that adapter's
    requests only, and generates what one engine does."""
    prefill = make_llm(tiny_model_dir)
    decode = make_llm(tiny_model_dir, kv_offload_bytes=16 << 20)
    a, b = adapters(prefill, tmp_path, 2)
    prompt = prompts(1, length=20)[0]
    want = tokens(prefill.generate(prompt, GREEDY, lora_request=a, use_tqdm=False))
    ids = prompt["prompt_token_ids"]
    assert prefill.engine.export_prefix(ids) == []  # not the base model's pages
    pages = prefill.engine.export_prefix(ids, lora=a)
    assert len(pages) == len(ids) // 8
    assert decode.engine.import_pages(pages) == len(pages)
    (other,) = decode.generate(prompt, GREEDY, lora_request=b, use_tqdm=False)
    assert other.num_cached_tokens == 0  # another adapter: none of them
    (out,) = decode.generate(prompt, GREEDY, lora_request=a, use_tqdm=False)
    assert out.num_cached_tokens == len(pages) * 8 and tokens([out]) == want
    with pytest.raises(ParamError, match="enable_lora is off"):
        LLM(tiny_model_dir, **SMALL_LLM).engine.export_prefix(ids, lora=a)


def test_structured_output_with_adapters_mixed_in_one_batch(tiny_model_dir, tmp_path):
    """Grammars constrain adapters' tokens as the base model's: every output obeys
    its regex or choice, and each one is what its adapter gives alone."""
    from jaxserve.sampling_params import StructuredOutputsParams as SO

    llm = make_llm(tiny_model_dir, max_cpu_loras=2)
    a, b = adapters(llm, tmp_path, 2)
    specs = [SO(regex="[a-e]{2,8}"), SO(choice=["yes", "no", "maybe"])]
    loras, params, ps = [], [], []
    for lora in (None, a, b):
        for spec in specs:
            loras.append(lora)
            params.append(SamplingParams(temperature=0, max_tokens=12, structured_outputs=spec))
            ps.append("Answer:")
    mixed = llm.generate(ps, params, lora_request=loras, use_tqdm=False)
    for out, spec in zip(mixed, specs * 3, strict=True):
        text = out.outputs[0].text
        assert re.fullmatch(spec.regex, text) if spec.regex else text in spec.choice, text
    for i in range(len(ps)):  # alone, the same
        (solo,) = llm.generate(ps[i], params[i], lora_request=loras[i], use_tqdm=False)
        assert solo.outputs[0].text == mixed[i].outputs[0].text
    assert len({o.outputs[0].text for o in mixed[::2]}) > 1  # (the adapters do differ)


def test_every_front_adds_removes_and_lists_adapters(tiny_model_dir, tmp_path):
    """vLLM's add_lora, remove_lora and list_loras through `AsyncLLMEngine`, a
    `DataParallelEngine` of two replicas (on this one device), and a Ray replica (its
    handle and actor, without Ray: `ray_fakes`); a front of an engine without
    enable_lora says so."""
    from ray_fakes import ray_replica

    from jaxserve.async_engine import AsyncLLMEngine
    from jaxserve.distributed.data_parallel import DataParallelEngine
    from jaxserve.engine import LLMEngine

    engines = [LLMEngine(engine_config(tiny_model_dir, **LORA)) for _ in range(3)]
    modules = engines[0].adapters.layout.modules
    a = LoRARequest("a", 1, write_adapter(tmp_path / "a", modules, seed=1))
    b = LoRARequest("b", 2, write_adapter(tmp_path / "b", modules, seed=2))
    bad = LoRARequest("bad", 3, str(tmp_path / "missing"))
    single = AsyncLLMEngine(engines[0])
    replicas = DataParallelEngine([single, AsyncLLMEngine(engines[1])], engines[0].config)
    handle, actor = ray_replica(engines[2])
    plain = AsyncLLMEngine(LLMEngine(engine_config(tiny_model_dir)))

    async def main():
        for front in (replicas, handle):
            assert await front.list_loras() == []
            assert await front.add_lora(a) is True and await front.add_lora(b) is True
            assert await front.list_loras() == [a, b]
            with pytest.raises(ParamError, match="lora_path is not a directory") as e:
                await front.add_lora(bad)
            assert e.value.field == "lora" and await front.list_loras() == [a, b]
            assert await front.remove_lora(1) is True and await front.list_loras() == [b]
            assert await front.remove_lora(1) is False
        assert await single.list_loras() == [b] and list(engines[1].adapters.loaded()) == [b]
        assert await plain.list_loras() == []
        for call in (plain.add_lora(a), plain.remove_lora(1)):
            with pytest.raises(ValueError, match=r"start it with enable_lora=True"):
                await call
        handle.config = plain.engine.config
        handle.actor = None  # (refused before the actor is asked)
        with pytest.raises(ValueError, match=r"start it with enable_lora=True"):
            await handle.add_lora(a)

    try:
        replicas.run_sync(main())
    finally:
        for front in (replicas, actor.engine, plain):
            front.close()
