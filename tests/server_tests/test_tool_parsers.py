"""Tool-call parsers on replies in each format the model families document (Qwen's
Hermes tags, Meta's Llama 3.x JSON, Mistral's [TOOL_CALLS] before and after its v11
tokenizer): whole, cut anywhere, malformed, several calls in one reply; and their
grammars, which accept exactly the calls the functions' schemas allow."""

import json
import random

import llguidance
import pytest

from jaxserve.structured.grammar import llg_tokenizer
from jaxserve.tokenizer import Tokenizer
from server.tool_parsers import (
    PARSERS,
    CallArgs,
    CallCut,
    CallEnd,
    CallFailed,
    CallStart,
    Content,
    Function,
    assemble,
)
from server.tool_parsers.json_prefix import JsonObject

NAMES = ["get_current_weather", "get_time", "add", "search"]
WEATHER = '{"location": "San Francisco, CA", "unit": "celsius"}'
NESTED = '{"query": {"text": "caf\\u00e9 \\"quoted\\" \\\\ 東京", "tags": ["a", [1, 2.5e-3, -0]]}, "n": null, "ok": true}'  # noqa: E501

# (format, reply, content, [(name, arguments)]): replies as the families document them.
CASES = [
    # Qwen 2.5 / Qwen 3 (Hermes): content, then calls in tags.
    ("hermes",
     f'<tool_call>\n{{"name": "get_current_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "", [("get_current_weather", WEATHER)]),
    ("hermes", "Let me check both.\n\n<tool_call>\n"
     f'{{"name": "get_current_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}\n</tool_call>',
     "Let me check both.", [("get_current_weather", WEATHER), ("get_time", '{"zone": "PST"}')]),
    ("hermes", f'<tool_call>\n{{"name": "search", "arguments": {NESTED}}}\n</tool_call>',
     "", [("search", NESTED)]),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>',  # args first
     "", [("add", '{"a": 1}')]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", "{}")]),
    ("hermes", '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>',
     "", [("add", '{"a":1}')]),
    ("hermes", "Sunny; no <tool> needed.", "Sunny; no <tool> needed.", []),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\nDone.',
     "Done.", [("add", '{"a": 1}')]),
    # Llama 3.1 / 3.2 / 3.3 JSON-based tool calling.
    ("llama3_json", f'{{"name": "get_current_weather", "parameters": {WEATHER}}}',
     "", [("get_current_weather", WEATHER)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_current_weather", "parameters": {WEATHER}}}',
     "", [("get_current_weather", WEATHER)]),
    ("llama3_json",
     '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_time", "parameters": {}}',
     "", [("add", '{"a": 1, "b": 2}'), ("get_time", "{}")]),
    ("llama3_json", '{"name": "add", "arguments": {"a": 1}}', "", [("add", '{"a": 1}')]),
    ("llama3_json", "It is 3 pm in Paris.", "It is 3 pm in Paris.", []),
    # Mistral: tokenizers before v11 ...
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_current_weather", "arguments": {WEATHER}}}]',
     "", [("get_current_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
     f'{{"name": "get_current_weather", "arguments": {WEATHER}}}]',
     "", [("add", '{"a": 3.5, "b": 4}'), ("get_current_weather", WEATHER)]),
    ("mistral", 'Hello[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]',
     "Hello", [("add", '{"a": 1, "b": 2}')]),
    # ... and from v11 on ([ARGS] and [CALL_ID] decoded, or skipped as special tokens).
    ("mistral", f"[TOOL_CALLS]get_current_weather[ARGS]{WEATHER}",
     "", [("get_current_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]get_time[ARGS]{}',
     "", [("add", '{"a": 3.5, "b": 4}'), ("get_time", "{}")]),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]get_time{"zone": "CET"}',
     "", [("add", '{"a": 3.5, "b": 4}'), ("get_time", '{"zone": "CET"}')]),
    ("mistral", '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1}', "", [("add", '{"a": 1}')]),
    ("mistral", "Paris is sunny.", "Paris is sunny.", []),
]  # fmt: skip

# Replies that do not parse: all content, never an error.
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": one}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1'),  # cut off
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # not offered
    ("hermes", '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),
    ("hermes", "<tool_call>\nadd(a=1)\n</tool_call>"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1,}}'),
    ("llama3_json", '{"city": "Paris"}'),
    ("llama3_json", '<|python_tag|>brave_search.call(query="Paris")'),
    ("mistral", "[TOOL_CALLS] not json at all"),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}'),
    ("mistral", "[TOOL_CALLS]add[ARGS]{'a': 1}"),
    # a value no JSON value starts with, at the call object's top level (IndexError)
    ("hermes", '<tool_call>\n{"name": add}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": None}\n</tool_call>'),
    ("llama3_json", '{"name": None}'),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": <x>}]'),
    # content, then a call that does not parse: the text comes back exactly
    ("hermes", "Sure.\n<tool_call>\nadd(a=1)"),
    ("mistral", "Hello [TOOL_CALLS]oops"),
]


