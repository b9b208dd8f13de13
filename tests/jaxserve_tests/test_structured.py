"""Structured output: JSON schemas, regexes, choices and grammars constrain what is
generated, on the embedded demo model and on a random-weight model whose vocabulary
pads its tokenizer's."""

import json
import re

import jsonschema
import numpy as np
import pytest
from hf_models import make_hf_model, save_tokenizer
from test_tokenizer_sentencepiece import model_dir  # noqa: F401 (a fixture: SentencePiece)

from jaxserve import LLM, SamplingParams
from jaxserve.generate_request import GenerateRequest
from jaxserve.sampling_params import StructuredOutputsParams as SO
from jaxserve.structured import GrammarCompiler, either, then, to_grammar
from jaxserve.tokenizer import Tokenizer

SCHEMAS = {
    "flat_required": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_arrays_enums": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^[a-z]{2,5}[0-9]{1,3}$"},
                    "role": {"enum": ["admin", "user", "guest"]},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "role", "active"],
                "additionalProperties": False,
            },
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": -10, "maximum": 10},
                "minItems": 1,
                "maxItems": 3,
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "maxItems": 2,
            },
        },
        "required": ["user", "scores"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -99, "maximum": 99},
                "ok": {"type": ["boolean", "null"]},
            },
            "required": ["x"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
}
REGEX = r"[A-Z][a-z]{1,6} [0-9]{2,4}(-[a-z]{2})?"
CHOICES = ["yes", "no", "maybe so", 'say "hi"']
# Lark (llguidance's dialect): sums of small numbers.
LARK = 'start: expr\nexpr: NUM (OP NUM){0,3}\nNUM: /[0-9]{1,3}/\nOP: "+" | "-"\n'
LARK_RE = r"[0-9]{1,3}([+-][0-9]{1,3}){0,3}"
GBNF = 'root ::= "(" word ("," word)* ")"\nword ::= [a-z] [a-z]?\n'
GBNF_RE = r"\([a-z]{1,2}(,[a-z]{1,2})*\)"
PROMPTS = ["def parse(data):\n    return", "The answer is", "x = "]


# ----------------------------------------------------------------- host logic


