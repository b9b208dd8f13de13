"""Reading chat replies: reasoning apart from the answer (`--reasoning_parser`), tool
calls out of the answer (`--tool_call_parser`), and the grammars that make calls
parse.

`ChatReading` is one request's plan: which functions it may call and how
(`tool_choice`), the constraint its sampling gets (a tool-call grammar in the
model's own format for `required`, a named function, or `auto` with
`--tool_call_constrained`; any constraint held off until the reasoning ends), and
a `ChoiceReader` per choice, which turns text into events: `Reasoning`,
`Content`, and the tool parsers' call events. `message` and `delta` write those
events as OpenAI's message and streamed delta; both come from the same events, so
a streamed reply reassembles to the non-streamed one (but for a call that failed
or was cut short: the stream had sent its beginning).

OpenAI's `response_format` is the format of the answer, not of the calls: a
forced call (required, named) replaces it for the turn, and under `auto` the
reply is calls or an answer in the format (the grammars' alternation), as OpenAI
serves an agent with tools and an output type. vLLM's `structured_outputs` and
`guided_*` constrain the whole reply: with calls a grammar holds they conflict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.structured import either, to_grammar
from jaxserve.tokenizer import Tokenizer
from server import reasoning_parsers, tool_parsers
from server.openai_api.protocol import BadField, ChatCompletionRequest
from server.reasoning_parsers import Reasoning, ReasoningStream
from server.tool_parsers import (
    CallArgs,
    CallFailed,
    CallStart,
    CallStream,
    Content,
    Function,
    assemble,
)


@dataclasses.dataclass(frozen=True)
class ChatParsers:
    """The server's choice of parsers (`--tool_call_parser`, `--tool_call_constrained`,
    `--reasoning_parser`); None: not parsed."""

    tool_call_parser: str | None = None
    tool_call_constrained: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self):
        for name, known in (
            (self.tool_call_parser, tool_parsers.PARSERS),
            (self.reasoning_parser, reasoning_parsers.PARSERS),
        ):
            if name is not None and name not in known:
                raise ValueError(f"unknown parser {name!r}; known: {sorted(known)}")
        if self.tool_call_constrained and self.tool_call_parser is None:
            raise ValueError("tool_call_constrained needs a tool_call_parser")


class ChatReading:
    """How one chat completion's replies are constrained and read."""

    def __init__(
        self,
        parsers: ChatParsers,
        tokenizer: Tokenizer | None,
        mode: str,
        functions: list[Function],
        parallel: bool,
    ):
        self.mode, self.functions = mode, functions
        self.parallel = parallel and self.mode != "named"
        self.tools = None
        if self.mode != "none":
            if parsers.tool_call_parser is None:
                raise BadField(
                    "tools",
                    "this server does not parse tool calls: start it with --tool_call_parser "
                    f"({', '.join(sorted(tool_parsers.PARSERS))}), or send tool_choice 'none'",
                )
            self.tools = tool_parsers.PARSERS[parsers.tool_call_parser](tokenizer)
        self.reasoning = None
        if parsers.reasoning_parser is not None:
            self.reasoning = reasoning_parsers.PARSERS[parsers.reasoning_parser](tokenizer)
        # Whether a grammar holds the reply's calls (`sampling_params` adds auto with an
        # answer format): then a call cut by max_tokens is no content.
        self.constrain_calls = self.mode in ("required", "named") or (
            self.mode == "auto" and parsers.tool_call_constrained
        )
        self.prompt: str | None = None

    @classmethod
    def of(
        cls, parsers: ChatParsers, tokenizer: Tokenizer | None, body: ChatCompletionRequest
    ) -> ChatReading:
        mode, functions = body.tool_choice_mode()
        return cls(parsers, tokenizer, mode, functions, body.parallel_tool_calls)

    def sampling_params(
        self,
        params: SamplingParams,
        prompt: str | None,
        constraint_name: str,
        *,
        answer_format: bool = False,
    ) -> SamplingParams:
        """`params` as this reading needs them: the call grammar, the request's own
        constraint, or their alternation, applied after the reasoning; special tokens
        decoded where the parsers' markers are special tokens. `prompt` is the
        rendered chat; `answer_format`: the request's constraint is the answer's
        format (OpenAI's response_format), not the whole reply's."""
        self.prompt = prompt
        spec = params.structured_outputs
        grammar = None
        if spec is not None and answer_format and self.mode != "none":
            calls = self._call_grammar(required=True)
            if self.mode == "auto":  # calls, or the answer in its format
                grammar = either(calls, _checked(spec, constraint_name))
            else:  # a forced call: the format is for another turn's answer
                grammar = calls
            self.constrain_calls = True
        elif self.constrain_calls:
            if spec is not None:
                raise BadField(
                    constraint_name,
                    f"{constraint_name} cannot be combined with tool_choice {self.mode!r}, "
                    "which constrains the reply to tool calls",
                )
            grammar = self._call_grammar(required=self.mode != "auto")
        elif spec is not None and self.reasoning is not None:
            grammar = _checked(spec, constraint_name)
        if grammar is not None and self.reasoning is not None:
            grammar = self.reasoning.then(grammar, prompt)
        if grammar is not None:
            spec = StructuredOutputsParams(grammar=grammar)
        special = any(p is not None and p.special_markers() for p in (self.tools, self.reasoning))
        return dataclasses.replace(
            params,
            structured_outputs=spec,
            skip_special_tokens=params.skip_special_tokens and not special,
        )

    def _call_grammar(self, required: bool) -> str:
        """The llguidance grammar of the calls to the functions (`required`: calls only,
        else text that may end in calls)."""
        lark = self.tools.grammar(self.functions, required=required, parallel=self.parallel)
        try:
            return to_grammar(StructuredOutputsParams(grammar=lark))
        except ValueError as e:
            raise BadField(
                "tools", f"tools: a function's parameters cannot be followed: {e}"
            ) from None

    def choice(self) -> ChoiceReader | None:
        """A reader for one choice's text; None if the text is all content."""
        if self.tools is None and self.reasoning is None:
            return None
        return ChoiceReader(
            None if self.reasoning is None else self.reasoning.stream(self.prompt),
            None if self.tools is None else self.tools.stream([f.name for f in self.functions]),
            constrained=self.tools is not None and self.constrain_calls,
        )


