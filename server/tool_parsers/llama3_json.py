"""Llama 3.1 / 3.2 / 3.3 JSON-based calls: the whole reply is the call, a JSON object
with the function's name and its "parameters" (Meta's documented format; some
fine-tunes write "arguments"), maybe after the `<|python_tag|>` token; several
calls are separated by "; ".

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

A reply that does not begin with `{` (after whitespace and the tag) is content.
"""

from __future__ import annotations

from collections.abc import Sequence

from server.tool_parsers.base import (
    CallStream,
    Function,
    ObjectCall,
    ToolParser,
    alternatives,
    object_call,
    partial_suffix,
    repeated,
)

PYTHON_TAG = "<|python_tag|>"
_WS = " \t\n\r"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def stream(self, tool_names: Sequence[str]) -> CallStream:
        return _Llama3Stream(self, tool_names)

    def grammar(self, functions: Sequence[Function], *, required: bool, parallel: bool) -> str:
        rules = alternatives("call", [object_call(f, "parameters") for f in functions])
        calls = repeated("call", "; ", parallel)
        if required:
            return f"start: {calls}\n" + rules
        # Content is anything that does not begin as a call does.
        return f"start: TEXT | {calls}\nTEXT: /[^{{\\s](.|\\n)*/\n" + rules


class _Llama3Stream(CallStream):
    def __init__(self, parser: ToolParser, tool_names: Sequence[str]):
        super().__init__(parser, tool_names)
        self._state = "start"
        self._call: ObjectCall | None = None

    def _run(self, final: bool) -> None:
        while not self._failed:
            if self._state == "content":
                self._content(self._pending)
                self._pending = ""
                return
            if self._call is None:  # the reply's start, or after a call
                p = self._pending.lstrip(_WS)
                if self._state == "start" and p.startswith(PYTHON_TAG):
                    p = p[len(PYTHON_TAG) :].lstrip(_WS)
                elif self._state == "start" and partial_suffix(p, PYTHON_TAG) == len(p) > 0:
                    p = ""  # maybe the tag: wait
                elif self._state == "next" and p.startswith(";"):
                    p = p[1:].lstrip(_WS)
                if not p and not final:
                    return
                if not p and self._cut:  # cut after the tag or a "; ": no content
                    self._pending = ""
                    return
                if not p.startswith("{"):  # not a call: the rest is content
                    if self._state == "next":
                        self._pending = self._pending.lstrip(_WS)
                    self._state = "content"
                    continue
                raw = self._pending[: len(self._pending) - len(p)]
                self._call = ObjectCall(raw, argument_keys=("parameters", "arguments"))
                self._pending = p
            if not self._object_call(self._call, final):
                return
            self._call = None
            self._state = "next"