@pytest.mark.parametrize(
    "spec, field",
    [
        (SO(json='{"type": "object"'), "structured_outputs.json"),
        (SO(json={"type": "objectx"}), "structured_outputs.json"),
        (SO(json="[1, 2]"), "structured_outputs.json"),
        (SO(regex="a(b"), "structured_outputs.regex"),
        (SO(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (SO(grammar='root ::= "a" (('), "structured_outputs.grammar"),
        (
            SO(grammar='{"grammars": [{"lark_grammar": "start: nope"}]}'),
            "structured_outputs.grammar",
        ),
        (SO(grammar='{"grammar": []}'), "structured_outputs.grammar"),
        (SO(grammar="{not json"), "structured_outputs.grammar"),
    ],
)
def test_invalid_specs_name_the_field(spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        to_grammar(spec)


def test_then_prefixes_any_grammar(demo_tokenizer):
    """`then`: Lark rule items (free text to a marker, say), then any grammar; what
    it returns, llguidance's JSON form, is itself a grammar a request may carry."""
    tok = demo_tokenizer
    compiler = GrammarCompiler(tok, 4096, [tok.eos_token_id])
    try:
        for spec, good, bad in [
            (SO(json=SCHEMAS["flat_required"]), '{"name":"a","age":3}', '{"age":3}'),
            (SO(regex="[0-9]+"), "42", "x"),
            (SO(choice=["yes", "no"]), "no", "maybe"),
            (SO(grammar=LARK), "1+2", "1+"),
        ]:
            grammar = then("notes", to_grammar(spec), "notes[lazy]: /(.|\\n)*END/\n")
            template = compiler.compile(SO(grammar=grammar)).result(timeout=60)
            for answer, ok in ((good, True), (bad, False)):
                m = compiler.matcher(template)
                ids = tok.encode("free text END" + answer, add_special_tokens=False)
                ids.append(tok.eos_token_id)  # the end: allowed only after a whole answer
                assert all(m.accept(t) for t in ids) is ok, (spec, answer)
    finally:
        compiler.close()


def test_either_takes_any_one_of_its_grammars(demo_tokenizer):
    """`either`: text that follows one of its grammars (tool calls or an answer's JSON
    schema, as a chat's response_format beside tools), whatever their kinds; composed
    with `then` too. Two grammars holding the same names are refused."""
    tok = demo_tokenizer
    compiler = GrammarCompiler(tok, 4096, [tok.eos_token_id])
    schema = to_grammar(SO(json=SCHEMAS["flat_required"]))
    lark = to_grammar(SO(grammar=LARK))
    regex = to_grammar(SO(regex="[0-9]+"))
    try:
        for grammar, prefix in [
            (either(lark, schema), ""),
            (either(schema, regex, lark), ""),
            (then("notes", either(lark, schema), "notes[lazy]: /(.|\n)*END/\n"), "x END"),
        ]:
            template = compiler.compile(SO(grammar=grammar)).result(timeout=60)
            for answer, ok in [
                ('{"name":"a","age":3}', True),
                ("1+2", True),
                ('{"age":3}', False),
                ("1+", False),
                ("hello", False),
            ]:
                m = compiler.matcher(template)
                ids = tok.encode(prefix + answer, add_special_tokens=False)
                ids.append(tok.eos_token_id)
                assert all(m.accept(t) for t in ids) is ok, (grammar, answer)
        taken = then("notes", schema, "notes: /x/\n")
        with pytest.raises(ValueError, match="share a name"):
            either(taken, taken)
    finally:
        compiler.close()


@pytest.fixture(scope="module")
def demo_tokenizer():
    from jaxserve.assets import EMBEDDED_MODELS

    return Tokenizer(EMBEDDED_MODELS["demo-model"])


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0]


def test_matcher_masks_follow_the_grammar_and_block_padding(demo_tokenizer):
    tok = demo_tokenizer
    vocab = tok.vocab_size + 100  # the model's vocabulary pads the tokenizer's
    eos = tok.eos_token_id
    compiler = GrammarCompiler(tok, vocab, [eos])
    try:
        matcher = compiler.matcher(compiler.compile(SO(choice=CHOICES)).result(timeout=60))
        row = np.zeros(-(-vocab // 32), np.uint32)
        matcher.fill_bitmask(row)
        allowed = _allowed(row)
        assert allowed.size and allowed.max() < tok.vocab_size
        # Every allowed token starts some choice; every choice's first token is allowed.
        for t in allowed:
            assert any(c.startswith(tok.decode([int(t)])) for c in CHOICES), tok.decode([int(t)])
        for c in CHOICES:
            assert tok.encode(c, add_special_tokens=False)[0] in allowed
        ids = tok.encode("maybe so", add_special_tokens=False)
        for t in ids:
            assert not matcher.terminated
            assert matcher.accept(t)
        assert matcher.terminated
        matcher.fill_bitmask(row)
        assert _allowed(row).tolist() == [eos]  # only EOS after a complete choice
        assert matcher.rollback(len(ids)) and not matcher.terminated
        matcher.fill_bitmask(row)
        assert _allowed(row).tolist() == allowed.tolist()
        assert not matcher.accept(eos)  # EOS is not allowed at the start
    finally:
        compiler.close()


def test_each_spec_compiles_once_in_a_bounded_cache(demo_tokenizer):
    tok = demo_tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id], cache_size=2)
    try:
        a = compiler.compile(SO(json={"type": "object", "properties": {"a": {"type": "string"}}}))
        # The same schema as JSON text, keys in another order: the same entry.
        same = compiler.compile(
            SO(json='{"properties": {"a": {"type": "string"}}, "type": "object"}')
        )
        assert same is a and compiler.num_compiled == 1
        compiler.compile(SO(regex="a+"))
        compiler.compile(SO(regex="b+"))  # evicts the schema (least recently used)
        assert compiler.num_compiled == 3
        a.result(timeout=60)
        compiler.compile(SO(json={"type": "object", "properties": {"a": {"type": "string"}}}))
        assert compiler.num_compiled == 4
        # Two matchers of one template do not share state.
        template = compiler.compile(SO(regex="a+")).result(timeout=60)
        m1, m2 = compiler.matcher(template), compiler.matcher(template)
        assert m1.accept(tok.encode("a", add_special_tokens=False)[0])
        assert not m2.accept(tok.encode("b", add_special_tokens=False)[0])
        assert not m1.error and m2.error
    finally:
        compiler.close()


# -------------------------------------------------------------- the demo model


@pytest.fixture(scope="module")
def demo():
    """The embedded demo model, warmed up, with the compile guard on: a step that
    compiles after warm-up raises."""
    return LLM(
        max_model_len=512,
        block_size=16,
        num_kv_pages=160,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        compile_guard=True,
        compilation_cache_dir=None,
    )


def _check_json(outputs, schema):
    n = 0
    for out in outputs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text), schema)
            n += 1
    return n


