"""Compiled bundles (`jaxserve.runner.bundle`): one process writes its compiled
programs, a fresh process loads them with `LLM(compiled=DIR)`, compiles no step
program, and serves the same outputs as the engine that compiled them; a bundle
made for another target, jax version or configuration is refused naming the field.
"""

import json
import os
import subprocess
import sys

import jax
import pytest
from cache_dir import env_without_compilation_cache, with_xla_flags

from jaxserve import LLM
from jaxserve.config import engine_config
from jaxserve.llm import resolve_model_dir
from jaxserve.runner import bundle
from jaxserve.runner.input_batch import WARM_BRANCHES
from models.config import ModelConfig
from pallas_kernels.cpu import cache as trust

# Small shapes keep the program count low: token buckets 1, 2, ..., 32 and row
# buckets 1, 2, 4 -> 6 forward + 6 sampling programs.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=128)

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +"
STEP_PROGRAMS = {
    "jit(_forward)",
    "jit(_sample)",
    "jit(_prompt_logprobs)",
    "jit(_propose)",
    "jit(_gather)",
    "jit(_scatter)",
}
# What loading the weights and allocating the KV caches compile, bundle or not (no
# step program): `jnp.array`'s staging copy per weight shape, the caches' zero fill
# (on a mesh: `parallel.zeros_kv`'s jitted lambda).
LOAD_HELPERS = {
    "jit(stage)",
    "jit(convert_element_type)",
    "jit(broadcast_in_dim)",
    "jit(<lambda>)",
    "jit(_zeros)",  # the KV caches allocated on a mesh (`meshes.zeros_kv`)
}

# Runs in a fresh process: `make` compiles (warm-up), writes the bundle and serves;
# `load` loads the bundle and serves. Both print the outputs and counters as JSON.
SCRIPT = r"""
import json, logging, os, re, sys
import jax
from jaxserve import LLM, SamplingParams

# Every XLA compilation in this process, by the jitted function's name.
compiled_names = []
class Names(logging.Handler):
    def emit(self, record):
        m = re.match(r"Finished XLA compilation of (\S+)", record.getMessage())
        if m:
            compiled_names.append(m.group(1))
jax.config.update("jax_log_compiles", True)
logging.getLogger("jax").addHandler(Names())

mode, bundle_dir, cache_dir, kw = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if mode == "make":
    llm = LLM("demo-model", compilation_cache_dir=None, compile_guard=True, **kw)
    llm.save_compiled(bundle_dir)
else:  # a persistent cache is configured: the bundle must not go through it
    llm = LLM("demo-model", compiled=bundle_dir, compilation_cache_dir=cache_dir,
              compile_guard=True, **kw)
runner = llm.engine.runner
warmup_compiles = runner.compiles.count
shared = sys.argv[5]
first = llm.generate(
    [shared, "The quick brown fox", "import numpy as np\n", "x"],
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=20, n=2, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=12,
                       presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1),
    ],
    use_tqdm=False,
)
# The shared prefix again: its full pages come from the prefix cache.
second = llm.generate(
    [shared + " fibonacci(n - 2)", shared + " 1"],
    [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=1.0, seed=5)],
    use_tqdm=False,
)
# Other long prompts fill a small pool (evicting the shared prefix's pages: to the KV
# tier where there is one), then the shared prefix once more.
third = llm.generate(
    [f"class Item{i}:\n    def __init__(self, value_{i}, other_{i}):" * 2 for i in range(4)]
    + [shared + " fibonacci(n)"],
    SamplingParams(temperature=0, max_tokens=12),
    use_tqdm=False,
)
outs = [
    {
        "tokens": [c.token_ids for c in o.outputs],
        "logprobs": [c.cumulative_logprob for c in o.outputs],
        "cached": o.num_cached_tokens,
        "prompt_logprobs": o.prompt_logprobs,
    }
    for o in first + second + third
]
print("RESULT " + json.dumps({
    "outputs": outs,
    "warmup_compiles": warmup_compiles,
    "compiles": runner.compiles.count,
    "compiled_names": sorted(set(compiled_names)),
    "cache_hits": runner.compiles.cache_hits,
    "cache_files": sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else [],
    "programs": len(llm.engine.compiled),
    "tier": llm.engine.tier and [llm.engine.tier.stats.stores, llm.engine.tier.stats.loads],
}))
"""


