import gc
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cache_dir import test_cache_dir

from server.cli.main import GC_THRESHOLDS

# The test extras install the TPU and GPU compilers (libtpu, the CUDA plugin) for
# deviceless compilation (`jaxserve.targets`). The tests run on the CPU: neither may
# try to bring up a device that is not here (the CUDA plugin's failed start would also
# keep its compile-only topology away), and libtpu must not look for a TPU VM's
# metadata server. The accelerator suite (`tools/run_tests.py --accelerator`) keeps
# the machine's own platform.
if os.environ.get("JAXSERVE_TEST_ACCELERATOR") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # test processes side by side
ACCELERATOR = os.environ.get("JAXSERVE_TEST_ACCELERATOR") == "1"

# JAX's persistent compilation cache, for every test process and every process a test
# starts (they inherit the environment): outside the clone, so a second run on the same
# machine loads the programs a first one compiled (79 s -> 7 s for the demo model's
# warm-up), and one test module loads what another compiled. A hit is the same module,
# compiled by the same compiler with the same flags, so it proves what a compile does;
# programs for compile-only TPUs and GPUs are kept as records in its `compile-only`
# folder (`jaxserve.compile_records`). JAXSERVE_TEST_CACHE names another directory, or
# none (empty): every program compiled afresh.
TEST_CACHE = test_cache_dir()
if TEST_CACHE:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(TEST_CACHE, "xla"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

# (XLA:CPU's LLVM at -O0 in test processes cut a cold compile ~20-35%, and was dropped:
# rows of a batch then differed by an ulp, so greedy outputs of one engine and of a
# prefill/decode pair differed on the tiny random models: test_kv_transfer failed
# every time at -O0 and passed at -O2. The tests compile as the product does.)

# No source locations in what is lowered (a full traceback of 0 frames, JAX's own
# settings). A Pallas kernel's Mosaic or Triton module carries its ops' file and line
# into the program, so a line added above a kernel, or a clone at another path,
# changed every program holding it: each deviceless record missed and compiled again
# (a CI run where they all missed took 76 minutes, against 14-18 warm). The kernel's
# code is still the key; where it sits is not (tests/jaxserve_tests/test_compilation_cache.py).
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "1")
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

# Test processes side by side share the cache without a lock (`jaxserve.compile_cache`):
# JAX's own bounded cache locked every read and write, and listed the directory at each
# write, 1.1-1.7 s over the test runs' 8.8k entries. Processes a test starts that build
# an LLM do the same (`use_compilation_cache`). (It imports jax: after the settings
# above, which jax reads as it is imported.)
if TEST_CACHE:
    from jaxserve.compile_cache import use_file_cache

    use_file_cache()


# Python's cyclic garbage collector, tuned for test processes: tracing and lowering
# allocate millions of short-lived objects, and with the default thresholds (700, 10,
# 10) the collector ran so often over a heap of jax, torch and transformers that it
# took ~14% of a deviceless-compile test's time (41.9 -> 35.4 s, this EPYC). Young
# garbage is still collected; full collections come from `_release_compiled_programs`.
gc.set_threshold(*GC_THRESHOLDS)


def pytest_collection_modifyitems(config, items):
    """The accelerator suite (tests marked `accelerator`) runs alone, on a GPU or TPU
    machine, with JAXSERVE_TEST_ACCELERATOR=1; everywhere else it is deselected."""
    keep = [i for i in items if (i.get_closest_marker("accelerator") is not None) == ACCELERATOR]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Returns a function: case name -> (directory, HF torch model), built once per session."""
    from hf_models import CASES, make_hf_model

    cache = {}

    def get(case: str):
        if case not in cache:
            arch, overrides = CASES[case]
            path = tmp_path_factory.mktemp(case)
            model = make_hf_model(path, arch, overrides)
            cache[case] = (str(path), model)
        return cache[case]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small Llama with a byte-level BPE tokenizer and a chat template: for API tests."""
    from hf_models import make_hf_model, save_tokenizer

    path = tmp_path_factory.mktemp("tiny_chat")
    model = make_hf_model(path, "LlamaForCausalLM", dict(vocab_size=320))
    save_tokenizer(path, vocab_size=model.config.vocab_size)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir_new(tmp_path_factory):
    """W': `tiny_model_dir`'s architecture, shapes and tokenizer with other weights (a
    weight update's target: their greedy outputs differ from the first token)."""
    from hf_models import make_hf_model, save_tokenizer

    path = tmp_path_factory.mktemp("tiny_chat_new")
    make_hf_model(path, "LlamaForCausalLM", dict(vocab_size=320), seed=1)
    save_tokenizer(path, vocab_size=320)
    return str(path)


@pytest.fixture(autouse=True, scope="module")
def _the_test_compilation_cache():
    """Every test process uses the test runs' persistent compilation cache (above);
    this checks that no test module's code pointed JAX's process-wide cache elsewhere
    (`LLM(compilation_cache_dir=...)` and the command line set it: tests of those run
    them in subprocesses)."""
    yield
    jax = sys.modules.get("jax")  # (not imported: nothing set it)
    if jax is not None:
        now, want = (
            jax.config.jax_compilation_cache_dir,
            os.environ.get("JAX_COMPILATION_CACHE_DIR"),
        )
        assert now == want, f"a test moved JAX's persistent compilation cache: {now!r}"


# A test process keeps its compiled programs from module to module (a later module
# that builds an engine of the same shapes traces, lowers and loads nothing) until it
# holds this many memory mappings or this much memory; then it drops them all.
KEEP_MAPPINGS = 24_000  # of the kernel's 65,530 (one module has taken 26,564)
KEEP_RSS_BYTES = 3 << 30


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after a test module once the process holds more
    than KEEP_MAPPINGS memory mappings or KEEP_RSS_BYTES of memory.

    Each XLA:CPU executable holds a few memory mappings of its machine code until its
    jit cache entry goes; a test process that compiles thousands of programs (every
    test builds engines of its own shapes) reached the kernel's limit of 65,530
    mappings per process (`vm.max_map_count`), and LLVM then failed to map the next
    program ("LLVM compilation error: Cannot allocate memory") and XLA crashed (the
    segfaults and aborts of long test runs; one group of 12 files reached 26,564
    mappings in one module, and ~1,100 remain after clearing). A server compiles a
    fixed set of programs once, so it never grows like this. Dropping them after every
    module cost ~1.5 s a module (the collection and the programs traced again after).
    """
    yield
    if _mappings() < KEEP_MAPPINGS and _rss_bytes() < KEEP_RSS_BYTES:
        return
    import jax

    gc.collect()
    jax.clear_caches()


def _mappings() -> int:
    """The process's memory mappings (Linux; elsewhere 0)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _rss_bytes() -> int:
    """The process's resident memory (Linux; elsewhere 0)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
