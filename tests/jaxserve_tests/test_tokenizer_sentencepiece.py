"""A tokenizer.model-only directory (Llama 2, Mistral) agrees with transformers on the same files.

The model is a tiny SentencePiece BPE trained here with Llama's settings (byte fallback,
no normalization, dummy prefix). transformers 5 no longer has the slow (sentencepiece)
LlamaTokenizer, and its tokenizers-based LlamaTokenizer encodes differently from
sentencepiece: no dummy-prefix space at the start of a text that begins with whitespace,
nor after a special token. So ids are checked against the slow tokenizer's algorithm,
written out in `slow_llama_encode` (cut the text at the added tokens, sentencepiece
each cut, BOS in front), and against transformers 5 where it agrees with it; text is
checked against transformers 5's decode, which decodes pieces as sentencepiece does.
"""

import json
import random
import re

import pytest
import sentencepiece
import tokenizers
import transformers

from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

UNK, BOS, EOS = 0, 1, 2
VOCAB = 400
# Added tokens past the sentencepiece vocabulary: a special one and a plain one.
ADDED = {"<unk>": UNK, "<s>": BOS, "</s>": EOS, "<|im_start|>": VOCAB, "<|note|>": VOCAB + 1}
SPECIAL = {"<unk>", "<s>", "</s>", "<|im_start|>"}

# Llama 2's chat template, shortened (no default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'].strip()"
    " + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
MESSAGES = [
    {"role": "user", "content": "Hello there, fox?"},
    {"role": "assistant", "content": " The dog. "},
    {"role": "user", "content": "東京 🙂 and\nmore"},
]

# Plain text: no added tokens, no whitespace at the start (transformers 5 agrees here).
PLAIN = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "line\nbreak\n\nparagraph\n",
    "trailing spaces  ",
    "tab\tseparated\ttext",
    "numbers 12345 and 3.14",
    "café naïve",
    "東京 北京 日本語",  # 東京 were trained, 北 and 日本語 fall back to bytes
    "emoji 🙂🚀 👍🏽 🇫🇷",
    "a  b   c    d",
]
TEXTS = PLAIN + [
    "",
    " ",
    "\n",
    " leading space",
    "  two leading spaces",
    "\n\nnewlines first",
    "<s>hello</s> world",
    "a</s>b",
    "x </s> y <unk> z",
    "<|im_start|>user\nhi<|note|>there<|im_start|>",
    "<s><s>",
    "▁literal underline",
]


def training_text() -> list[str]:
    rs = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    words += ["there", "paragraph", "東京", "café"]
    lines = [
        " ".join(rs.choices(words, k=rs.randint(3, 12))) + rs.choice(".!?, ") for _ in range(300)
    ]
    return lines + ["  indented", "tab\tseparated", "line\nbreak", "numbers 0123456789"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sentencepiece")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()),
        model_prefix=str(path / "sp"),
        model_type="bpe",
        vocab_size=VOCAB,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        unk_id=UNK,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    (path / "sp.model").rename(path / "tokenizer.model")
    write_config(path)
    return path


def write_config(path, **overrides) -> None:
    flags = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    added = {
        str(i): {"content": content, "special": content in SPECIAL, **flags}
        for content, i in ADDED.items()
    }
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        **overrides,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def ours(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.LlamaTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def sp(model_dir):
    return sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))


def slow_llama_encode(sp, text: str, add_special_tokens: bool = True) -> list[int]:
    """transformers 4's slow LlamaTokenizer (legacy, its default), step by step."""
    ids = []
    for cut in re.split("(" + "|".join(map(re.escape, ADDED)) + ")", text):
        ids += [ADDED[cut]] if cut in ADDED else sp.encode(cut)
    return [BOS, *ids] if add_special_tokens else ids


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_the_slow_llama_tokenizer(text, ours, sp):
    assert ours.encode(text) == slow_llama_encode(sp, text)
    assert ours.encode(text, add_special_tokens=False) == slow_llama_encode(sp, text, False)


def test_a_leading_space_is_encoded(ours):
    # sentencepiece's dummy prefix makes " x" "▁▁x": the space is not lost.
    assert ours.encode(" leading space") != ours.encode("leading space")
    assert ours.encode("<s> hello", add_special_tokens=False)[1:] == ours.encode(" hello")[1:]


@pytest.mark.parametrize("text", PLAIN)
def test_encode_matches_transformers_on_plain_text(text, ours, hf):
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(text, skip, ours, hf, sp):
    ids = slow_llama_encode(sp, text)
    body = ids[1:]
    for seq in (ids, body, body + [EOS], [EOS, *body, EOS, BOS, *body], [UNK, *body]):
        assert ours.decode(seq, skip_special_tokens=skip) == hf.decode(
            seq, skip_special_tokens=skip
        ), seq


@pytest.mark.parametrize("text", [t for t in TEXTS if "<" not in t and "▁" not in t])
def test_plain_text_round_trips(text, ours):
    assert ours.decode(ours.encode(text)) == text