def _run(mode: str, bundle_dir, cache_dir, devices: int = 1, **kw) -> dict:
    # Without the test runs' compilation cache (tests/conftest.py): `make` compiles what
    # it saves (XLA:CPU cannot serialize a program it loaded from a cache again), and
    # `load` must compile nothing and find no cache.
    env = env_without_compilation_cache()
    env["XLA_FLAGS"] = with_xla_flags(f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            mode,
            str(bundle_dir),
            str(cache_dir),
            json.dumps(kw),
            PROMPT,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_a_fresh_process_serves_from_the_bundle_compiling_nothing(tmp_path):
    made = _run("make", tmp_path / "bundle", tmp_path / "unused", **SMALL)
    # 6 forward, 6 prompt logprobs, 2 x 3 sampling
    assert made["warmup_compiles"] == made["programs"] == 22  # 6+6+6, 3 copies, 1 table write
    assert {"jit(_forward)", "jit(_sample)", "jit(_prompt_logprobs)"} <= set(made["compiled_names"])
    assert made["outputs"][3]["prompt_logprobs"]  # (served by its own program)
    loaded = _run("load", tmp_path / "bundle", tmp_path / "xla-cache", **SMALL)
    assert loaded["programs"] == 22
    assert loaded["warmup_compiles"] == loaded["compiles"] == 0  # loaded, then served
    assert set(loaded["compiled_names"]) <= LOAD_HELPERS  # the whole process: no step
    assert loaded["cache_hits"] == 0 and loaded["cache_files"] == []  # not via the cache
    assert loaded["outputs"] == made["outputs"]  # tokens and logprobs, n=2 included
    assert len(made["outputs"][1]["tokens"]) == 2
    assert made["outputs"][4]["cached"] > 0  # the second round hit the prefix cache

    # The command line: `jaxserve generate --compiled` with the same engine flags.
    flags = [f"--{k}={v}" for k, v in SMALL.items()]
    cli = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "generate", f"--compiled={tmp_path / 'bundle'}"]
        + flags
        + ["--compilation_cache_dir=", f"--prompt={PROMPT}", "--max_tokens=24", "--ignore_eos"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "22 programs loaded from" in cli.stderr and "(none compiled)" in cli.stderr
    assert json.loads(cli.stdout)["token_ids"] == made["outputs"][0]["tokens"][0]


@pytest.mark.slow
def test_host_decided_sampling_branches_load_from_the_bundle(tmp_path):
    """A GPU's sampling programs (`sampling_branches="host"`: WARM_BRANCHES' per row
    bucket) are saved and picked by the batch's branches, compiling nothing."""
    kw = {**SMALL, "sampling_branches": "host"}
    made = _run("make", tmp_path / "bundle", tmp_path / "unused", **kw)
    per_bucket = sum(map(len, WARM_BRANCHES.values()))
    assert made["programs"] == 6 + 6 + per_bucket * 3 + 3 + 1
    loaded = _run("load", tmp_path / "bundle", tmp_path / "xla-cache", **kw)
    assert loaded["programs"] == made["programs"]
    assert loaded["warmup_compiles"] == loaded["compiles"] == 0
    assert loaded["outputs"] == made["outputs"]


@pytest.mark.slow
def test_draft_model_kv_tier_and_tensor_parallel_programs_load_from_the_bundle(tmp_path):
    """Speculative decoding with a draft model (its forwards and proposer) and a KV
    tier whose page gather/scatter run when the small pool evicts and reloads, on a
    mesh of two (CPU) devices."""
    kw = dict(
        SMALL,
        devices=2,
        tensor_parallel_size=2,
        num_kv_pages=24,
        kv_offload_bytes=1 << 22,
        speculative_config={
            "method": "draft_model",
            "model": resolve_model_dir("demo-model-tiny"),
            "num_speculative_tokens": 2,
        },
    )
    made = _run("make", tmp_path / "bundle", tmp_path / "unused", **kw)
    names = sorted(os.listdir(tmp_path / "bundle"))
    assert any(n.startswith("draft_propose") for n in names)
    assert any(n.startswith("kv_scatter") for n in names)
    assert set(made["compiled_names"]) >= STEP_PROGRAMS
    stores, loads = made["tier"]
    assert stores > 0 and loads > 0  # pages went to the tier and came back
    loaded = _run("load", tmp_path / "bundle", tmp_path / "xla-cache", **kw)
    assert loaded["programs"] == made["programs"] == len(names) - 1  # (the manifest)
    # The runner's counter also saw the draft model's weights load (LOAD_HELPERS);
    # serving compiled nothing, and no step program was compiled in the process.
    assert loaded["compiles"] == loaded["warmup_compiles"]
    assert set(loaded["compiled_names"]) <= LOAD_HELPERS
    assert loaded["cache_hits"] == 0 and loaded["cache_files"] == []
    assert loaded["tier"] == made["tier"]
    assert loaded["outputs"] == made["outputs"]


# ------------------------------------------------------------------ refusals
# No step program is compiled below: manifests are built from a config, and the
# engines are built with warmup=False.


def _manifest(**args) -> dict:
    model_dir = resolve_model_dir("demo-model")
    config = engine_config(model_dir, ModelConfig.from_pretrained(model_dir), **args)
    return bundle.manifest(
        config,
        device=jax.devices()[0],
        num_devices=1,
        num_pages=65,
        token_buckets=[8, 16, 32],
        row_buckets=[1, 2, 4],
        weights=[jax.ShapeDtypeStruct((4, 4), "float32")],
        kv_transfer=False,
        cpu_kernels=True,
    )


def test_check_names_each_field_with_both_values():
    ours = _manifest(max_num_seqs=4)
    bundle.check(ours, _manifest(max_num_seqs=4), "DIR")  # the same: accepted
    theirs = _manifest(max_num_seqs=8, dtype="bfloat16")
    with pytest.raises(ValueError) as e:
        bundle.check(theirs, ours, "DIR")
    message = str(e.value)
    assert "engine.max_num_seqs: bundle's 8, this engine's 4" in message
    assert "engine.dtype: bundle's 'bfloat16', this engine's 'float32'" in message


def _write(directory, manifest: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, bundle.MANIFEST), "w") as f:
        json.dump({"format": bundle.FORMAT, **manifest, "programs": {}}, f)


