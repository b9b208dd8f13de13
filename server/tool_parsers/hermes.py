"""Hermes-style calls (Qwen 2.5, Qwen 3, NousResearch Hermes): each call a JSON
object between tags, after any content.

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>
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
    repeated,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN, CLOSE)

    def stream(self, tool_names: Sequence[str]) -> CallStream:
        return _HermesStream(self, tool_names)

    def grammar(self, functions: Sequence[Function], *, required: bool, parallel: bool) -> str:
        rules = (
            f'call: {self.literal(OPEN)} "\\n" body "\\n" {self.literal(CLOSE)}\n'
            + alternatives("body", [object_call(f, "arguments") for f in functions])
        )
        calls = repeated("call", "\n", parallel)
        if required:
            return f"start: {calls}\n" + rules
        # The opening tag ends the free text; the first call goes on from there.
        first = f'"\\n" body "\\n" {self.literal(CLOSE)}' + (' ("\\n" call)*' if parallel else "")
        return self.free_text_then(OPEN, first) + rules


class _HermesStream(CallStream):
    def __init__(self, parser: ToolParser, tool_names: Sequence[str]):
        super().__init__(parser, tool_names)
        self._state = "text"
        self._call: ObjectCall | None = None

    def _run(self, final: bool) -> None:
        while not self._failed:
            if self._state == "text":
                if not self._text_until(OPEN, final):
                    return
                self._call = ObjectCall(self.gap + OPEN)
                self._state = "call"
            elif self._state == "call":
                done = self._object_call(self._call, final)
                if not done:  # still being written, or failed
                    return
                self._state = "close"
            else:  # after a call: its closing tag (a missing one is forgiven)
                closed = self._expect(CLOSE, final)
                if closed is None:
                    return
                self._state = "text"