def test_special_tokens_and_vocab(ours, hf):
    assert ours.bos_token_id == hf.bos_token_id == BOS
    assert ours.eos_token_id == hf.eos_token_id == EOS
    assert ours.vocab_size == len(hf) == VOCAB + 2
    assert set(ours.all_special_ids) == {UNK, BOS, EOS, VOCAB}
    assert set(ours.all_special_ids) >= set(hf.all_special_ids)
    assert ours.token_id("<|note|>") == VOCAB + 1
    assert ours.token_id("no such piece") is None


def test_add_bos_and_eos_follow_the_config(tmp_path, model_dir, sp):
    (tmp_path / "tokenizer.model").write_bytes((model_dir / "tokenizer.model").read_bytes())
    write_config(tmp_path, add_bos_token=False, add_eos_token=True)
    ours, hf = Tokenizer(tmp_path), transformers.LlamaTokenizer.from_pretrained(tmp_path)
    assert (
        ours.encode("Hello world") == hf.encode("Hello world") == [*sp.encode("Hello world"), EOS]
    )
    assert ours.encode("Hello world", add_special_tokens=False) == sp.encode("Hello world")


def test_the_model_supplies_special_tokens_without_a_config(tmp_path, model_dir):
    (tmp_path / "tokenizer.model").write_bytes((model_dir / "tokenizer.model").read_bytes())
    tok = Tokenizer(tmp_path)
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert tok.encode("hi")[0] == tok.bos_token_id == BOS
    assert tok.eos_token_id == EOS and tok.vocab_size == VOCAB and tok.chat_template is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(add_generation_prompt, ours, hf, sp):
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == want
    assert text.startswith("<s>[INST] Hello there, fox? [/INST] The dog. </s><s>[INST]")
    ids = ours.encode_chat(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert ids == slow_llama_encode(sp, text, add_special_tokens=False)
    # The dummy prefix after <s>, as in Llama 2's training (transformers 5 leaves it out).
    assert ids[0] == BOS and sp.id_to_piece(ids[1]).startswith("▁")


ALPHABET = list("abc xyz.,!\n\t") + list("éü東京北") + ["🙂", "🚀", "👍🏽", "  ", "the ", " fox"]


def random_text(rs: random.Random, n: int) -> str:
    return "".join(rs.choice(ALPHABET) for _ in range(n))


def stream(tok, prompt, ids, params):
    detok = IncrementalDetokenizer(tok, list(prompt), params)
    deltas = []
    for t in ids:
        detok.add(t)
        deltas.append(detok.release(finished=False))
    deltas.append(detok.release(finished=True))
    return deltas


@pytest.mark.parametrize("seed", range(30))
def test_detokenizer_streams_the_full_decode(seed, ours):
    rs = random.Random(seed)
    text = random_text(rs, rs.randint(1, 30))
    ids = ours.encode(text, add_special_tokens=False)
    deltas = stream(ours, [BOS], ids, SamplingParams())
    assert "".join(deltas) == ours.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_continues_the_prompt(seed, skip, ours):
    """After a prompt the first piece's space is real: the stream is what the text gains."""
    rs = random.Random(100 + seed)
    prompt = ours.encode(random_text(rs, rs.randint(1, 10)))
    ids = ours.encode(random_text(rs, rs.randint(1, 20)), add_special_tokens=False)
    if not skip:  # special tokens mid-stream, rendered as text
        ids = ids + [EOS, BOS] + ids
    context = prompt[-5:]  # the detokenizer's context
    want = ours.decode(context + ids, skip_special_tokens=skip)
    assert want.startswith(ours.decode(context, skip_special_tokens=skip))
    deltas = stream(ours, prompt, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == want[len(ours.decode(context, skip_special_tokens=skip)) :]


def test_tokenizer_json_is_preferred(tmp_path, model_dir):
    (tmp_path / "tokenizer.model").write_bytes((model_dir / "tokenizer.model").read_bytes())
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hi": 7, "[UNK]": 0}, "[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    word_level.save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer(tmp_path).encode("hi hi") == [7, 7]


def test_neither_file_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as error:
        Tokenizer(tmp_path)
    message = str(error.value)
    assert "tokenizer.json" in message and "tokenizer.model" in message and str(tmp_path) in message


@pytest.mark.slow
def test_a_sentencepiece_only_model_generates(tmp_path, model_dir):
    """LLM(...) on a model directory whose tokenizer is only tokenizer.model."""
    import shutil

    from hf_models import make_hf_model

    from jaxserve import LLM

    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    make_hf_model(tmp_path, "LlamaForCausalLM", dict(vocab_size=VOCAB + 2))
    assert not (tmp_path / "tokenizer.json").exists()
    llm = LLM(
        tmp_path,
        max_model_len=64,
        num_kv_pages=16,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        warmup=False,
    )
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text_out, chat_out = llm.generate(
        ["hello world", {"messages": [{"role": "user", "content": "hi"}]}], greedy, use_tqdm=False
    )
    assert text_out.prompt_token_ids == [BOS, *llm.tokenizer.encode("hello world")[1:]]
    c = text_out.outputs[0]
    assert len(c.token_ids) == 6 and c.text == llm.tokenizer.decode(c.token_ids).rstrip("\ufffd")
    assert len(chat_out.outputs[0].token_ids) == 6
