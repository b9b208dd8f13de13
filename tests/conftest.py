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
