"""Incremental detokenization and stop strings on multibyte text (property-style)."""

import random

import pytest

from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

ALPHABET = list("abc xyz.,!") + list("éüñçø") + list("東京北京日本語") + ["🙂", "🚀", "👍🏽", "🇫🇷"]


def random_text(rs: random.Random, n: int) -> str:
    return "".join(rs.choice(ALPHABET) for _ in range(n))


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def stream(tok, ids, params, prompt=(1,)):
    detok = IncrementalDetokenizer(tok, list(prompt), params)
    deltas, stop = [], None
    for t in ids:
        stop = detok.add(t)
        deltas.append(detok.release(finished=stop is not None))
        if stop is not None:
            break
    deltas.append(detok.release(finished=True))
    return deltas, detok.text, stop


@pytest.mark.parametrize("seed", range(40))
def test_deltas_concatenate_to_the_full_decode_without_broken_characters(tok, seed):
    rs = random.Random(seed)
    text = random_text(rs, rs.randint(1, 30))
    ids = tok.encode(text, add_special_tokens=False)
    deltas, final, _ = stream(tok, ids, SamplingParams())
    assert "".join(deltas) == final == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_are_never_streamed(tok, seed, include):
    rs = random.Random(1000 + seed)
    text = random_text(rs, rs.randint(8, 30))
    start = rs.randint(1, len(text) - 2)
    stop = text[start : start + rs.randint(1, 3)]
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=[stop, "never-there"], include_stop_str_in_output=include)
    deltas, final, hit = stream(tok, ids, params)
    first = text.index(stop)
    want = text[: first + len(stop)] if include else text[:first]
    assert hit == stop and final == want and "".join(deltas) == want
    streamed = ""
    for d in deltas:
        streamed += d
        assert want.startswith(streamed)  # never a character past the cut


def test_a_short_stop_string_that_ended_before_min_tokens_is_not_found_late(tok):
    """With stops of different lengths, the first check after min_tokens must not find
    a short stop that ended earlier (it used to search from len - (longest - 1))."""
    ids = [tok.encode(ch, add_special_tokens=False) for ch in "abc"]
    assert all(len(i) == 1 for i in ids)
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["a", "xyz"]))
    assert detok.add(ids[0][0], check_stop=False) is None  # "a" before min_tokens
    assert detok.add(ids[1][0], check_stop=False) is None
    assert detok.add(ids[2][0], check_stop=True) is None  # min_tokens reached at "c"
    assert detok.text == "abc"
    assert detok.add(tok.encode("a", add_special_tokens=False)[0]) == "a"  # a new "a" stops
