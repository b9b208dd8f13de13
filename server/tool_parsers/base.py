"""The tool-call parser interface, its events, and the pieces the formats share.

A format (one file each: `hermes.py`, `llama3_json.py`, `mistral.py`) is a
`ToolParser`: it reads what a model writes into content and calls, a piece at a
time (`stream`), and builds the Lark grammar (llguidance's dialect) that makes
the model write calls in that format whose arguments match the functions' JSON
schemas (`grammar`).

A `CallStream` takes a choice's text as it arrives and returns events:
`Content`, then per call `CallStart` (its index, id and name, once the name is
known), `CallArgs` (fragments of the arguments' JSON text, exactly as the model
wrote it) and `CallEnd`. The events do not depend on how the text was cut into
pieces, so a streamed response reassembles to the non-streamed one (`assemble`).
Every arguments fragment keeps what was sent a prefix of valid JSON
(`json_prefix.JsonObject`). A call the model leaves unfinished, malformed, or
naming a function it was not given ends in `CallFailed`: from there on everything,
that call's text included, is content; a non-streamed response then has that
text as content and no such call, while a stream has already sent the call's
valid beginning. Either way the reply does not end with `finish_reason:
"tool_calls"`, even where another call completed.

A reply whose calls a grammar held (`finish(cut=True)`: tool_choice required or
named, constrained auto) and that max_tokens cut short is not content written
like a call: it is a call cut short. Its text is dropped (a marker cut midway
too) and, once its name was sent, it ends in `CallCut`: a non-streamed response
has no such call and no such content, a stream has sent its arguments as far
as they got (as OpenAI streams a call cut by max_tokens).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import json
import re
import secrets
import string
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from jaxserve.tokenizer import Tokenizer
from server.tool_parsers.json_prefix import JsonObject

# ---------------------------------------------------------------------- events


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclasses.dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


@dataclasses.dataclass(frozen=True)
class CallEnd:
    index: int


@dataclasses.dataclass(frozen=True)
class CallFailed:
    index: int
    text: str  # the call's text as the model wrote it: content from here on


@dataclasses.dataclass(frozen=True)
class CallCut:
    index: int  # a call its grammar held, cut short by max_tokens: not a call, not content


Event = Content | CallStart | CallArgs | CallEnd | CallFailed | CallCut


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def assemble(events: Iterable[Event]) -> tuple[str, list[ToolCall]]:
    """The content and the completed calls the events describe (a non-streamed reply)."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = ToolCall(e.id, e.name, "")
        elif isinstance(e, CallArgs):
            calls[e.index].arguments += e.text
        elif isinstance(e, CallFailed):
            del calls[e.index]
            content.append(e.text)
        elif isinstance(e, CallCut):
            del calls[e.index]
    return "".join(content), list(calls.values())


# --------------------------------------------------------------------- parsers


@dataclasses.dataclass(frozen=True)
class Function:
    """A function the request offers (OpenAI's `tools[i].function`)."""

    name: str
    parameters: dict[str, Any] = dataclasses.field(default_factory=lambda: {"type": "object"})


class ToolParser(abc.ABC):
    """One model family's tool-call format."""

    name: ClassVar[str]
    # Text the format is made of that a tokenizer may hold as special tokens: the
    # server decodes them (skip_special_tokens off) when one is.
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def stream(self, tool_names: Sequence[str]) -> CallStream:
        """A parser for one choice's text; calls to other functions than `tool_names`
        are not calls (they end in `CallFailed`)."""

    @abc.abstractmethod
    def grammar(self, functions: Sequence[Function], *, required: bool, parallel: bool) -> str:
        """A Lark grammar of this format's calls to `functions`, their arguments
        following each function's schema: calls only (`required`), or free text that
        may end in calls; more than one call only if `parallel`."""

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def special_markers(self) -> bool:
        """Whether the tokenizer holds one of the format's markers as a special token
        (which decoding skips unless told otherwise)."""
        return special_markers(self.tokenizer, self.markers)

    # ---------------------------------------------------------- grammar pieces

    def literal(self, text: str) -> str:
        return literal(self.tokenizer, text)

    def free_text_then(self, marker: str, rest: str) -> str:
        """`start:` any text without `marker`, or such text then `marker` then `rest`."""
        lit = self.literal(marker)
        pattern = _lark_regex(re.escape(marker))
        if lit.startswith("<["):  # one token, which free text cannot write; nor may it
            # spell the marker out in pieces (the parser would read an unchecked call)
            return (
                f"start: FREE | FREE? {lit} {rest}\nFREE: /(.|\\n)+/ & ~/(?s:.*){pattern}(?s:.*)/\n"
            )
        return (
            f"start: FREE | lead {rest}\n"
            f"FREE: /(.|\\n)*/ & ~/(?s:.*){pattern}(?s:.*)/\n"
            f"lead[lazy]: /(.|\\n)*{pattern}/\n"
        )


