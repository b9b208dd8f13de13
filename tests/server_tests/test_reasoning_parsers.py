"""Reasoning parsers: the thinking between `<think>` and `</think>` apart from the
answer, whole or in any pieces; and the grammars that hold only the answer to a
constraint, with the markers as text or as added tokens (as Qwen3's are)."""

import random

import llguidance
import pytest
from hf_models import save_tokenizer

from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured import to_grammar
from jaxserve.structured.grammar import llg_tokenizer
from jaxserve.tokenizer import Tokenizer
from server.reasoning_parsers import PARSERS, Reasoning
from server.tool_parsers import Content

OPEN_PROMPT = "<|assistant|><think>\n"  # DeepSeek-R1's template, Qwen3's thinking models
CLOSED_PROMPT = "<|assistant|><think>\n\n</think>\n\n"  # Qwen3, enable_thinking false

# (parser, prompt, reply, reasoning, answer)
CASES = [
    ("deepseek_r1", OPEN_PROMPT, "Let me think.\n</think>\n\nParis.", "Let me think.\n", "Paris."),
    ("deepseek_r1", "", "<think>\nHm.</think>Yes", "\nHm.", "Yes"),  # older template
    ("deepseek_r1", OPEN_PROMPT, "Still thinking when cut off", "Still thinking when cut off", ""),
    ("deepseek_r1", OPEN_PROMPT, "a < b </thin", "a < b </thin", ""),
    ("deepseek_r1", OPEN_PROMPT, "x</think></think>y", "x", "</think>y"),
    ("qwen3", "<|assistant|>", "<think>\nWhy?\n</think>\n\nBecause.", "\nWhy?\n", "Because."),
    ("qwen3", "<|assistant|>", "Just an answer.", "", "Just an answer."),
    ("qwen3", "<|assistant|>", "\n<think>a</think>b", "a", "b"),
    ("qwen3", CLOSED_PROMPT, "The answer, <think> and all.", "", "The answer, <think> and all."),
    ("qwen3", OPEN_PROMPT, "thinking</think>answer", "thinking", "answer"),
    ("qwen3", "<|assistant|>", "<thin", "", "<thin"),
]


def split(parser, prompt, reply, pieces=None):
    stream = PARSERS[parser](None).stream(prompt)
    events = []
    for piece in pieces or [reply]:
        events += stream.feed(piece)
    events += stream.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    answer = "".join(e.text for e in events if isinstance(e, Content))
    return reasoning, answer


@pytest.mark.parametrize("parser,prompt,reply,reasoning,answer", CASES)
def test_reasoning_and_answer_whole_and_in_any_pieces(parser, prompt, reply, reasoning, answer):
    assert split(parser, prompt, reply) == (reasoning, answer)
    for seed in range(20):
        rs = random.Random(seed)
        pieces, i = [], 0
        while i < len(reply):
            k = rs.choice([1, 1, 2, 5])
            pieces.append(reply[i : i + k])
            i += k
        assert split(parser, prompt, reply, pieces) == (reasoning, answer), pieces


def test_reasoning_streams_as_it_comes():
    stream = PARSERS["deepseek_r1"](None).stream(OPEN_PROMPT)
    assert stream.feed("I think") == [Reasoning("I think")]
    assert stream.feed(" so </th") == [Reasoning(" so ")]  # may be the end marker
    assert stream.feed("ink>\n") == []  # the answer's leading whitespace waits
    assert stream.feed("\nYes") == [Content("Yes")]
    assert stream.finish() == []


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The demo tokenizer (markers are text) and one with <think> and </think> as
    added tokens (as Qwen3 has them)."""
    path = tmp_path_factory.mktemp("think_tokens")
    save_tokenizer(path, vocab_size=300, added={"<think>": False, "</think>": False})
    return {"text": Tokenizer(EMBEDDED_MODELS["demo-model"]), "tokens": Tokenizer(path)}


def accepts(tok, grammar, text):
    llg = llg_tokenizer(tok, tok.vocab_size, [tok.eos_token_id])
    matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("markers", ["text", "tokens"])
def test_constraints_hold_the_answer_only(tokenizers, markers):
    tok = tokenizers[markers]
    answer = to_grammar(StructuredOutputsParams(json=SCHEMA))
    r1 = PARSERS["deepseek_r1"](tok).then(answer, OPEN_PROMPT)
    qwen3 = PARSERS["qwen3"](tok).then(answer, "<|assistant|>")
    for grammar in (r1, qwen3):  # what the engine compiles: it takes the composition
        assert to_grammar(StructuredOutputsParams(grammar=grammar)) == grammar
    free = 'anything {"n": oops} goes </thin'
    assert accepts(tok, r1, f'{free}</think>\n\n{{"n":1}}')
    assert not accepts(tok, r1, '{"n":1}')  # R1 reasons first
    # a template that did not open the reasoning: the reply may, as the parser takes it
    assert accepts(tok, r1, f'<think>{free}</think>\n\n{{"n":1}}')
    assert not accepts(tok, r1, f'{free}</think>{{"n":"1"}}')  # the answer is held
    assert not accepts(tok, r1, f'{free}</think>\n\n\n\n\n{{"n":1}}')  # a little whitespace
    assert accepts(tok, qwen3, '{"n":2}')  # Qwen3 may skip thinking
    assert accepts(tok, qwen3, f'<think>{free}</think>\n\n{{"n":3}}')
    assert not accepts(tok, qwen3, "<think>x</think>no json")
    if markers == "tokens":  # the end of reasoning is the added token, never its pieces
        close = tok.token_id("</think>")
        llg = llg_tokenizer(tok, tok.vocab_size, [tok.eos_token_id])
        matcher = llguidance.LLMatcher(llg, r1, log_level=0)
        assert matcher.consume_token(tok.encode("x", add_special_tokens=False)[0])
        assert matcher.consume_token(close)