@pytest.fixture(scope="module")
def engine_manifest():
    """The manifest of an LLM of the SMALL settings on this machine (not warmed up)."""
    llm = LLM("demo-model", warmup=False, **SMALL)
    return llm.engine.runner.manifest(kv_transfer=False)


@pytest.mark.parametrize(
    "field,value,expected",
    [
        (("versions", "jax"), "0.9.0", "versions.jax: bundle's '0.9.0', this engine's"),
        (("target", "platform"), "tpu", "target.platform: bundle's 'tpu', this engine's 'cpu'"),
        (("engine", "max_num_batched_tokens"), 64, "engine.max_num_batched_tokens: bundle's 64"),
        (("engine", "kv_transfer"), True, "engine.kv_transfer: bundle's True, this engine's False"),
        (  # a GPU's sampling programs (the host decides their branches)
            ("engine", "sampling_branches"),
            "host",
            "engine.sampling_branches: bundle's 'host', this engine's 'device'",
        ),
    ],
)
def test_llm_refuses_a_bundle_made_for_something_else(
    tmp_path, engine_manifest, field, value, expected
):
    manifest = json.loads(json.dumps(engine_manifest))
    manifest[field[0]][field[1]] = value
    _write(tmp_path, manifest)
    with pytest.raises(ValueError, match="made for another target") as e:
        LLM("demo-model", compiled=tmp_path, **SMALL)
    assert expected in str(e.value)


def test_refusals_before_any_loading(tmp_path, engine_manifest):
    with pytest.raises(ValueError, match="holds no bundle"):
        LLM("demo-model", compiled=tmp_path, **SMALL)
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        LLM("demo-model", compiled=tmp_path, data_parallel_size=2, **SMALL)
    # A bundle for more KV pages than this engine's budget holds.
    manifest = json.loads(json.dumps(engine_manifest))
    manifest["engine"]["num_kv_pages"] = 10**6
    _write(tmp_path / "big", manifest)
    with pytest.raises(ValueError, match="num_kv_pages: bundle's 1000000, this engine's 65"):
        LLM("demo-model", compiled=tmp_path / "big", **SMALL)


def test_a_corrupt_program_file_is_refused(tmp_path):
    f = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((3,), "float32")).compile()
    bundle.save(str(tmp_path), {"forward T=3": f}, {"engine": {}})
    program = tmp_path / "forward_T=3.bin"
    program.write_bytes(program.read_bytes()[:-8])
    with pytest.raises(ValueError, match="corrupt"):
        bundle.load(str(tmp_path), {"engine": {}}, jax.devices()[:1])


def _tiny_bundle(directory) -> None:
    f = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((3,), "float32")).compile()
    bundle.save(str(directory), {"forward T=3": f}, {"engine": {}})


def _load(directory):
    return bundle.load(str(directory), {"engine": {}}, jax.devices()[:1])