def marker_token(tokenizer: Tokenizer | None, text: str) -> int | None:
    """The token that is all of `text`, if the tokenizer has one (an added token, as
    chat formats' markers like `<tool_call>` or `</think>` often are)."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and len(text) > 1 else None


def literal(tokenizer: Tokenizer | None, text: str) -> str:
    """`text` in a grammar rule: its token by id if it is one token, else a string.
    llguidance takes every added token for a special one, which text never
    matches: a marker spelled as a string would have to be written in pieces."""
    i = marker_token(tokenizer, text)
    return json.dumps(text) if i is None else f"<[{i}]>"


def special_markers(tokenizer: Tokenizer | None, markers: Iterable[str]) -> bool:
    """Whether one of `markers` is a special token (decoding skips it by default)."""
    if tokenizer is None:
        return False
    special = set(tokenizer.all_special_ids)
    return any(marker_token(tokenizer, m) in special for m in markers)


# JSON in calls is written as json.dumps and Hugging Face's `tojson` write it (the
# form chat templates show the model): ", " and ": ", no other whitespace.
CALL_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def arguments_schema(fn: Function) -> str:
    """`%json {...}`: the function's parameters, written as CALL_JSON_OPTIONS says."""
    schema = copy.deepcopy(fn.parameters)
    # Arguments are an object (OpenAI's `parameters: {}` or a schema without a type
    # would let any JSON value through, which no parser takes for a call).
    schema.setdefault("type", "object")
    schema["x-guidance"] = {**CALL_JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps(schema)


def object_call(fn: Function, arguments_key: str) -> str:
    """A rule body: `{"name": "<name>", "<arguments_key>": <arguments>}`."""
    head = f'{{"name": {json.dumps(fn.name)}, {json.dumps(arguments_key)}: '
    return f'{json.dumps(head)} {arguments_schema(fn)} "}}"'


def alternatives(rule: str, bodies: Sequence[str]) -> str:
    return f"{rule}: " + "\n    | ".join(bodies) + "\n"


def repeated(rule: str, separator: str, parallel: bool) -> str:
    """`rule (separator rule)*`, or `rule` alone."""
    return f"{rule} ({json.dumps(separator)} {rule})*" if parallel else rule


def _lark_regex(pattern: str) -> str:
    return pattern.replace("/", "\\/")


# ---------------------------------------------------------------------- streams

ALPHANUMERIC = string.ascii_letters + string.digits
_WS = " \t\n\r"


class CallStream:
    """Text in, events out, for one choice; a format implements `_run`.

    `_pending` holds the text not yet turned into events; `_run` consumes it as far
    as it can decide (all of it when `final`). Content touching a call (whitespace
    before a call's marker, and after a call) is dropped.
    """

    def __init__(self, parser: ToolParser, tool_names: Sequence[str]):
        self._parser = parser
        self._names = frozenset(tool_names)
        self._pending = ""
        self._events: list[Event] = []
        self._next_index = 0
        self._after_call = False  # the last thing was a call: leading whitespace goes
        self._failed = False  # a call failed: everything from here on is content
        self._cut = False  # the reply was cut short in calls a grammar held (`finish`)
        self.gap = ""  # the whitespace before the last marker found (`_text_until`)
        self.completed = 0  # calls that ended well

    @property
    def failed(self) -> bool:
        """Whether a call failed (from there on everything was content)."""
        return self._failed

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        self._advance(final=False)
        return self._take()

    def finish(self, cut: bool = False) -> list[Event]:
        """The events of the reply's end; `cut`: max_tokens cut it short while a grammar
        held its calls, so a call it breaks off is a call cut short, not content."""
        self._cut = cut
        self._advance(final=True)
        return self._take()

    def _advance(self, final: bool) -> None:
        if self._failed:
            self._content(self._pending)
            self._pending = ""
        else:
            self._run(final)

    @abc.abstractmethod
    def _run(self, final: bool) -> None: ...

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------- helpers

    def _content(self, text: str) -> None:
        if text:
            self._events.append(Content(text))

    def _fail(self, call: ObjectCall | None, raw: str) -> None:
        """A call went wrong: its text `raw` and all that follows are content (cut
        short: dropped, the call ended by `CallCut` if it was sent)."""
        if self._cut:
            if call is not None and call.index is not None:
                self._events.append(CallCut(call.index))
            self._failed = True
            self._pending = ""
            return
        if call is not None and call.index is not None:
            self._events.append(CallFailed(call.index, raw))
        else:
            self._content(raw)
        self._failed = True
        self._content(self._pending)
        self._pending = ""

    def _text_until(self, marker: str, final: bool) -> bool:
        """Content up to `marker`: True once the marker is found (and consumed);
        False while text still arrives (what may begin the marker, and whitespace
        that may precede a call, waits)."""
        p = self._pending
        at = p.find(marker)
        if at >= 0:
            before = p[:at].rstrip(_WS)
            self._say(before)
            # (the whitespace before a call is not content; a call that then fails
            # gives it back with its own text, `gap`, unless a call just ended: the
            # whitespace between two calls is never content)
            self.gap = "" if self._after_call else p[len(before) : at]
            self._pending = p[at + len(marker) :]
            return True
        if final:
            if self._cut:  # a marker cut midway begins no content
                p = p[: len(p) - partial_suffix(p, marker)]
            self._say(p)
            self._pending = ""
            return False
        sure = p[: len(p) - partial_suffix(p, marker)].rstrip(_WS)
        self._say(sure)
        self._pending = p[len(sure) :]
        return False

    def _say(self, text: str) -> None:
        """Content, less its leading whitespace right after a call."""
        if self._after_call:
            text = text.lstrip(_WS)
        if text:
            self._content(text)
            self._after_call = False

    def _expect(self, literal: str, final: bool) -> bool | None:
        """After whitespace: `literal` (consumed: True), not it (False), or too early
        to say (None). At the end, the beginning of `literal` counts as it (a reply
        cut off there)."""
        p = self._pending.lstrip(_WS)
        if p.startswith(literal):
            self._pending = p[len(literal) :]
            return True
        if literal.startswith(p):
            if not final:
                return None
            self._pending = ""
            return True
        return False

    def _start_call(self, name: str) -> int | None:
        """Sends a call's start; None (nothing sent) if `name` is not an offered tool."""
        if self._names and name not in self._names:
            return None
        index = self._next_index
        self._next_index += 1
        self._events.append(CallStart(index, self._parser.new_call_id(), name))
        return index

    def _object_call(self, call: ObjectCall, final: bool) -> bool | None:
        """Feeds the pending text to `call`: True when it completed, None while it is
        still being written, False if it failed (everything after is content)."""
        if not call.json.text:
            call.raw += self._pending[: len(self._pending) - len(self._pending.lstrip(_WS))]
            self._pending = self._pending.lstrip(_WS)
        taken = call.json.feed(self._pending)
        call.raw += self._pending[:taken]
        self._pending = self._pending[taken:]
        problem = call.advance(self) or call.json.error  # (what is known is sent first)
        if problem is None and call.json.done:
            problem = call.complete(self)
            if problem is None:
                self._after_call = True
                self.completed += 1
                return True
        if problem is None and not final:
            return None
        self._fail(call, call.raw)
        return False


class ObjectCall:
    """A call written as one JSON object holding its name and arguments as members:
    `{"name": "f", "arguments": {...}}` (Hermes, Mistral) or with "parameters"
    (Llama 3). The name is sent as soon as it is known, the arguments as they grow."""

    def __init__(self, raw: str, argument_keys: Sequence[str] = ("arguments",)):
        self.raw = raw  # the call's text so far (its marker included)
        self.json = JsonObject()
        self.argument_keys = tuple(argument_keys)
        self.index: int | None = None
        self._sent = 0  # characters of the arguments sent

    def _member(self, key: str):
        for m in self.json.members:
            if m.key_end > 0 and json.loads(self.json.text[m.key_start : m.key_end]) == key:
                return m
        return None

    def _arguments(self):
        """The first member, in the text's order, whose key names the arguments (a
        Llama 3 call may carry both "arguments" and "parameters": the later one is
        ignored, so the fragments already sent stay a prefix of what is kept)."""
        keys = self.argument_keys
        for m in self.json.members:
            if m.key_end > 0 and json.loads(self.json.text[m.key_start : m.key_end]) in keys:
                return m
        return None

    def advance(self, stream: CallStream) -> str | None:
        """Sends what is newly known; returns a problem, if there is one."""
        text = self.json.text
        if self.index is None:
            m = self._member("name")
            if m is not None and m.value_start >= 0 and text[m.value_start] != '"':
                return "the name is not a string"
            if m is None or m.value_end is None:
                return self._check_arguments()
            self.index = stream._start_call(json.loads(text[m.value_start : m.value_end]))
            if self.index is None:
                return "not an offered function"
        problem = self._check_arguments()
        if problem is not None:
            return problem
        args = self._arguments()
        if args is not None and args.value_start >= 0:
            end = len(text) if args.value_end is None else args.value_end
            if end - args.value_start > self._sent:
                fragment = text[args.value_start + self._sent : end]
                stream._events.append(CallArgs(self.index, fragment))
                self._sent += len(fragment)
        return None

    def _check_arguments(self) -> str | None:
        args = self._arguments()
        if args is not None and args.value_start >= 0 and self.json.text[args.value_start] != "{":
            return "the arguments are not an object"
        return None

    def complete(self, stream: CallStream) -> str | None:
        """The object closed: the call is complete if it had a name."""
        if self.index is None:
            return "no name"
        if self._arguments() is None:  # a function without parameters, written without
            stream._events.append(CallArgs(self.index, "{}"))
        stream._events.append(CallEnd(self.index))
        return None


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (not all of it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