def _params(temperature, spec, **kw):
    return SamplingParams(
        temperature=temperature, max_tokens=kw.pop("max_tokens", 300), structured_outputs=spec, **kw
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_demo_json_schemas_parse_and_validate(demo, temperature):
    compiled = demo.engine.runner.compiles.count
    prompts, params, schemas = [], [], []
    for i, schema in enumerate(SCHEMAS.values()):
        for p in PROMPTS:
            prompts.append(p)
            schemas.append(schema)
            n = 1 if temperature == 0 else 2
            params.append(_params(temperature, SO(json=schema), n=n, seed=i))
    outs = demo.generate(prompts, params, use_tqdm=False)
    checked = sum(_check_json([o], s) for o, s in zip(outs, schemas, strict=True))
    assert checked == len(prompts) * (1 if temperature == 0 else 2)
    assert demo.engine.runner.compiles.count == compiled


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_demo_regex_choice_json_object_and_grammars(demo, temperature):
    compiled = demo.engine.runner.compiles.count
    kinds = [
        (SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
        (SO(choice=CHOICES), lambda t: t in CHOICES),
        (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (SO(grammar=LARK), lambda t: re.fullmatch(LARK_RE, t)),
        (SO(grammar=GBNF), lambda t: re.fullmatch(GBNF_RE, t)),
    ]
    prompts = [p for _ in kinds for p in PROMPTS]
    params = [_params(temperature, spec, n=2, seed=3) for spec, _ in kinds for _ in PROMPTS]
    outs = demo.generate(prompts, params, use_tqdm=False)
    stopped = 0
    for j, out in enumerate(outs):
        spec, check = kinds[j // len(PROMPTS)]
        for c in out.outputs:
            if spec.json_object and temperature > 0 and c.finish_reason == "length":
                continue  # any object: sampling may write a key until max_tokens
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            assert check(c.text), (spec, c.text)
            stopped += spec.json_object
    assert stopped >= len(PROMPTS)  # at least half the json_object samples
    assert demo.engine.runner.compiles.count == compiled


def test_demo_constrained_rows_leave_unconstrained_rows_unchanged(demo):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, max_tokens=24, seed=7, ignore_eos=True, min_tokens=3)
    free = ["The function returns", "for i in range(", "import os\n"]
    alone = demo.generate(free, [plain, seeded, plain], use_tqdm=False)
    mixed = demo.generate(
        [free[0], "a", free[1], "b", free[2], "c"],
        [
            plain,
            _params(0, SO(json=SCHEMAS["nested_arrays_enums"])),
            seeded,
            _params(1.0, SO(regex=REGEX), seed=1, min_tokens=2),
            plain,
            _params(0, SO(choice=CHOICES), n=2),
        ],
        use_tqdm=False,
    )
    for a, m in zip(alone, mixed[::2], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    assert re.fullmatch(REGEX, mixed[3].outputs[0].text)


def test_demo_invalid_spec_is_refused_and_the_engine_keeps_serving(demo):
    for spec, field in [
        (SO(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "json"),
        (SO(regex="(["), "regex"),
        (SO(grammar="start: ("), "grammar"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"structured_outputs.{field}")):
            demo.generate(["x"], _params(0, spec), use_tqdm=False)
    assert not demo.engine.has_unfinished()
    out = demo.generate(["x"], _params(0, SO(choice=["ok"])), use_tqdm=False)[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"
    demo.engine.pool.check_invariant()
    assert demo.engine.pool.num_free == demo.engine.pool.capacity


def test_demo_abort_while_the_grammar_compiles(demo):
    engine = demo.engine
    schema = {"type": "object", "properties": {"unique_abort_case": {"type": "integer"}}}
    engine.add_request(GenerateRequest("compiling", [1, 2, 3], _params(0, SO(json=schema))))
    assert engine.has_unfinished()
    assert engine.abort("compiling")
    assert not engine.has_unfinished()


PLAIN4 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _slow_compiles(monkeypatch, engine, release, error=None):
    """Makes the engine's grammar compiles wait for `release` (then raise `error`)."""
    compiler = engine.grammars.compiler()
    compile_now = compiler._compile

    def slow(spec):
        assert release.wait(60)
        if error is not None:
            raise error
        return compile_now(spec)

    monkeypatch.setattr(compiler, "_compile", slow)


def test_demo_a_compiling_grammar_does_not_hold_up_other_requests(demo, monkeypatch):
    import threading

    engine, release = demo.engine, threading.Event()
    _slow_compiles(monkeypatch, engine, release)
    schema = {
        "type": "object",
        "properties": {"slow_case": {"enum": ["a", "b"]}},
        "required": ["slow_case"],
    }
    engine.add_request(GenerateRequest("slow", [1, 2, 3], _params(0, SO(json=schema))))
    engine.add_request(GenerateRequest("plain", [1, 2, 3], PLAIN4))
    done = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if "plain" in done:
            break
    assert "plain" in done and "slow" not in done  # served while the grammar compiled
    release.set()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    c = done["slow"].outputs[0]
    assert c.finish_reason == "stop" and json.loads(c.text)["slow_case"] in ("a", "b")


def test_demo_a_grammar_that_fails_to_compile_aborts_only_its_request(demo, monkeypatch):
    import threading

    engine, release = demo.engine, threading.Event()
    _slow_compiles(monkeypatch, engine, release, ValueError("structured_outputs.regex: boom"))
    engine.add_request(
        GenerateRequest("fails", [1, 2, 3], _params(0, SO(regex="x{1,3}failing-case")))
    )
    engine.add_request(GenerateRequest("plain", [1, 2, 3], PLAIN4))
    release.set()
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["fails"].outputs[0].finish_reason == "abort"
    assert "compiling its grammar: ValueError: structured_outputs.regex: boom" in (
        done["fails"].error or ""
    )  # the cause, not a bare abort
    assert done["plain"].outputs[0].finish_reason == "length"
    assert not engine.requests
    # The failure is cached: the same spec is refused at once, naming the field.
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        engine.add_request(
            GenerateRequest("again", [1, 2, 3], _params(0, SO(regex="x{1,3}failing-case")))
        )


def test_demo_a_grammar_whose_matchers_fail_to_start_fails_only_its_request(demo, monkeypatch):
    """Its samples were never handed to the scheduler: failing them used to raise
    ValueError (list.remove) out of the engine loop, ending the engine."""
    engine = demo.engine
    compiler = engine.grammars.compiler()

    def broken(compiled):
        raise RuntimeError("no matcher today")

    monkeypatch.setattr(compiler, "matcher", broken)
    engine.add_request(GenerateRequest("fails", [1, 2, 3], _params(0, SO(regex="no-matcher"), n=2)))
    engine.add_request(GenerateRequest("plain", [1, 2, 3], PLAIN4))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [c.finish_reason for c in done["fails"].outputs] == ["abort", "abort"]
    assert "starting its grammar: RuntimeError: no matcher today" in done["fails"].error
    assert done["plain"].outputs[0].finish_reason == "length"
    assert not engine.requests


@pytest.mark.parametrize(
    "method, doing",
    [("accept", "applying its sampled tokens"), ("fill_bitmask", "packing its sampler rows")],
)
def test_demo_a_grammar_that_raises_fails_only_its_request(demo, monkeypatch, method, doing):
    """An exception from a request's grammar matcher, while it checks a sampled token
    (`accept`) or fills the next token's bitmask (`fill_bitmask`, in the sampler rows'
    packing), fails that request alone; the unconstrained request beside it gets the
    tokens it gets alone, and every page comes back."""
    from jaxserve.structured.compiler import GrammarMatcher

    engine = demo.engine

    def run(*requests):
        for r in requests:
            engine.add_request(r)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return done

    alone = run(GenerateRequest("alone", [1, 2, 3], PLAIN4))["alone"].outputs[0].token_ids

    def broken(self, *args):
        raise RuntimeError(f"injected failure in {method}")

    monkeypatch.setattr(GrammarMatcher, method, broken)
    spec = _params(0, SO(regex=f"(yes|no) {method}-case"))
    done = run(GenerateRequest("g", [1, 2, 3], spec), GenerateRequest("plain", [1, 2, 3], PLAIN4))
    assert done["plain"].error is None and done["plain"].outputs[0].token_ids == alone
    failed = done["g"]
    assert failed.outputs[0].finish_reason == "abort"
    assert doing in failed.error and f"injected failure in {method}" in failed.error
    assert not engine.requests and engine.pool.num_free == engine.pool.capacity


# ------------------------------------------------------ a random-weight model


@pytest.fixture(scope="module")
def padded_model_dir(tmp_path_factory):
    """A random Qwen2 whose vocabulary (384) pads its tokenizer's (at most 320)."""
    path = tmp_path_factory.mktemp("structured_padded")
    make_hf_model(
        path,
        "Qwen2ForCausalLM",
        dict(vocab_size=384, tie_word_embeddings=True, max_position_embeddings=512),
    )
    save_tokenizer(path, vocab_size=320)
    return str(path)


def test_random_model_with_preemption_prefix_cache_and_chunked_prefill(padded_model_dir):
    llm = LLM(
        padded_model_dir,
        max_model_len=512,
        block_size=8,
        num_kv_pages=200,
        max_num_seqs=8,
        max_num_batched_tokens=32,  # long prompts are prefilled in chunks
        debug_preemption_rate=0.2,  # and sequences preempted (recomputed) at random
        warmup=False,
    )
    tok_vocab = llm.tokenizer.vocab_size
    assert tok_vocab < llm.config.model.vocab_size
    prefix = "Once upon a time, there was a little engine that could. " * 3
    prompts = [prefix + p for p in PROMPTS]  # share their first pages: prefix cache hits
    for temperature in (0.0, 1.0):
        specs = list(SCHEMAS.values())
        outs = llm.generate(
            [p for _ in specs for p in prompts],
            [_params(temperature, SO(json=s), n=2, seed=5) for s in specs for _ in prompts],
            use_tqdm=False,
        )
        for j, out in enumerate(outs):
            _check_json([out], specs[j // len(prompts)])
            for c in out.outputs:
                assert max(c.token_ids) < tok_vocab or c.token_ids[-1] in llm.engine.eos_token_ids
        outs = llm.generate(
            prompts, _params(temperature, SO(regex=REGEX), n=2, seed=6), use_tqdm=False
        )
        assert all(re.fullmatch(REGEX, c.text) for o in outs for c in o.outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.prefix_hits > 0


def test_a_sentencepiece_tokenizer_constrains_too(model_dir):  # noqa: F811
    """A tokenizer.model-only directory: llguidance reads its pieces' bytes ("▁" is a
    space, <0xNN> a byte)."""
    tok = Tokenizer(model_dir)
    compiler = GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])
    try:
        template = compiler.compile(SO(regex=" ?the (quick|lazy) [a-z]+ 東京")).result(timeout=60)
        matcher = compiler.matcher(template)
        row = np.zeros(-(-tok.vocab_size // 32), np.uint32)
        for t in tok.encode("the lazy dog 東京", add_special_tokens=False):
            matcher.fill_bitmask(row)
            assert t in _allowed(row), tok.decode([t])
            assert matcher.accept(t)
        matcher.fill_bitmask(row)
        assert _allowed(row).tolist() == [tok.eos_token_id]
        assert not matcher.accept(tok.encode(" fox", add_special_tokens=False)[0])
    finally:
        compiler.close()


def test_a_tokenizer_larger_than_the_vocabulary_is_a_clear_error(demo_tokenizer):
    tok = demo_tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size - 96, [tok.eos_token_id])
    try:
        with pytest.raises(ValueError, match=r"structured_outputs\.regex: this model's tokenizer"):
            compiler.compile(SO(regex="a+")).result(timeout=60)
    finally:
        compiler.close()
