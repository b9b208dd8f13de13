"""In-place weight updates (`LLM.update_weights`, `LLMEngine.update_weights`) and
`reset_prefix_cache`.

Two checkpoints of one small Llama, W (`tiny_model_dir`) and W' (another seed): their
greedy outputs differ from the first token, so a step that read KV computed with the
other weights would show. Every test compares against a fresh engine built with the
weights it updates to.
"""

import glob
import os
import shutil
from collections.abc import Callable

import jax
import numpy as np
import pytest
from engine_utils import SMALL_LLM
from flax import nnx
from safetensors.numpy import load_file
from test_engine import shared_prefix_prompts

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import convert, load_model, save_weights
from jaxserve.config import ModelConfig
from jaxserve.generate_request import GenerateRequest
from jaxserve.kv.page_pool import ROOT_UID, PagePool
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import ROOT_DIGEST, ArraySpec, KVLayout, Page, encode_page, page_digest

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = shared_prefix_prompts()  # six prompts sharing up to 21 tokens (pages of 8)
# A pool too small for the prompts: pages go to the tier and come back from it.
BUSY = dict(num_kv_pages=14, max_num_batched_tokens=16, max_num_seqs=4, min_token_bucket=8)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def make(path, **kw) -> LLM:
    return LLM(path, skip_tokenizer_init=True, **{**SMALL_LLM, **kw})


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def state_of(path: str, dtype: str = "float32"):
    """The float model's nnx.State loaded from `path` (one device, uncommitted)."""
    return nnx.state(load_model(path, ModelConfig.from_pretrained(path), dtype=dtype))


def hf_tensors(path: str) -> dict[str, np.ndarray]:
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def new_dir(tiny_model_dir_new):
    """W': the same architecture and shapes as `tiny_model_dir`, other weights."""
    return tiny_model_dir_new


@pytest.fixture(scope="module")
def fresh_new(new_dir):
    """A fresh engine of W'."""
    return make(new_dir, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def want_new(fresh_new):
    return tokens(fresh_new)


@pytest.fixture(scope="module")
def want_old(tiny_model_dir):
    return tokens(make(tiny_model_dir, enable_prefix_caching=False))


def assert_versions(outs, version: int, first: int) -> None:
    assert [(o.weight_version, o.first_weight_version) for o in outs] == [(version, first)] * len(
        outs
    )


# ------------------------------------------------------------ no stale KV


@pytest.mark.slow
def test_outputs_after_an_update_equal_a_fresh_engine_with_cache_and_tier(
    tiny_model_dir, new_dir, want_old, want_new, tmp_path
):
    """Prompts run twice under W (the second round hits the prefix cache and the host
    and disk tier), then under W' after the update: the fresh W' engine's outputs,
    and every page of W gone from the pool's cache and from the tier."""
    assert want_old != want_new
    llm = make(tiny_model_dir, **BUSY, kv_offload_bytes=1 << 22, kv_offload_dir=str(tmp_path))
    engine = llm.engine
    assert tokens(llm) == want_old
    assert tokens(llm) == want_old
    engine.kv_connector.flush()
    assert engine.tier.stats.loads > 0 and engine.scheduler.prefix_hits > 0
    old_folder, old_layout = engine.tier.disk.folder, engine.kv_layout
    assert glob.glob(os.path.join(old_folder, "*.kvpage"))

    assert llm.update_weights(state_of(new_dir)) == 1
    assert engine.pool.num_cached == 0 and engine.tier.host_used == 0
    assert not glob.glob(os.path.join(old_folder, "*.kvpage"))
    # The new weights' pages carry another fingerprint, in another folder.
    assert engine.tier.layout == engine.kv_layout == engine.runner.kv_layout()
    assert engine.kv_layout.fingerprint != old_layout.fingerprint
    assert engine.tier.disk.folder != old_folder
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_new
    assert_versions(outs, 1, 1)
    assert tokens(llm) == want_new  # the new weights' pages, cached and reused
    engine.pool.check_invariant()


@pytest.mark.parametrize("kept", ["all the KV", "the tier's pages"])
def test_the_comparison_sees_kv_of_the_old_weights(tiny_model_dir, new_dir, want_new, kept):
    """What the test above would catch: weights swapped with the old KV kept -- all
    of it, or only the tier's pages -- give other outputs than the fresh engine's."""
    llm = make(tiny_model_dir, **BUSY, kv_offload_bytes=1 << 22)
    tokens(llm)
    engine = llm.engine
    engine.save_kv_tier()  # every cached page in the tier too
    runner = engine.runner
    runner.swap_weights(runner.prepare_weights(state_of(new_dir)))
    if kept == "the tier's pages":
        engine.pool.reset_prefix_cache()
    assert tokens(llm) != want_new


MID = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def start_mid_generation(engine, prompts) -> tuple[dict, dict, Callable]:
    """`prompts` running on `engine` with 3 tokens or more each; what each output said
    (its new tokens and their weight version), the final outputs, and the recorder."""
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), p, MID))
    seen: dict[str, list] = {str(i): [] for i in range(len(prompts) + 1)}
    finals = {}

    def record(out):
        seen[out.request_id].append((out.outputs[0].delta_token_ids, out.weight_version))
        if out.finished:
            finals[out.request_id] = out

    while min(sum(len(d) for d, _ in seen[str(i)]) for i in range(len(prompts))) < 3:
        for out in engine.step():
            record(out)
    return seen, finals, record


