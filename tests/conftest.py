import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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


@pytest.fixture(autouse=True, scope="session")
def _no_persistent_compilation_cache():
    """In-process tests do not use JAX's persistent compilation cache.

    Some tests compile in two threads at once (an in-process server's engine thread,
    warm-up off, beside an offline `LLM` in the test's own thread); with the cache on,
    the process died twice in a full run (a segfault in XLA serializing an executable
    into the cache, once reading one back). A server compiles everything before it
    serves, so it never does both at once. `test_compilation_cache.py` tests the cache
    in subprocesses.
    """
    from jaxserve.llm import LLM

    defaults = LLM.__init__.__kwdefaults__
    saved = defaults["compilation_cache_dir"]
    defaults["compilation_cache_dir"] = None
    yield
    defaults["compilation_cache_dir"] = saved
