"""The Responses API's request body (`POST /v1/responses`), read as a chat completion.

A Responses request is a chat completion in another shape: `instructions` is a
system message, `input` the conversation (a string, or items: messages,
`function_call` items the model made and `function_call_output` items the client
answers them with), `tools` are function tools written flat, `text.format` is
`response_format`. `ResponsesRequest.chat` turns it into a `ChatCompletionRequest`,
so that prompts render, tools constrain and replies are read by the chat path's
code (`chat_output.ChatReading`); `chat_param` names a chat field's error by the
Responses field the client sent. The server is stateless: `previous_response_id`,
`store: true`, `conversation` and `background: true` are refused.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.generate_request import client_fields
from server.openai_api.protocol import (
    BadField,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    ClientFields,
    FunctionDefinition,
    JsonSchema,
    MessageFunctionCall,
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    ToolChoiceFunction,
)

# Roles of input messages, and the chat roles they render as.
_ROLES = ("user", "assistant", "system", "developer")


class FunctionTool(BaseModel):
    """A Responses function tool: flat, unlike chat's `{"type", "function": {...}}`."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: text, json_object, or json_schema (its name and schema inline)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ResponsesRequest(ClientFields):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # effort/summary: the model reasons as it does
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused: this server keeps no state between requests.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    # vLLM's extra fields, as in chat completions.
    seed: int | None = None
    top_k: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise BadField(
                "previous_response_id",
                "previous_response_id is not supported: this server stores no responses; "
                "send the whole conversation as input",
            )
        if self.store:
            raise BadField(
                "store", "store must be false: this server stores no responses (it is stateless)"
            )
        if self.conversation is not None:
            raise BadField(
                "conversation", "conversation is not supported: this server stores no state"
            )
        if self.background:
            raise BadField("background", "background responses are not supported")

    def chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion."""
        self.check_unsupported()
        messages = []
        if self.instructions:
            messages.append(ChatMessage(role="system", content=self.instructions))
        messages += input_messages(self.input)
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
        tools = None
        if self.tools is not None:
            tools = [
                ChatTool(
                    type="function",
                    function=FunctionDefinition(
                        name=t.name,
                        description=t.description,
                        parameters=t.parameters,
                        strict=t.strict,
                    ),
                )
                for t in self.tools
            ]
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if fmt is not None and fmt.type != "text":
            schema = None
            if fmt.type == "json_schema":
                if fmt.schema_ is None:
                    raise BadField("text.format.schema", "text.format json_schema needs a schema")
                schema = JsonSchema(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
            response_format = ResponseFormat(type=fmt.type, json_schema=schema)
        extra = {k: getattr(self, k) for k in ("seed", "top_k") if getattr(self, k) is not None}
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format,
            chat_template_kwargs=self.chat_template_kwargs,
            **client_fields(self),
            **extra,
        )


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """`input` as chat messages: consecutive `function_call` items are one assistant
    message's tool calls (joining the assistant message before them), and each
    `function_call_output` a tool message; a `reasoning` item is the next assistant
    message's reasoning_content."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise BadField("input", "input must not be empty")
    out: list[ChatMessage] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise BadField(
                    f"input[{i}].role", f"role must be one of {list(_ROLES)}, got {role!r}"
                )
            message = ChatMessage(role=role, content=_text(item.get("content"), i))
            if role == "assistant" and reasoning is not None:
                message.reasoning_content, reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            call = MessageToolCall(
                id=_string(item, "call_id", i),
                function=MessageFunctionCall(
                    name=_string(item, "name", i), arguments=_string(item, "arguments", i)
                ),
            )
            last = out[-1] if out else None
            if last is None or last.role != "assistant":
                last = ChatMessage(role="assistant", content=None, reasoning_content=reasoning)
                reasoning = None
                out.append(last)
            last.tool_calls = [*(last.tool_calls or ()), call]
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text(output, i, "output") if isinstance(output, list) else None
            if output is None:
                raise BadField(f"input[{i}].output", "a function_call_output needs its output")
            out.append(
                ChatMessage(role="tool", tool_call_id=_string(item, "call_id", i), content=output)
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise BadField(
                f"input[{i}].type",
                "input items may be message, function_call, function_call_output or "
                f"reasoning; got {kind!r}",
            )
    return out


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, i: int, field: str = "content") -> str:
    """A message's content: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadField(f"input[{i}].{field}", f"{field} must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else part
            raise BadField(
                f"input[{i}].{field}[{j}]", f"only text content parts are supported, got {kind!r}"
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadField(f"input[{i}].{key}", f"a {item.get('type')} item needs {key} (a string)")
    return value


# Chat fields (as ChatCompletionRequest and ChatReading name them) -> Responses fields.
_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema": "text.format.schema",
    "messages": "input",
}
_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.")


def chat_param(param: str | None) -> str | None:
    """A chat completion's field name for an error as the Responses field."""
    if param is None:
        return None
    if param in _RENAMED:
        return _RENAMED[param]
    return _TOOL_FIELD.sub(r"tools[\1].", param)