def events_of(fmt, text, chunks=None, names=NAMES):
    """All events of `text` fed in the given pieces (whole by default)."""
    stream = PARSERS[fmt](None).stream(names)
    events = []
    for piece in chunks or [text]:
        events += stream.feed(piece)
    return events + stream.finish(), stream


def cuts(text, seed):
    rs = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        k = rs.choice([1, 1, 2, 3, 7])
        pieces.append(text[i : i + k])
        i += k
    return pieces


def calls_of(events):
    content, calls = assemble(events)
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_documented_replies_parse_whole_and_in_any_pieces(fmt, text, content, calls):
    events, stream = events_of(fmt, text)
    assert calls_of(events) == (content, calls)
    assert stream.completed == len(calls)
    for seed in range(20):
        assert calls_of(events_of(fmt, text, cuts(text, seed))[0]) == (content, calls), seed
    ids = [e.id for e in events if isinstance(e, CallStart)]
    assert len(set(ids)) == len(ids) == len(calls)
    if fmt == "mistral":  # Mistral's templates take 9 letters and digits
        assert all(len(i) == 9 and i.isalnum() for i in ids)


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_a_reply_that_does_not_parse_is_content(fmt, text):
    events, stream = events_of(fmt, text)
    assert calls_of(events) == (text, []) and stream.completed == 0
    for seed in range(10):
        assert calls_of(events_of(fmt, text, cuts(text, seed))[0]) == (text, [])


@pytest.mark.parametrize("fmt,text", MALFORMED + [(f, t) for f, t, _, _ in CASES])
def test_streamed_deltas_keep_the_arguments_a_valid_json_prefix(fmt, text):
    """After every character, what a client has assembled of each call's arguments is
    the beginning of valid JSON; a call's id and name come before its arguments."""
    stream = PARSERS[fmt](None).stream(NAMES)
    args: dict[int, str] = {}
    failed = set()
    for events in [stream.feed(c) for c in text] + [stream.finish()]:
        for e in events:
            if isinstance(e, CallFailed):
                failed.add(e.index)
            elif isinstance(e, CallStart):
                assert e.index not in args
                args[e.index] = ""
            elif isinstance(e, CallArgs):
                args[e.index] += e.text
                prefix = JsonObject()
                assert prefix.feed(args[e.index]) == len(args[e.index]), args[e.index]
                assert prefix.error is None
    for index, text_so_far in args.items():
        if index not in failed:
            json.loads(text_so_far)


def test_a_call_that_fails_midway_keeps_earlier_calls():
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": PST}}\n</tool_call>'
    )
    events, stream = events_of("hermes", text)
    content, calls = calls_of(events)
    assert calls == [("add", '{"a": 1}')] and stream.completed == 1
    assert content == text[text.index("<tool_call>", 10) :]
    # The stream had sent the second call's start: it ends as failed, its text content.
    (failed,) = [e for e in events if isinstance(e, CallFailed)]
    assert failed.index == 1 and failed.text.startswith("<tool_call>")


def test_partial_markers_wait_and_content_streams_as_it_comes():
    stream = PARSERS["hermes"](None).stream(NAMES)
    assert stream.feed("Checking") == [Content("Checking")]
    assert stream.feed(" now <tool_") == [Content(" now")]  # the rest may open a call
    assert stream.feed("box>") == [Content(" <tool_box>")]
    assert stream.finish() == []


