"""The OpenAI API's request bodies (with vLLM's extra fields), and their SamplingParams.

Pydantic checks the JSON types; the values are checked where they are for every
front end (`SamplingParams`, `LLMEngine.validate`), so the HTTP API refuses what
gRPC refuses, with the same messages. Fields this server does not implement are
refused when set, not silently ignored. Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from jaxserve.generate_request import client_field_types
from jaxserve.sampling_params import (
    FIELDS,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)
from server.tool_parsers import Function

# SamplingParams fields the OpenAI API names or shapes otherwise (`sampling_params`).
_CONVERTED = frozenset({"max_tokens", "logprobs", "logit_bias", "structured_outputs"})
# Not a field of these requests: echo with logprobs asks for the prompt's; their replies
# are text (token ids without it: `/inference/v1/generate`, `server.openai_api.tokens`).
_NOT_CARRIED = frozenset({"prompt_logprobs", "detokenize"})


class BadField(ValueError):
    """A request field the server refuses; `param` names it as the client sent it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: exactly one constraint."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# The fields of GenerateRequest a client sets (`jaxserve.generate_request.CLIENT_FIELDS`:
# priority, cache_salt), with their types and defaults, in every request body.
ClientFields = create_model("ClientFields", **client_field_types())


class _Request(ClientFields):
    """The fields completions and chat completions share."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit null for a field that cannot be null is the field left unset, as
        OpenAI reads it (clients send `"n": null`, `"stream": null`): its default, not a
        400. A nullable field keeps its null (completions' `max_tokens: null`: no cap)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or type(None) in get_args(fields[k].annotation)
        }

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # adds prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool = False  # logprobs tokens as "token_id:N"
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def beam_search(self, params: SamplingParams) -> BeamSearchParams | None:
        """The request's beam search, if it asks for one (completions only)."""
        return None

    def _max_tokens(self) -> tuple[int | None, str]:
        raise NotImplementedError

    def _logprobs(self) -> tuple[int | None, str]:
        raise NotImplementedError

    def sampling_params(self) -> tuple[SamplingParams, dict[str, str]]:
        """The request's validated SamplingParams, and the request's name for each of
        its fields whose name differs (for errors: `param`).

        Every `SamplingParams` field is taken from the attribute of the same name,
        except those in `_CONVERTED` (another name, or another shape, in the OpenAI
        API) and `_NOT_CARRIED`; `test_http.py` checks that this covers them all.
        """
        max_tokens, max_tokens_name = self._max_tokens()
        logprobs, logprobs_name = self._logprobs()
        constraint, constraint_name = self._structured_outputs()
        names = {
            "max_tokens": max_tokens_name,
            "logprobs": logprobs_name,
            "structured_outputs": constraint_name,
        }
        kw = {
            f: getattr(self, f)
            for f in FIELDS
            if f not in _CONVERTED and f not in _NOT_CARRIED and getattr(self, f) is not None
        }
        kw.update(
            max_tokens=max_tokens,
            logprobs=logprobs,
            logit_bias=_logit_bias(self.logit_bias),
            structured_outputs=constraint,
        )
        try:
            params = SamplingParams(**kw)
        except ValueError as e:
            field = getattr(e, "field", None)
            raise BadField(names.get(field, field), str(e)) from None
        return params, names

    def _structured_outputs(self) -> tuple[StructuredOutputsParams | None, str]:
        """One constraint from response_format, structured_outputs or guided_*."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise BadField(
                    "response_format.json_schema",
                    "response_format of type json_schema needs json_schema.schema",
                )
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            so = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            if so.get("json_object") is False:
                del so["json_object"]
            given.append(("structured_outputs", so))
        for field in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{field}")
            if value is not None:
                given.append((f"guided_{field}", {field: value}))
        if not given:
            return None, "structured_outputs"
        if len(given) > 1:
            names = [name for name, _ in given]
            raise BadField(names[1], f"give one output constraint, got {names}")
        name, kw = given[0]
        try:
            return StructuredOutputsParams(**kw), name
        except ValueError as e:
            raise BadField(name, f"{name}: {e}") from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise BadField(
                "logit_bias", f"logit_bias keys must be token ids, got {key!r}"
            ) from None
    return out


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's beam search fields: best_of (else n) beams, the n best returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @property
    def scores_prompt(self) -> bool:
        """echo with max_tokens 0: the legacy way of scoring a prompt (its text and
        logprobs back, nothing generated). The engine computes one token, which the
        reply leaves out."""
        return self.echo and self.max_tokens == 0

    def _max_tokens(self):
        if self.scores_prompt:
            if self.stream:
                raise BadField("max_tokens", "max_tokens 0 (scoring the prompt) is not streamed")
            return 1, "max_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self):
        return self.logprobs, "logprobs"

    def prompts(self) -> list[dict[str, Any]]:
        """The prompts, each in `parse_prompt`'s shape (a batch of text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if not p:
            raise BadField("prompt", "prompt must not be empty")
        if isinstance(p[0], int):
            return [{"prompt_token_ids": p}]
        if isinstance(p[0], str):
            return [{"prompt": text} for text in p]
        return [{"prompt_token_ids": ids} for ids in p]

    def check_unsupported(self) -> None:
        if self.suffix:
            raise BadField("suffix", "suffix is not supported")
        if self.use_beam_search:
            if self.best_of is not None and self.best_of < self.n:
                raise BadField("best_of", f"best_of must be >= n ({self.n}), got {self.best_of}")
        elif self.best_of is not None and self.best_of != self.n:
            raise BadField(
                "best_of",
                f"best_of must equal n ({self.n}) without use_beam_search, got {self.best_of}",
            )

    def sampling_params(self) -> tuple[SamplingParams, dict[str, str]]:
        params, names = super().sampling_params()
        if self.use_beam_search:  # the engine's names for what the request calls these
            names.update(beam_width="n" if self.best_of is None else "best_of")
            names.update(beam="use_beam_search")
        return params, names

    def beam_search(self, params: SamplingParams) -> BeamSearchParams | None:
        if not self.use_beam_search:
            return None
        if params.max_tokens is None:
            raise BadField("max_tokens", "use_beam_search needs max_tokens")
        width = "n" if self.best_of is None else "best_of"
        try:
            return BeamSearchParams(
                beam_width=self.n if self.best_of is None else self.best_of,
                max_tokens=params.max_tokens,
                ignore_eos=self.ignore_eos,
                temperature=self.temperature or 0.0,
                length_penalty=self.length_penalty,
                include_stop_str_in_output=self.include_stop_str_in_output,
                early_stopping=self.early_stopping,
            )
        except ValueError as e:
            field = getattr(e, "field", None)
            raise BadField(width if field == "beam_width" else field, str(e)) from None