def _checked(spec: StructuredOutputsParams, constraint_name: str) -> str:
    """The grammar of the request's own constraint; BadField naming it if invalid."""
    try:
        return to_grammar(spec)
    except ValueError as e:
        raise BadField(constraint_name, str(e)) from None


class ChoiceReader:
    """One choice's text through the reasoning parser, then its answer through the
    tool-call parser; `constrained`: a grammar held the calls."""

    def __init__(
        self,
        reasoning: ReasoningStream | None,
        calls: CallStream | None,
        *,
        constrained: bool = False,
    ):
        self.reasoning = reasoning
        self.calls = calls
        self.constrained = constrained

    def feed(self, text: str) -> list:
        if not text:
            return []
        return self._answer(self.reasoning.feed(text) if self.reasoning else [Content(text)])

    def finish(self, reason: str | None = None) -> list:
        """The events of the reply's end; `reason` is the engine's finish reason: cut by
        max_tokens ("length") in calls a grammar held, a call is cut short, its text
        no content (`CallStream.finish`)."""
        events = self._answer(self.reasoning.finish()) if self.reasoning else []
        cut = self.constrained and reason == "length"
        return events + (self.calls.finish(cut=cut) if self.calls else [])

    def step(self, delta: str, reason: str | None) -> list:
        """The events of one streamed delta; the one with the engine's finish reason
        (the reply's last) ends it."""
        events = self.feed(delta)
        return events + self.finish(reason) if reason is not None else events

    def read(self, text: str, reason: str | None = None) -> list:
        """The events of a whole reply that ended for `reason`."""
        return self.feed(text) + self.finish(reason)

    def _answer(self, events: Sequence) -> list:
        if self.calls is None:
            return list(events)
        out = []
        for e in events:
            out += self.calls.feed(e.text) if isinstance(e, Content) else [e]
        return out

    @property
    def called(self) -> bool:
        """Whether the reply is calls: one completed and none failed (a stream has sent
        a failed call's beginning, which no client can parse as a call)."""
        return self.calls is not None and self.calls.completed > 0 and not self.calls.failed


def finish_reason(reason: str | None, reader: ChoiceReader | None) -> str | None:
    """ "tool_calls" for a reply that stopped after calling; else the engine's reason."""
    if reason == "stop" and reader is not None and reader.called:
        return "tool_calls"
    return reason


def message(events: Sequence, *, reasoning: bool) -> dict[str, Any]:
    """OpenAI's assistant message of a whole reply's events."""
    thought = "".join(e.text for e in events if isinstance(e, Reasoning))
    content, calls = assemble(e for e in events if not isinstance(e, Reasoning))
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        out["reasoning_content"] = thought or None
    if calls:
        out["content"] = content or None
        out["tool_calls"] = [c.to_openai() for c in calls]
    return out


def delta(events: Sequence) -> dict[str, Any]:
    """OpenAI's streamed delta of some events: a call's first entry carries its index,
    id and name; later ones, fragments of its arguments. A failed call's text comes
    as content (the stream cannot take back what it sent of the call)."""
    out: dict[str, Any] = {}
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Reasoning):
            out["reasoning_content"] = out.get("reasoning_content", "") + e.text
        elif isinstance(e, Content | CallFailed):
            out["content"] = out.get("content", "") + e.text
        elif isinstance(e, CallStart):
            function = {"name": e.name, "arguments": ""}
            calls.append({"index": e.index, "id": e.id, "type": "function", "function": function})
        elif isinstance(e, CallArgs):
            if calls and calls[-1]["index"] == e.index:
                calls[-1]["function"]["arguments"] += e.text
            else:
                calls.append({"index": e.index, "function": {"arguments": e.text}})
    if calls:
        out["tool_calls"] = calls
    return out