def test_a_bundle_others_could_have_written_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A bundle is code (pickles, native programs): loaded only from where no other
    user could have written it, as the CPU kernels' cache (it was loaded from
    anywhere)."""
    _tiny_bundle(tmp_path / "ok")
    assert _load(tmp_path / "ok")  # saved with modes that pass, whatever the umask
    program = "forward_T=3.bin"

    def refused(directory, reason):
        with pytest.raises(ValueError, match="a bundle is code") as e:
            _load(directory)
        assert reason in str(e.value)

    shared = tmp_path / "shared"
    _tiny_bundle(shared)
    shared.chmod(0o777)
    refused(shared, "mode 0777 (needs no group or other write)")
    writable = tmp_path / "writable"
    _tiny_bundle(writable)
    (writable / program).chmod(0o666)
    refused(writable, f"{program}: mode 0666")
    linked = tmp_path / "linked"
    _tiny_bundle(linked)
    (linked / program).unlink()
    (linked / program).symlink_to(tmp_path / "ok" / program)
    refused(linked, "a symbolic link")
    escaping = tmp_path / "escaping"
    _tiny_bundle(escaping)
    manifest = json.loads((escaping / "manifest.json").read_text())
    manifest["programs"]["forward T=3"]["file"] = "../ok/" + program
    (escaping / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="names file '../ok/forward_T=3.bin', not a program"):
        _load(escaping)
    # Another user's program file (root's would be trusted: as root, give it away).
    if os.geteuid() == 0:
        os.chown(tmp_path / "ok" / program, 4242, -1)
    else:
        monkeypatch.setattr(trust, "_euid", lambda: os.geteuid() + 1)
    refused(tmp_path / "ok", "owned by uid")


BY_SHAPE = r"""
import sys
import jax
from jaxserve.runner import bundle
args = [jax.ShapeDtypeStruct((n,), "float32") for n in (2, 4)]
compiled = {f"f n={a.shape[0]}": jax.jit(lambda x: x * 2).lower(a).compile() for a in args}
bundle.save(sys.argv[1], compiled, {"engine": {}})
loaded = bundle.load(sys.argv[1], {"engine": {}}, jax.devices()[:1])
f = bundle.by_shape(loaded, "f n=", key_argnums=(0,))
print(f(jax.numpy.ones(4)).tolist())
try:
    f(jax.numpy.ones(3))
except ValueError as e:
    print(e)
"""


def test_a_shape_without_a_program_raises_instead_of_compiling(tmp_path):
    # In a process without the test runs' compilation cache: what it saves it compiled.
    env = env_without_compilation_cache()
    proc = subprocess.run(
        [sys.executable, "-c", BY_SHAPE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran, refused = proc.stdout.strip().splitlines()[-2:]
    assert ran == str([2.0] * 4)
    assert refused.startswith("no compiled f program for argument shapes ((3,),)"), refused


@pytest.mark.slow
def test_preflight_writes_a_gpu_bundle_that_this_cpu_refuses(tmp_path):
    """`preflight(output=)` serializes the programs compiled for a compile-only H100;
    loading them needs the GPU's runtime, which is not here: the platform is refused."""
    from jaxserve.preflight import preflight
    from jaxserve.targets import Target

    model_dir = resolve_model_dir("demo-model-tiny")
    gpu = dict(SMALL, dtype="bfloat16", kv_cache_memory_fraction=0.5)
    config = engine_config(model_dir, ModelConfig.from_pretrained(model_dir), **gpu)
    out = str(tmp_path / "h100")
    report = preflight(config, Target.parse("h100"), decode_batches=(1,), output=out)
    assert f"written to {out}" in report.format() and report.bundle_bytes > 0
    found = bundle.read_manifest(out)
    assert found["target"] == {
        "platform": "gpu",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "num_devices": 1,
    }
    assert found["engine"]["attention_backend"] == "pallas_gpu"
    # 6 forwards and prompt-logprob programs, WARM_BRANCHES' sampling per row bucket
    # (the host decides a GPU's branches), 3 page copies, 1 table write
    sampling = sum(map(len, WARM_BRANCHES.values())) * 3
    assert len(found["programs"]) == report.num_programs == 6 + 6 + sampling + 3 + 1
    with pytest.raises(ValueError, match="target.platform: bundle's 'gpu', this engine's 'cpu'"):
        LLM(model_dir, compiled=out, **gpu)


SAVE_FROM_CACHE = """
import sys
from jaxserve import LLM
llm = LLM("demo-model-tiny", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
          skip_tokenizer_init=True, compilation_cache_dir=sys.argv[1])
try:
    print("saved", llm.save_compiled(sys.argv[2]) > 0)
except ValueError as e:
    print("refused", e)
"""


def test_programs_loaded_from_the_compilation_cache_are_not_saved(tmp_path):
    """XLA:CPU serializes a program it loaded from the persistent cache without its
    compiled kernels (the bundle then fails to run: "Function ... not found"), so an
    engine whose warm-up loaded programs from there refuses to save them, naming the
    fix; one that compiled them saves."""
    env = env_without_compilation_cache()
    said = []
    for name in ("first", "second"):  # the second start finds every program in the cache
        proc = subprocess.run(
            [sys.executable, "-c", SAVE_FROM_CACHE, str(tmp_path / "xla"), str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        said.append(proc.stdout.strip().splitlines()[-1])
    assert said[0] == "saved True"
    assert said[1].startswith("refused") and "compilation_cache_dir=None" in said[1], said[1]
