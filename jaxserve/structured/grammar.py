"""From a request's `StructuredOutputsParams` to an llguidance grammar, and from the
engine's tokenizer to llguidance's (no JAX, no torch).

Grammars are llguidance's: a JSON schema, a regex, a choice (a Lark grammar of
the literal strings) or a context-free grammar in Lark syntax (llguidance's
dialect); a GBNF grammar (llama.cpp's, recognised by `::=`) is translated to Lark,
and llguidance's own JSON form (`{"grammars": [...]}`, as `then` and `either`
compose) is taken as it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer

# JSON is written compactly, with ", " and ": " between items: no free-form runs of
# whitespace, which a sampling model can otherwise extend until max_tokens. A
# schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False}


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """A hashable key, equal for equal specs (a schema dict and its JSON text differ)."""
    value = getattr(spec, spec.kind)
    if isinstance(value, dict | list):
        value = json.dumps(value, sort_keys=True)
    return spec.kind, str(value)


def to_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec`, checked (without a tokenizer: cheap, about a
    millisecond). Raises ValueError naming the field (`structured_outputs.json`, ...)."""
    kind = spec.kind
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            schema = spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{field} is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(
                    f"{field} must be a JSON schema object, got {type(schema).__name__}"
                )
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            # JSON string literals are Lark string literals (escapes included).
            lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice)
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        elif spec.grammar.lstrip().startswith("{"):  # llguidance's own JSON form
            grammar = _llguidance_json(spec.grammar, field)
        else:
            lark = spec.grammar
            if "::=" in lark:  # GBNF
                try:
                    lark = gbnf_to_lark(lark)
                except Exception as e:  # the translator raises plain Exceptions too
                    raise ValueError(f"{field} is not valid GBNF: {e}") from None
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        if str(e).startswith(field):
            raise
        raise ValueError(f"{field} is invalid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"{field} is invalid: {error.strip()}")
    return grammar


def _llguidance_json(text: str, field: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field} is neither Lark nor llguidance JSON: {e}") from None
    if not isinstance(value, dict) or not isinstance(value.get("grammars"), list):
        raise ValueError(f'{field} in JSON must be llguidance\'s {{"grammars": [...]}}')
    return text


# The names `then` and `either` give the grammars they compose (llguidance grammars
# reference each other by name).
_THEN = "jaxserve_then"
_EITHER = "jaxserve_either"


def _grammars(grammar: str) -> list[dict]:
    """Any grammar `to_grammar` returns as llguidance's list of named grammars."""
    if grammar.lstrip().startswith("{"):
        return json.loads(grammar)["grammars"]
    return [{"lark_grammar": grammar}]


def then(prefix: str, grammar: str, rules: str = "") -> str:
    """llguidance's grammar of the Lark rule items `prefix` (with the Lark `rules` it
    names) followed by `grammar` (any grammar `to_grammar` returns): for example
    free text up to a marker, then a JSON schema."""
    grammars = _grammars(grammar)
    first = {**grammars[0], "name": _THEN}
    lark = f"start: {prefix} @{_THEN}\n{rules}"
    return json.dumps({"grammars": [{"name": "start", "lark_grammar": lark}, first, *grammars[1:]]})


def either(*grammars: str) -> str:
    """llguidance's grammar of text that follows one of `grammars` (any that
    `to_grammar` returns): for example tool calls, or an answer in a JSON schema.
    Raises ValueError if two of them hold grammars of the same name."""
    named: list[dict] = []
    starts = []
    for i, grammar in enumerate(grammars):
        parts = _grammars(grammar)
        starts.append(f"@{_EITHER}_{i}")
        named += [{**parts[0], "name": f"{_EITHER}_{i}"}, *parts[1:]]
    names = [g.get("name") for g in named if g.get("name") is not None]
    if len(set(names)) < len(names):
        raise ValueError(f"grammars to alternate share a name: {sorted(names)}")
    lark = "start: " + " | ".join(starts) + "\n"
    return json.dumps({"grammars": [{"name": "start", "lark_grammar": lark}, *named]})


def llg_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of the engine's tokenizer, `vocab_size` ids wide (the model's
    vocabulary, which may pad the tokenizer's: ids without a token are never allowed).

    Costs about a second for a 150k vocabulary (llguidance builds its token trie):
    once per engine, off the engine thread."""
    eos = sorted(set(eos_token_ids))
    if tokenizer.eos_token_id is not None and not eos:
        eos = [tokenizer.eos_token_id]
    backend = tokenizer.backend
    if hasattr(backend, "to_json"):  # tokenizer.json: llguidance reads it as it is
        return llguidance.LLTokenizer(backend.to_json(), n_vocab=vocab_size, eos_token=eos or None)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Pieces(tokenizer, eos)),
        n_vocab=vocab_size,
        eos_token=eos or None,
    )


class _Pieces:
    """A SentencePiece tokenizer as llguidance's `TokenizerWrapper` reads one: every id's
    bytes, the special ids, and an encode function."""

    def __init__(self, tokenizer: Tokenizer, eos: list[int]):
        self._tokenizer = tokenizer
        self.tokens = tokenizer.backend.token_bytes()
        self.eos_token_id = eos[0] if eos else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        special = set(self.special_token_ids)
        self._ids: dict[bytes, int] = {}  # bytes -> the first plain token of them
        for i, b in enumerate(self.tokens):
            if b and i not in special:
                self._ids.setdefault(b, i)

    def __call__(self, text: str) -> list[int]:
        """Tokens of `text` in the middle of a text: llguidance re-tokenizes the bytes
        a grammar forces, so the dummy-prefix space SentencePiece puts before a text's
        first piece must not be there."""
        if not isinstance(text, str):
            raise TypeError("takes str")  # llguidance probes for bytes support
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if ids and b"".join(self.tokens[i] for i in ids) == b" " + text.encode():
            rest = self.tokens[ids[0]][1:]  # the first piece without the dummy prefix
            if not rest:
                return ids[1:]
            if rest in self._ids:
                return [self._ids[rest], *ids[1:]]
            if all(bytes([b]) in self._ids for b in rest):  # byte-fallback pieces
                return [self._ids[bytes([b])] for b in rest] + ids[1:]
        return ids