def test_json_object_checker_agrees_with_json():
    rs = random.Random(0)

    def value(depth=0):
        k = rs.randrange(7 if depth < 3 else 4)
        if k == 0:
            return rs.choice([True, False, None, 0, -1.5e-7, 10**20])
        if k == 1:
            return "".join(rs.choice('ab"\\\n\t é東🙂/\x01') for _ in range(rs.randrange(5)))
        if k in (2, 3):
            return rs.uniform(-1e6, 1e6)
        if k in (4, 5):
            return {f"k{i}": value(depth + 1) for i in range(rs.randrange(3))}
        return [value(depth + 1) for _ in range(rs.randrange(3))]

    for _ in range(500):
        obj = {f"m{i}": value() for i in range(rs.randrange(4))}
        text = json.dumps(obj, ensure_ascii=rs.random() < 0.5, indent=rs.choice([None, 1]))
        checker = JsonObject()
        assert checker.feed(text + " tail") == len(text) and checker.done
        assert [json.loads(text[m.key_start : m.key_end]) for m in checker.members] == list(obj)
        values = [json.loads(text[m.value_start : m.value_end]) for m in checker.members]
        assert values == list(obj.values())
        # One character changed: the checker stops where the text stops being JSON.
        i = rs.randrange(len(text))
        bad = text[:i] + rs.choice('{}[],:"\\ 0-.eEtx') + text[i + 1 :]
        checker = JsonObject()
        taken = checker.feed(bad)
        if checker.done:
            json.loads(bad[:taken])
        else:
            with pytest.raises(json.JSONDecodeError):
                json.loads(bad)


# ------------------------------------------------------------------ grammars

