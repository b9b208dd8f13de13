import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

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
def _no_persistent_compilation_cache():
    """In-process tests never use JAX's persistent compilation cache: they would write
    thousands of test-shaped programs into its directory. Nothing sets it unless asked
    (`LLM(compilation_cache_dir=...)`, the command line; an engine never does), and
    `test_compilation_cache.py` asks only in subprocesses: this checks that no test
    module's code set it. (The crashes once blamed on the cache, in XLA serializing an
    executable, were the process running out of memory mappings: see
    `_release_compiled_programs`.)
    """
    yield
    jax = sys.modules.get("jax")  # (not imported: nothing set it)
    if jax is not None:
        assert jax.config.jax_compilation_cache_dir is None, (
            "a test set JAX's process-wide persistent compilation cache: "
            f"{jax.config.jax_compilation_cache_dir!r}"
        )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module.

    Each XLA:CPU executable holds a few memory mappings of its machine code until its
    jit cache entry goes; a test process that compiles thousands of programs (every
    test builds engines of its own shapes) reached the kernel's limit of 65,530
    mappings per process (`vm.max_map_count`), and LLVM then failed to map the next
    program ("LLVM compilation error: Cannot allocate memory") and XLA crashed (the
    segfaults and aborts of long test runs; one group of 12 files reached 26,564
    mappings in one module, and ~1,100 remain after clearing). A server compiles a
    fixed set of programs once, so it never grows like this.
    """
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