# The roles of OpenAI's chat messages ("function": its deprecated tool role).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# OpenAI's rule for a function's name.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class MessageFunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI), or already an object


class MessageToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates read them (Hugging Face's convention): text
    content, and each earlier call's arguments as an object, not JSON text."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise BadField(
                f"messages[{i}].role", f"role must be one of {CHAT_ROLES}, got {m.role!r}"
            )
        content = m.content
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadField(
                        f"messages[{i}].content[{j}]",
                        f"only text content parts are supported, got {part.get('type')!r}",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": m.role, "content": content or ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                entry[key] = getattr(m, key)
        if m.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _object(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        out.append(entry)
    return out


def _object(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    """JSON text of an object as the object (what templates expect); else as it is."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM: the last message's content leads the reply
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    use_beam_search: bool = False  # (vLLM's field; beam search is completions' here)

    def _max_tokens(self):
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self):
        if not self.logprobs:
            if self.top_logprobs:
                raise BadField("top_logprobs", "top_logprobs needs logprobs set to true")
            return None, "top_logprobs"
        return self.top_logprobs or 0, "top_logprobs"

    def check_unsupported(self) -> None:
        if self.use_beam_search:
            raise BadField("use_beam_search", "use_beam_search is served on /v1/completions")

    def tool_choice_mode(self) -> tuple[str, list[Function]]:
        """How the reply may call tools: "none", "auto", "required" or "named" (that
        one function, once), and the functions it may call."""
        choice = self.tool_choice
        return tool_choice_mode(
            [(t.function.name, t.function.parameters) for t in self.tools or ()],
            choice.function.name if isinstance(choice, NamedToolChoice) else choice,
            named=isinstance(choice, NamedToolChoice),
            name_field=lambda i: f"tools[{i}].function.name",
        )

    def prompt(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The messages in `parse_prompt`'s shape, and the chat template's arguments
        (the tools among them, as Hugging Face's templates take them)."""
        kwargs = {
            **(self.chat_template_kwargs or {}),
            "add_generation_prompt": self.add_generation_prompt,
        }
        if self.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return {"messages": chat_messages(self.messages)}, kwargs


def tool_choice_mode(
    tools: Sequence[tuple[str, dict[str, Any] | None]],
    choice: str | None,
    *,
    named: bool,
    name_field: Callable[[int], str],
) -> tuple[str, list[Function]]:
    """How a reply may call `tools` (name, parameters): "none", "auto", "required" or
    "named" (the function `choice` names, once), and the functions it may call.
    `name_field(i)` names the i-th tool's name field in errors."""
    functions: list[Function] = []
    for i, (name, parameters) in enumerate(tools):
        if not FUNCTION_NAME.fullmatch(name):
            raise BadField(
                name_field(i), f"a function name is 1 to 64 letters, digits, _ or -; got {name!r}"
            )
        if any(f.name == name for f in functions):
            raise BadField(name_field(i), f"two tools are named {name!r}")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        functions.append(Function(name, parameters))
    if named:
        found = [f for f in functions if f.name == choice]
        if not found:
            raise BadField(
                "tool_choice",
                f"tool_choice names the function {choice!r}, which is not "
                f"one of the tools {[f.name for f in functions]}",
            )
        return "named", found
    if choice is None or (choice == "auto" and not functions):
        choice = "auto" if functions else "none"
    if choice not in ("none", "auto", "required"):
        raise BadField("tool_choice", f"tool_choice must be none, auto or required, got {choice!r}")
    if choice == "required" and not functions:
        raise BadField("tool_choice", "tool_choice 'required' needs tools")
    return choice, functions