FUNCTIONS = [
    Function(
        "get_current_weather",
        {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    ),
    Function("get_time", {"type": "object", "properties": {}}),
]
GOOD = {
    "hermes": [
        f'<tool_call>\n{{"name": "get_current_weather", "arguments": {WEATHER}}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    ],
    "llama3_json": [
        f'{{"name": "get_current_weather", "parameters": {WEATHER}}}',
        '{"name": "get_time", "parameters": {}}',
    ],
    "mistral": [
        f'[TOOL_CALLS][{{"name": "get_current_weather", "arguments": {WEATHER}}}]',
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]',
    ],
}
PARALLEL = {
    "hermes": "\n".join(GOOD["hermes"]),
    "llama3_json": "; ".join(GOOD["llama3_json"]),
    "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, '
    f'{{"name": "get_current_weather", "arguments": {WEATHER}}}]',
}
BAD_ARGS = {
    "hermes": '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "X", "unit": "kelvin"}}',  # noqa: E501
    "llama3_json": '{"name": "get_current_weather", "parameters": {"unit": "celsius"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"extra": 1}',
}


@pytest.fixture(scope="module")
def demo_tokenizer():
    from jaxserve.assets import EMBEDDED_MODELS

    tok = Tokenizer(EMBEDDED_MODELS["demo-model"])
    return tok, llg_tokenizer(tok, tok.vocab_size, [tok.eos_token_id])


def accepts(demo_tokenizer, lark, text):
    tok, llg = demo_tokenizer
    matcher = llguidance.LLMatcher(llg, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammars_accept_the_format_and_the_schemas_only(demo_tokenizer, fmt):
    parser = PARSERS[fmt](demo_tokenizer[0])

    def grammar(required, parallel):
        return parser.grammar(FUNCTIONS, required=required, parallel=parallel)

    for text in GOOD[fmt]:
        for required in (True, False):
            assert accepts(demo_tokenizer, grammar(required, False), text), (required, text)
        events, _ = events_of(fmt, text, names=[f.name for f in FUNCTIONS])
        assert calls_of(events)[1]  # what the grammar allows, the parser reads as a call
    assert accepts(demo_tokenizer, grammar(True, True), PARALLEL[fmt])
    assert not accepts(demo_tokenizer, grammar(True, False), PARALLEL[fmt])  # one call only
    assert calls_of(events_of(fmt, PARALLEL[fmt])[0])[1]
    for required in (True, False):
        assert not accepts(demo_tokenizer, grammar(required, True), BAD_ARGS[fmt])
    assert not accepts(demo_tokenizer, grammar(True, True), "Just text.")  # required: a call
    assert accepts(demo_tokenizer, grammar(False, True), "Just text.")  # auto: text is fine


def test_parameters_without_a_type_still_take_an_object_only(demo_tokenizer):
    """`parameters: {}` (common in OpenAI requests) let a forced call's arguments be
    any JSON value, which the parser then refused: the call came back as content."""
    parser = PARSERS["hermes"](demo_tokenizer[0])
    lark = parser.grammar([Function("ping", {})], required=True, parallel=False)
    call = '<tool_call>\n{"name": "ping", "arguments": %s}\n</tool_call>'
    assert accepts(demo_tokenizer, lark, call % "{}")
    assert not accepts(demo_tokenizer, lark, call % "5")


def test_a_llama3_call_with_both_argument_keys_keeps_the_first():
    """Fed a character at a time, the later "parameters" replaced "arguments" after
    part of it was sent: the call completed with `{"x": 1}222}`."""
    text = '{"name": "add", "arguments": {"x": 1}, "parameters": {"y": 22222}}'
    want = ("", [("add", '{"x": 1}')])
    assert calls_of(events_of("llama3_json", text)[0]) == want
    assert calls_of(events_of("llama3_json", text, list(text))[0]) == want


@pytest.fixture(scope="module")
def marker_tokenizer(tmp_path_factory):
    """A tokenizer with the formats' markers as added tokens: Mistral's (v11) special,
    Qwen's plain, as their tokenizers have them."""
    from hf_models import save_tokenizer

    path = tmp_path_factory.mktemp("marker_tokens")
    added = {"[TOOL_CALLS]": True, "[ARGS]": True, "<tool_call>": False, "</tool_call>": False}
    save_tokenizer(path, vocab_size=300, added=added)
    tok = Tokenizer(path)
    return tok, llg_tokenizer(tok, tok.vocab_size, [tok.eos_token_id])


def test_markers_that_are_tokens_are_written_as_those_tokens(marker_tokenizer):
    """A grammar names a one-token marker by its id (llguidance takes every added token
    for a special one: written as text, the marker would come out in pieces); special
    markers are decoded for the parser (skip_special_tokens off)."""
    tok, _ = marker_tokenizer
    mistral, hermes = PARSERS["mistral"](tok), PARSERS["hermes"](tok)
    assert mistral.special_markers() and not hermes.special_markers()
    v11 = "[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_current_weather[ARGS]" + WEATHER
    tagged = GOOD["hermes"][1]
    for parser, text in ((mistral, v11), (hermes, tagged)):
        for required in (True, False):
            lark = parser.grammar(FUNCTIONS, required=required, parallel=True)
            assert f"<[{tok.token_id(parser.markers[0])}]>" in lark
            assert accepts(marker_tokenizer, lark, text)
            assert accepts(marker_tokenizer, lark, "Text.") is not required
        # The text the engine decodes (special tokens kept) parses to the calls.
        decoded = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)
        assert len(calls_of(events_of(parser.name, decoded)[0])[1]) == (
            2 if parser is mistral else 1
        )


def test_free_text_may_not_spell_a_one_token_marker_out_in_pieces(marker_tokenizer):
    """Constrained `auto`: text around calls is free, but "<tool_call>" written as
    ordinary tokens would be read by the parser as a call no grammar checked."""
    tok, llg = marker_tokenizer
    lark = PARSERS["hermes"](tok).grammar(FUNCTIONS, required=False, parallel=True)
    head, tail = (tok.encode(part, add_special_tokens=False) for part in ("Hi <tool", "_call>"))
    assert tok.token_id("<tool_call>") not in head + tail
    matcher = llguidance.LLMatcher(llg, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert all(matcher.consume_token(t) for t in head)  # free text so far
    assert not all(matcher.consume_token(t) for t in tail)  # not the marker spelled out


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_calls_a_grammar_held_cut_anywhere_are_no_content(fmt):
    """`finish(cut=True)`: max_tokens cut a reply whose calls a grammar held (D6). Cut
    anywhere, nothing of it is content (it was the marker and the partial JSON); a
    call whose name was sent ends in `CallCut` (a whole reply leaves it out), those
    before it stay. Not cut, the same text is content, as ever."""
    text = PARALLEL[fmt]
    names = [f.name for f in FUNCTIONS]
    whole = calls_of(events_of(fmt, text, names=names)[0])[1]
    for k in range(1, len(text)):
        stream = PARSERS[fmt](None).stream(names)
        events = stream.feed(text[:k]) + stream.finish(cut=True)
        content, calls = calls_of(events)
        assert content == "" and not any(isinstance(e, CallFailed) for e in events), k
        started = [e.index for e in events if isinstance(e, CallStart)]
        ended = [e.index for e in events if isinstance(e, CallEnd | CallCut)]
        assert started == ended and calls == whole[: len(calls)], (k, events)
    cut_short = text[: text.index("get_time") + 4]
    assert calls_of(events_of(fmt, cut_short, names=names)[0])[0]  # uncut: content


def test_a_reply_whose_later_call_breaks_does_not_finish_with_tool_calls():
    """A stream has sent the broken call's beginning (not parseable as a call): the
    reply is not `finish_reason: "tool_calls"`, though the call before it completed."""
    from server.openai_api.chat_output import ChoiceReader, finish_reason

    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    broken = '\n<tool_call>\n{"name": "add", "arguments": {"a": 1'
    for text, want in ((good, "tool_calls"), (good + broken, "stop")):
        reader = ChoiceReader(None, PARSERS["hermes"](None).stream(NAMES))
        reader.feed(text)
        reader.finish()
        assert finish_reason("stop", reader) == want
