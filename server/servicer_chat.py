"""Tool calls and reasoning on gRPC: a GenerateRequest's chat (its tools, earlier
calls and tool results) for the chat template, and its reply read by the same
parsers as the HTTP API's (`openai_api.chat_output.ChatReading`) into the
messages' `content`, `reasoning` and `tool_calls` fields.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jaxserve.tokenizer import Tokenizer
from server import jaxserve_pb2 as pb
from server.openai_api import chat_output
from server.openai_api.chat_output import ChatParsers, ChatReading
from server.openai_api.protocol import CHAT_ROLES, BadField, tool_choice_mode
from server.reasoning_parsers import Reasoning
from server.tool_parsers import assemble


def messages(msg: pb.ChatMessages) -> list[dict[str, Any]]:
    """The messages as chat templates read them (earlier calls' arguments as objects).
    Raises BadField for a role OpenAI's chat has not, as the HTTP API does."""
    out = []
    for i, m in enumerate(msg.messages):
        if m.role not in CHAT_ROLES:
            raise BadField(
                f"messages[{i}].role", f"role must be one of {CHAT_ROLES}, got {m.role!r}"
            )
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        for key in ("tool_call_id", "reasoning", "name"):
            if getattr(m, key):
                entry["reasoning_content" if key == "reasoning" else key] = getattr(m, key)
        if m.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _object(c.arguments)},
                }
                for c in m.tool_calls
            ]
        out.append(entry)
    return out


def _object(arguments: str) -> Any:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_kwargs(request: pb.GenerateRequest) -> dict[str, Any]:
    """The chat template's arguments: `chat_template_kwargs`, and the tools."""
    kwargs: dict[str, Any] = {}
    if request.chat_template_kwargs:
        try:
            kwargs = json.loads(request.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise BadField("chat_template_kwargs", f"chat_template_kwargs: not JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise BadField("chat_template_kwargs", "chat_template_kwargs must be a JSON object")
    if request.tools:
        kwargs["tools"] = [
            {"type": "function", "function": function}
            for function, _ in zip(_functions(request), request.tools, strict=True)
        ]
    return kwargs


def _functions(request: pb.GenerateRequest) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(request.tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                function["parameters"] = json.loads(tool.parameters)
            except json.JSONDecodeError as e:
                raise BadField(f"tools[{i}].parameters", f"not JSON: {e}") from None
            if not isinstance(function["parameters"], dict):
                raise BadField(f"tools[{i}].parameters", "parameters must be a JSON schema object")
        out.append(function)
    return out


def reading(
    parsers: ChatParsers, tokenizer: Tokenizer | None, request: pb.GenerateRequest
) -> ChatReading | None:
    """How the request's reply is constrained and read; None for a prompt that is not
    a chat (tools then are refused)."""
    chat = request.WhichOneof("input") == "messages"
    if not chat:
        if request.tools or request.HasField("tool_choice") or request.chat_template_kwargs:
            field = "tools" if request.tools else "tool_choice"
            if request.chat_template_kwargs and not request.tools:
                field = "chat_template_kwargs"
            raise BadField(field, f"{field} needs messages input (a chat)")
        return None
    choice = request.tool_choice
    kind = choice.WhichOneof("kind") if request.HasField("tool_choice") else None
    mode, functions = tool_choice_mode(
        [(f["name"], f.get("parameters")) for f in _functions(request)],
        getattr(choice, kind) if kind else None,
        named=kind == "function",
        name_field=lambda i: f"tools[{i}].name",
    )
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ChatReading(parsers, tokenizer, mode, functions, parallel)


def set_delta(msg: pb.GenerateResponse, events: Sequence) -> None:
    """A streamed message's share of the reply: content, reasoning, pieces of calls."""
    delta = chat_output.delta(events)
    msg.content = delta.get("content", "")
    msg.reasoning = delta.get("reasoning_content", "")
    for call in delta.get("tool_calls", ()):
        function = call["function"]
        msg.tool_calls.append(
            pb.ToolCall(
                index=call["index"],
                id=call.get("id", ""),
                name=function.get("name", ""),
                arguments=function["arguments"],
            )
        )


def set_whole(comp: pb.Completion, events: Sequence) -> None:
    """A whole reply: content, reasoning, and the completed calls."""
    comp.reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content, calls = assemble(e for e in events if not isinstance(e, Reasoning))
    comp.content = content
    for i, call in enumerate(calls):
        comp.tool_calls.append(
            pb.ToolCall(index=i, id=call.id, name=call.name, arguments=call.arguments)
        )
