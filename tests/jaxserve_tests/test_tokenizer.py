"""The tokenizer and chat template agree with transformers on the same files."""

import pytest
import transformers

from jaxserve.tokenizer import Tokenizer

TEXTS = ["The quick brown fox.", "Héllo wörld — 東京 🙂🚀", "", "  spaces   and\nnewlines\t"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Ça va? 北京"},
    {"role": "assistant", "content": "Oui."},
    {"role": "user", "content": "And now?"},
]


@pytest.fixture(scope="module")
def tokenizers_pair(tiny_model_dir):
    return Tokenizer(tiny_model_dir), transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(text, tokenizers_pair):
    ours, hf = tokenizers_pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ids[0] == ours.token_id("<s>")  # BOS from the post-processor
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(add_generation_prompt, tokenizers_pair):
    ours, hf = tokenizers_pair
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == want
    assert text.startswith("<s><|system|>Be brief.<|end|>")
    want_ids = hf.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(want_ids, dict) or hasattr(want_ids, "input_ids"):
        want_ids = want_ids["input_ids"]
    assert ours.encode_chat(MESSAGES, add_generation_prompt=add_generation_prompt) == want_ids


def test_special_tokens(tokenizers_pair):
    ours, hf = tokenizers_pair
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.vocab_size == len(hf)
    assert set(ours.all_special_ids) >= set(hf.all_special_ids)


def test_bad_chat_input_is_a_clear_error(tokenizers_pair):
    ours, _ = tokenizers_pair
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}, "not a message"])


def test_template_raise_exception_becomes_value_error(tmp_path, tiny_model_dir):
    import json
    import shutil

    shutil.copy(f"{tiny_model_dir}/tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer(tmp_path)
    with pytest.raises(ValueError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_missing_tokenizer_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)