def assert_switched(seen, finals, prompts, old: LLM, fresh_new: LLM) -> int:
    """Each request's tokens sampled by W (version 0) are W's greedy ones, the rest W''s
    greedy continuation of them (their KV recomputed); returns how many W sampled."""
    drained = 0
    for i in range(len(prompts)):
        rid = str(i)
        versions = [v for d, v in seen[rid] if d]
        assert versions == sorted(versions) and set(versions) == {0, 1}
        got = [t for d, _ in seen[rid] for t in d]
        assert got == finals[rid].outputs[0].token_ids and len(got) == MID.max_tokens
        k = sum(len(d) for d, v in seen[rid] if v == 0)
        drained += k
        assert got[:k] == tokens(old, [{"prompt_token_ids": prompts[i]}], MID)[0][:k]
        rest = SamplingParams(temperature=0.0, max_tokens=MID.max_tokens - k, ignore_eos=True)
        assert got[k:] == tokens(fresh_new, [{"prompt_token_ids": prompts[i] + got[:k]}], rest)[0]
        assert (finals[rid].weight_version, finals[rid].first_weight_version) == (1, 0)
    return drained


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_update_mid_generation(tiny_model_dir, new_dir, fresh_new, async_scheduling):
    """Requests running when the weights change finish: their tokens up to the update
    are W's greedy ones, the rest W''s greedy continuation of them (their KV
    recomputed), and each output says which weights sampled it."""
    llm = make(tiny_model_dir, async_scheduling=async_scheduling)
    engine = llm.engine
    prompts = [p["prompt_token_ids"] for p in PROMPTS[:4]]
    seen, finals, record = start_mid_generation(engine, prompts)
    before = sum(len(d) for s in seen.values() for d, _ in s)
    assert engine.update_weights(state_of(new_dir)) == 1
    assert not engine.scheduler.running  # all preempted, to recompute their KV
    engine.add_request(GenerateRequest("4", prompts[0], MID))
    engine.run(record)

    old = make(tiny_model_dir, enable_prefix_caching=False)
    drained = assert_switched(seen, finals, prompts, old, fresh_new)
    if async_scheduling:  # the step in flight at the update: applied, returned after it
        assert drained > before
    late = finals["4"]
    assert (late.weight_version, late.first_weight_version) == (1, 1)
    assert late.outputs[0].token_ids == tokens(fresh_new, [PROMPTS[0]], MID)[0]
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.parametrize("asleep", [False, True], ids=["paused", "paused and asleep"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_update_during_a_keep_pause(
    tiny_model_dir, new_dir, fresh_new, async_scheduling, asleep
):
    """The requests a "keep" pause froze are preempted by an update (their KV, W's, is
    dropped); nothing steps until the resume, then they finish as W' continues them
    -- also when the engine slept meanwhile and woke without a host copy of W."""
    llm = make(tiny_model_dir, async_scheduling=async_scheduling)
    engine = llm.engine
    prompts = [p["prompt_token_ids"] for p in PROMPTS[:4]]
    seen, finals, record = start_mid_generation(engine, prompts)
    engine.pause_generation("keep")
    for out in engine.step():  # (a step in flight: applied by the pause)
        record(out)
    assert engine.scheduler.running and not engine.has_unfinished()
    if asleep:
        engine.sleep(2, keep_host_copy=False)
    preempted = engine.scheduler.num_preemptions
    assert engine.update_weights(state_of(new_dir)) == 1
    assert not engine.scheduler.running and engine.pool.num_cached == 0
    if not asleep:  # (asleep, the sleep preempted them)
        assert engine.scheduler.num_preemptions > preempted
    assert not engine.has_unfinished() and engine.step() == []  # still paused
    if asleep:
        engine.wake_up()
        assert not engine.needs_weights
    engine.resume_generation()
    engine.run(record)
    old = make(tiny_model_dir, enable_prefix_caching=False)
    assert_switched(seen, finals, prompts, old, fresh_new)
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_update_while_a_wait_pause_drains(tiny_model_dir, new_dir, fresh_new, async_scheduling):
    """Pause mode "wait": the requests in flight go on draining; an update that lands
    before they are done switches them to W' as any update does (their KV recomputed),
    and a request that arrives meanwhile waits for the resume, then runs under W'."""
    llm = make(tiny_model_dir, async_scheduling=async_scheduling)
    engine = llm.engine
    prompts = [p["prompt_token_ids"] for p in PROMPTS[:4]]
    seen, finals, record = start_mid_generation(engine, prompts)
    engine.pause_generation("wait")
    late = PROMPTS[5]["prompt_token_ids"]
    engine.add_request(GenerateRequest(str(len(prompts)), late, MID))  # held
    assert engine.update_weights(state_of(new_dir)) == 1
    engine.run(record)  # drains the four; the held one stays held
    assert str(len(prompts)) not in finals and engine.is_paused
    old = make(tiny_model_dir, enable_prefix_caching=False)
    assert_switched(seen, finals, prompts, old, fresh_new)
    engine.resume_generation()
    engine.run(record)
    held = finals[str(len(prompts))]
    assert (held.weight_version, held.first_weight_version) == (1, 1)
    assert held.outputs[0].token_ids == tokens(fresh_new, [{"prompt_token_ids": late}], MID)[0]


def test_an_update_after_an_abort_pause(tiny_model_dir, new_dir, fresh_new):
    """Pause mode "abort": the requests in flight end (finish_reason abort, their
    outputs W's, version 0); after the update and the resume, requests run under W'."""
    llm = make(tiny_model_dir)
    engine = llm.engine
    prompts = [p["prompt_token_ids"] for p in PROMPTS[:4]]
    _, finals, record = start_mid_generation(engine, prompts)
    engine.pause_generation("abort")
    for out in engine.step():
        record(out)
    assert len(finals) == len(prompts) and not engine.requests
    for out in finals.values():
        assert out.outputs[0].finish_reason == "abort" and out.weight_version == 0
    assert engine.update_weights(state_of(new_dir)) == 1
    engine.resume_generation()
    assert tokens(llm) == tokens(fresh_new)


# ------------------------------------------------------ compiles and copies


def test_ten_updates_between_generations_compile_nothing(
    tiny_model_dir, new_dir, want_old, want_new
):
    llm = make(tiny_model_dir)
    states = [state_of(tiny_model_dir), state_of(new_dir)]
    assert tokens(llm) == want_old  # compiles what these prompts need, from a cold cache
    runner = llm.engine.runner
    before = runner.compiles.count
    for i in range(10):
        assert llm.update_weights(states[(i + 1) % 2]) == i + 1
        # (each round starts from a cold cache: the same steps as the first)
        assert tokens(llm) == (want_new if i % 2 == 0 else want_old)
    assert runner.compiles.count == before


def test_arrays_placed_as_the_engines_are_adopted_and_others_placed(
    tiny_model_dir, new_dir, want_new
):
    """Arrays on the engine's device, uncommitted as its weights are, become its weights
    (the same objects); numpy arrays, float64 ones (cast) and arrays committed to the
    device are copied onto the engine's placement -- uncommitted, or the steps would
    compile again."""
    llm = make(tiny_model_dir)
    runner = llm.engine.runner
    state = state_of(new_dir)
    llm.update_weights(state)
    assert all(w is x for w, x in zip(runner.weights, jax.tree.leaves(state), strict=True))
    assert tokens(llm) == want_new
    before = runner.compiles.count
    for params in (
        jax.tree.map(np.asarray, state),
        jax.tree.map(lambda x: np.asarray(x, np.float64), state),
        jax.device_put(state, jax.devices()[0]),
    ):
        llm.update_weights(params)
        for w, x in zip(runner.weights, jax.tree.leaves(params), strict=True):
            assert w is not x and isinstance(w, jax.Array) and not w.committed
            assert w.dtype == np.float32
        assert tokens(llm) == want_new
    assert runner.compiles.count == before


# ------------------------------------------------------------------ sources


def test_every_form_of_params_gives_the_new_weights(tiny_model_dir, new_dir, want_new):
    llm = make(tiny_model_dir)
    state = state_of(new_dir)
    for version, params in enumerate((nnx.to_pure_dict(state), hf_tensors(new_dir)), start=1):
        tokens(llm)  # (fills the cache with the previous weights' pages)
        assert llm.update_weights(params) == version
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want_new
        assert_versions(outs, version, version)


@pytest.mark.parametrize("form", ["hf", "save_weights", "orbax"])
def test_an_update_from_a_model_directory(tiny_model_dir, new_dir, want_new, form, tmp_path):
    path = new_dir
    if form == "save_weights":  # written by jaxserve from a model in memory
        path = str(tmp_path / "saved")
        save_weights(load_model(new_dir, ModelConfig.from_pretrained(new_dir)), path)
        shutil.copy(os.path.join(new_dir, "config.json"), path)
    elif form == "orbax":
        path = convert(new_dir, str(tmp_path / "orbax"))
    llm = make(tiny_model_dir)
    tokens(llm)
    assert llm.update_weights(path=path, weight_version=7) == 7
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_new
    assert_versions(outs, 7, 7)
    assert llm.update_weights(path=tiny_model_dir) == 8  # the previous version + 1


@pytest.mark.slow
def test_int8_weights_are_quantized_again_from_the_float_weights(tiny_model_dir, new_dir):
    """An int8 engine updated with W' (float) holds the int8 weights, bit for bit, and
    gives the outputs, of a fresh int8 engine of W' -- from params and from a path."""
    fresh = make(new_dir, quantization="int8")
    want = tokens(fresh)
    llm = make(tiny_model_dir, quantization="int8")
    assert tokens(llm) != want
    for update in (dict(params=state_of(new_dir)), dict(path=new_dir)):
        llm.update_weights(**update)
        for w, f in zip(llm.engine.runner.weights, fresh.engine.runner.weights, strict=True):
            assert w.dtype == f.dtype and np.array_equal(np.asarray(w), np.asarray(f))
        assert any(w.dtype == np.int8 for w in llm.engine.runner.weights)
        assert tokens(llm) == want


@pytest.mark.slow
def test_bfloat16_rows_layout_is_built_from_float32_params(tiny_model_dir, new_dir):
    """A bfloat16 engine (on the CPU: linears stored [out, in]) updated with float32
    params (cast) holds what a fresh bfloat16 engine of W' loads."""
    fresh = make(new_dir, dtype="bfloat16")
    llm = make(tiny_model_dir, dtype="bfloat16")
    llm.update_weights(state_of(new_dir))
    assert llm.engine.runner.weight_form == fresh.engine.runner.weight_form
    for w, f in zip(llm.engine.runner.weights, fresh.engine.runner.weights, strict=True):
        assert w.dtype == f.dtype and np.array_equal(np.asarray(w), np.asarray(f))
    assert tokens(llm) == tokens(fresh)


# ------------------------------------------------------------------- errors


def _without(d: dict, name: str) -> dict:
    return {k: v for k, v in d.items() if k != name}


def bad_model_dirs(tiny_model_dir: str, root) -> dict[str, str]:
    """Directories an update from `path` must refuse, naming them: another architecture
    (a layer more: its tensors would be ignored unread), no config.json, a truncated
    safetensors file."""
    from hf_models import make_hf_model

    dirs = {name: os.path.join(root, name) for name in ("deeper", "no_config", "truncated")}
    make_hf_model(dirs["deeper"], "LlamaForCausalLM", dict(vocab_size=320, num_hidden_layers=3))
    for name in ("no_config", "truncated"):
        shutil.copytree(tiny_model_dir, dirs[name])
    os.remove(os.path.join(dirs["no_config"], "config.json"))
    weights = os.path.join(dirs["truncated"], "model.safetensors")
    with open(weights, "rb") as f:
        head = f.read(5000)
    with open(weights, "wb") as f:
        f.write(head)
    return dirs


def test_bad_updates_are_refused_by_name_and_change_nothing(
    tiny_model_dir, new_dir, want_old, tmp_path
):
    bad = bad_model_dirs(tiny_model_dir, tmp_path)
    llm = make(tiny_model_dir)
    runner = llm.engine.runner
    weights = list(runner.weights)
    hf = hf_tensors(new_dir)
    state = state_of(new_dir)
    bad_leaf = nnx.to_pure_dict(state)  # (new dicts, the same arrays)
    bad_leaf["model"]["layers"][1]["mlp"]["up_proj"]["kernel"] = np.zeros((64, 95), np.float32)
    misspelt = {**_without(hf, Q_PROJ), "model.layers.0.self_attn.q_prj.weight": hf[Q_PROJ]}
    cases = [
        (dict(params=misspelt), r"no 'model\.layers\.0\.self_attn\.q_proj\.weight'.*q_prj"),
        (dict(params=_without(hf, Q_PROJ)), rf"params has no '{Q_PROJ}'"),
        (dict(params={**hf, "model.extra.weight": hf[Q_PROJ]}), "'model.extra.weight'"),
        (dict(params={**hf, Q_PROJ: hf[Q_PROJ][:, :-1]}), rf"params\['{Q_PROJ}'\] has shape"),
        (dict(params={**hf, Q_PROJ: hf[Q_PROJ].astype(np.int32)}), r"dtype int32.*float32"),
        (
            dict(params=bad_leaf),
            r"'model\.layers\.1\.mlp\.up_proj\.kernel'\] has shape \(64, 95\), "
            r"the model expects \(64, 96\)",
        ),
        (dict(params=state, path=new_dir), "exactly one of params and path, got both"),
        (dict(), "exactly one of params and path, got neither"),
        (dict(params=state, weight_version="2"), "weight_version must be an integer"),
        (dict(path=os.path.join(new_dir, "missing")), "path must be a model directory"),
        (dict(path=bad["deeper"]), r"deeper': config.json has num_layers=3, the served model 2"),
        (dict(path=bad["no_config"]), r"path '.*no_config': no config.json"),
        (dict(path=bad["truncated"]), r"path '.*truncated': .*deserializing header"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.update_weights(**kw)
        assert llm.engine.weight_version == 0
        assert all(a is b for a, b in zip(runner.weights, weights, strict=True))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_old
    assert_versions(outs, 0, 0)


@pytest.mark.slow
def test_a_draft_model_refuses_an_update(tiny_model_dir):
    spec = dict(method="draft_model", model=tiny_model_dir, num_speculative_tokens=2)
    llm = make(tiny_model_dir, speculative_config=spec)
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*draft.*not updated"):
        llm.update_weights(state_of(tiny_model_dir))
    assert len(tokens(llm, PROMPTS[:1])[0]) == GREEDY.max_tokens


# ------------------------------------------------------------ reset_prefix_cache


def test_reset_prefix_cache_drops_every_page_and_running_requests_go_on(
    tiny_model_dir, want_old, tmp_path
):
    llm = make(tiny_model_dir, kv_offload_bytes=1 << 22, kv_offload_dir=str(tmp_path))
    engine = llm.engine
    tokens(llm)
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].num_cached_tokens
    engine.save_kv_tier()
    folder = engine.tier.disk.folder
    assert glob.glob(os.path.join(folder, "*.kvpage")) and engine.tier.host_used
    assert llm.reset_prefix_cache() is True
    assert engine.pool.num_cached == 0 and engine.tier.host_used == 0
    assert not glob.glob(os.path.join(folder, "*.kvpage"))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0  # (the later prompts share its new pages)
    assert [o.outputs[0].token_ids for o in outs] == want_old

    # Running requests keep their pages (in use, no longer cached) and finish the same.
    for i, p in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(str(i), p["prompt_token_ids"], GREEDY))
    finals = {}
    for _ in range(4):
        for out in engine.step():
            finals[out.request_id] = out
    assert engine.scheduler.running and engine.pool.num_cached
    assert engine.reset_prefix_cache() and engine.pool.num_cached == 0
    engine.run(lambda out: finals.__setitem__(out.request_id, out))
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == want_old
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity


def test_the_pool_forgets_pages_in_use_too():
    """A page a running sequence holds is cached under its hash as soon as it fills:
    reset_prefix_cache must forget it too, or a later request would find it."""
    pool = PagePool(6, track_evictions=True)
    pages = pool.allocate(2)
    uid = pool.cache_page(pages[0], ROOT_UID, (1, 2), name=(b"a" * 16, ROOT_DIGEST))
    pool.cache_page(pages[1], uid, (3, 4))
    assert pool.lookup([1, 2, 3, 4, 5], 2)[0] == pages  # (takes a reference on each)
    pool.free(pages)
    pool.reset_prefix_cache()
    assert pool.num_cached == 0 and pool.lookup([1, 2, 3, 4, 5], 2) == ([], [])
    assert pool.page_of_digest(b"a" * 16) is None and pool.take_evicted() == []
    pool.free(pages)
    pool.check_invariant()
    assert pool.num_free == pool.capacity


def _layout(model_id: str) -> KVLayout:
    return KVLayout(model_id, 2, (ArraySpec("kv", "float32", (1, 2, 2, 2)),))


def _encoded(layout: KVLayout, tokens: tuple[int, ...]) -> tuple[bytes, bytes]:
    digest = page_digest(ROOT_DIGEST, tokens)
    page = Page(digest, ROOT_DIGEST, tokens, {"kv": np.ones((1, 2, 2, 2), np.float32)})
    return digest, encode_page(layout, page)


def test_the_tier_clears_host_and_disk_and_takes_a_new_layout(tmp_path):
    old, new = _layout("w"), _layout("w-prime")
    other = KVTier(old, 0, str(tmp_path))  # another process's pages in the same folder
    other.put(*_encoded(old, (9, 9)))
    tier = KVTier(old, 1 << 20, str(tmp_path))
    digest, data = _encoded(old, (1, 2))
    tier.put(digest, data)
    assert tier.contains(digest) and tier.host_used and tier.disk_used
    old_folder = tier.disk.folder
    tier.clear()
    assert not tier.contains(digest) and tier.host_used == 0 and tier.disk_used == 0
    assert not glob.glob(os.path.join(old_folder, "*.kvpage"))
    tier.put(digest, data)
    tier.clear(new)
    assert tier.layout == new and tier.disk.folder != old_folder
    assert not glob.glob(os.path.join(old_folder, "*.kvpage"))
    digest, data = _encoded(new, (1, 2))
    tier.put(digest, data)
    assert [p.tokens for p in tier.load([digest])] == [(1, 2)]
    assert glob.glob(os.path.join(tier.disk.folder, "*.kvpage"))


@pytest.mark.sharded
@pytest.mark.slow
def test_updates_under_tensor_parallelism(tiny_model_dir, new_dir):
    from fake_devices import run_on_8_devices

    stdout = run_on_8_devices("weight_update_tp_check.py", tiny_model_dir, new_dir)
    for check in ("re-sharded from one device", "from orbax", "compiled nothing"):
        for quant in ("None", "int8"):
            assert f"ok {quant} {check}" in stdout, stdout
    assert "ok adopted as sharded" in stdout and "ok data parallel updated" in stdout
