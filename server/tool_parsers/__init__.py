"""Tool-call parsers, one module per format (`--tool_call_parser`): a new format is
one file defining a `ToolParser` and an entry here."""

from server.tool_parsers.base import (
    CallArgs,
    CallCut,
    CallEnd,
    CallFailed,
    CallStart,
    CallStream,
    Content,
    Event,
    Function,
    ToolCall,
    ToolParser,
    assemble,
)
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.llama3_json import Llama3JsonParser
from server.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}

__all__ = [
    "PARSERS",
    "CallArgs",
    "CallCut",
    "CallEnd",
    "CallFailed",
    "CallStart",
    "CallStream",
    "Content",
    "Event",
    "Function",
    "ToolCall",
    "ToolParser",
    "assemble",
]
