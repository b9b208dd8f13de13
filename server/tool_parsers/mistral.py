"""Mistral calls after the `[TOOL_CALLS]` token, in either of Mistral's formats:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
        (tokenizers before v11: Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
        (v11 and later: Mistral Small 3.2, Magistral, Devstral; `[ARGS]` and
        `[CALL_ID]id` are special tokens, so without them the name runs into the `{`)

Mistral's chat templates take call ids of exactly 9 letters and digits.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence

from server.tool_parsers.base import (
    ALPHANUMERIC,
    CallArgs,
    CallEnd,
    CallStream,
    Function,
    ObjectCall,
    ToolParser,
    alternatives,
    arguments_schema,
    marker_token,
    object_call,
    repeated,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_WS = " \t\n\r"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def new_call_id(self) -> str:
        return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))

    def _v11(self) -> bool:
        """The tokenizer writes calls as name[ARGS]{...} (v11 and later)."""
        return marker_token(self.tokenizer, ARGS) is not None

    def stream(self, tool_names: Sequence[str]) -> CallStream:
        return _MistralStream(self, tool_names)

    def grammar(self, functions: Sequence[Function], *, required: bool, parallel: bool) -> str:
        marker = self.literal(TOOL_CALLS)
        if self._v11():
            args = self.literal(ARGS)
            bodies = [f"{json.dumps(f.name)} {args} {arguments_schema(f)}" for f in functions]
            rules = f"call: {marker} body\n" + alternatives("body", bodies)
            calls, rest = ("call+" if parallel else "call"), ("body call*" if parallel else "body")
        else:
            rules = alternatives("call", [object_call(f, "arguments") for f in functions])
            # The array follows the marker, maybe after a space (SentencePiece's "▁[").
            rest = f'" "? "[" {repeated("call", ", ", parallel)} "]"'
            calls = f"{marker} {rest}"
        if required:
            return f"start: {calls}\n" + rules
        return self.free_text_then(TOOL_CALLS, rest) + rules


class _MistralStream(CallStream):
    """States: text; after the marker ("open"); the array's calls ("array", "item",
    "between"); a v11 call's name and arguments ("name", "args")."""

    def __init__(self, parser: ToolParser, tool_names: Sequence[str]):
        super().__init__(parser, tool_names)
        self._state = "text"
        self._call: ObjectCall | None = None
        self._raw = ""  # a v11 call's text so far
        self._index: int | None = None

    def _run(self, final: bool) -> None:
        while not self._failed:
            state = self._state
            if state == "text":
                if not self._text_until(TOOL_CALLS, final):
                    return
                self._raw = self.gap + TOOL_CALLS
                self._state = "open"
            elif state == "open":  # "[" begins the array; else a v11 name
                p = self._pending.lstrip(_WS)
                if not p and not final:
                    return
                if p.startswith("["):
                    self._raw += self._pending[: len(self._pending) - len(p) + 1]
                    self._pending = p[1:]
                    self._state = "item"
                else:
                    self._state = "name"
            elif state == "item":
                if self._call is None:
                    self._call = ObjectCall(self._raw)
                if not self._object_call(self._call, final):
                    return
                self._call = None
                self._raw = ""
                self._state = "between"
            elif state == "between":  # ", " and another call, or "]"
                p = self._pending.lstrip(_WS)
                if not p and not final:
                    return
                if p.startswith(","):
                    self._raw = self._pending[: len(self._pending) - len(p) + 1]
                    self._pending = p[1:]
                    self._state = "item"
                    continue
                if p.startswith("]"):
                    p = p[1:]
                self._pending = p
                self._after_call = True
                self._state = "text"
            elif state == "name":
                if not self._name(final):
                    return
            else:  # "args"
                if not self._args(final):
                    return

    def _name(self, final: bool) -> bool:
        """A v11 call's name, up to `[ARGS]` (or `[CALL_ID]id[ARGS]`, or a bare `{`)."""
        p = self._pending.lstrip(_WS)
        i = _NAME.match(p).end()
        name = p[:i]
        if p.startswith(CALL_ID, i):
            i = _NAME.match(p, i + len(CALL_ID)).end()
        if p.startswith(ARGS, i):
            i += len(ARGS)
        rest = p[i:]
        undecided = not rest or any(m.startswith(rest) for m in (ARGS, CALL_ID))
        if undecided and not final:
            return False
        if not name or not rest.startswith("{"):
            raw, self._pending = self._raw + self._pending, ""
            self._fail(None, raw)
            return False
        self._raw += self._pending[: len(self._pending) - len(rest)]
        self._pending = rest
        self._index = self._start_call(name)
        if self._index is None:
            self._fail(None, self._raw)
            return False
        self._call = ObjectCall(self._raw)
        self._call.index = self._index
        self._state = "args"
        return True

    def _args(self, final: bool) -> bool:
        """A v11 call's arguments: one JSON object, sent as it grows."""
        call = self._call
        sent = len(call.json.text)
        taken = call.json.feed(self._pending)
        call.raw += self._pending[:taken]
        self._pending = self._pending[taken:]
        if len(call.json.text) > sent:
            self._events.append(CallArgs(self._index, call.json.text[sent:]))
        if call.json.done:
            self._events.append(CallEnd(self._index))
            self.completed += 1
            self._call = None
            self._after_call = True
            self._state = "text"
            return True
        if call.json.error is not None or final:
            self._fail(call, call.raw)
        return False
