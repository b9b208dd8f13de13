"""Reasoning parsers (`--reasoning_parser`): a reasoning model's thinking, written
between `<think>` and `</think>`, apart from its answer.

- `deepseek_r1`: the reply begins inside the reasoning (DeepSeek-R1's chat template
  opens `<think>` itself; a `<think>` the model writes anyway is dropped), which
  runs to `</think>`; a reply without `</think>` is all reasoning.
- `qwen3`: the reply reasons only if it begins with `<think>`, or if the prompt left
  a `<think>` open (Qwen3's thinking-only models); otherwise it is all answer
  (Qwen3 with `enable_thinking: false`, whose template closes an empty block).

The answer is what follows `</think>`, less the whitespace that begins it. A
`ReasoningStream` splits a reply as it arrives; its events (`Reasoning`, and
`Content` for the answer) do not depend on how the text was cut into pieces.

`then` constrains only the answer: the grammar it returns lets the reasoning be
any text up to `</think>`, then holds the answer to the given grammar (structured
output, or a tool-call format).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxserve import structured
from jaxserve.tokenizer import Tokenizer
from server.tool_parsers.base import Content, literal, partial_suffix, special_markers

OPEN, CLOSE = "<think>", "</think>"
_WS = " \t\n\r"


@dataclasses.dataclass(frozen=True)
class Reasoning:
    text: str


class ReasoningParser:
    name: ClassVar[str]
    # Whether every reply begins inside the reasoning (else: only one that opens it,
    # or after a prompt that left it open).
    always_inside: ClassVar[bool]
    markers = (OPEN, CLOSE)

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    def starts_inside(self, prompt: str | None) -> bool:
        """Whether a reply to `prompt` begins inside the reasoning."""
        if self.always_inside:
            return True
        return prompt is not None and prompt.rfind(OPEN) > prompt.rfind(CLOSE)

    def stream(self, prompt: str | None) -> ReasoningStream:
        return ReasoningStream(self.starts_inside(prompt))

    def special_markers(self) -> bool:
        return special_markers(self.tokenizer, self.markers)

    def then(self, grammar: str, prompt: str | None) -> str:
        """A grammar of a reply whose answer follows `grammar` (an llguidance grammar)
        and whose reasoning, before it, is free."""
        close = literal(self.tokenizer, CLOSE)
        if close.startswith("<["):  # one token, which free text cannot write
            thinking = f"THINKING {close}"
            rules = "THINKING: /(.|\\n)*/\n"
        else:  # text up to the first "</think>"
            thinking = "thinking"
            rules = "thinking[lazy]: /(.|\\n)*<\\/think>/\n"
        # A little whitespace may end the reasoning (Qwen3 writes "\n\n"); unbounded, a
        # sampling model could write it until max_tokens.
        rules += "WS: /[ \\t\\r\\n]{1,4}/\n"
        open_ = literal(self.tokenizer, OPEN)
        if self.starts_inside(prompt):  # (a template that did not open it: the reply may)
            prefix = f"({open_})? {thinking} WS?"
        else:
            prefix = f"({open_} {thinking} WS?)?"
        return structured.then(prefix, grammar, rules)


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    always_inside = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    always_inside = False


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


class ReasoningStream:
    """Splits one reply into reasoning and answer as its text arrives.

    States: "start" (has the reply opened `<think>`?), "inside" (reasoning, up to
    `</think>`), "answer" (its leading whitespace is dropped), "content".
    """

    def __init__(self, inside: bool):
        self._inside = inside
        self._state = "start"
        self._pending = ""
        self._events: list[Reasoning | Content] = []

    def feed(self, text: str) -> list[Reasoning | Content]:
        self._pending += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Reasoning | Content]:
        self._run(final=True)
        return self._take()

    def _take(self) -> list[Reasoning | Content]:
        events, self._events = self._events, []
        return events

    def _emit(self, kind: type[Reasoning] | type[Content], text: str) -> None:
        if text:
            self._events.append(kind(text))

    def _run(self, final: bool) -> None:
        while True:
            p = self._pending
            if self._state == "start":
                head = p.lstrip(_WS)
                if head.startswith(OPEN):
                    self._pending = head[len(OPEN) :]
                    self._state = "inside"
                    continue
                if OPEN.startswith(head) and not final:
                    return  # nothing yet, or the beginning of "<think>"
                self._state = "inside" if self._inside else "content"
            elif self._state == "inside":
                at = p.find(CLOSE)
                if at >= 0:
                    self._emit(Reasoning, p[:at])
                    self._pending = p[at + len(CLOSE) :]
                    self._state = "answer"
                    continue
                keep = 0 if final else partial_suffix(p, CLOSE)
                self._emit(Reasoning, p[: len(p) - keep])
                self._pending = p[len(p) - keep :]
                return
            elif self._state == "answer":
                self._pending = p.lstrip(_WS)
                if not self._pending:
                    return
                self._state = "content"
            else:
                self._emit(Content, p)
                self._pending = ""
                return
