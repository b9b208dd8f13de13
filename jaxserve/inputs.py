"""The one prompt parser every front end calls (no JAX).

A prompt is one of (vLLM's shapes):

- text: `"Once upon a time"` or `{"prompt": "Once upon a time"}`
- token ids: `{"prompt_token_ids": [1, 2, 3]}`, optionally with `"prompt"` as its text
- chat messages: `{"messages": [{"role": "user", "content": "Hi"}, ...]}`, rendered
  with the model's chat template (generation prompt appended); a message may also
  carry `name`, `tool_calls`, `tool_call_id` and `reasoning_content`

`LLM.generate`, the gRPC servicer and `jaxserve generate`'s JSONL records turn
their input into this shape and call `parse_prompt` (as any new front end must),
so every front end accepts the same prompts and refuses bad ones with the same
messages. Checks against the model (vocabulary, length) are the engine's
(`LLMEngine.validate`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

from jaxserve.sampling_params import ParamError
from jaxserve.tokenizer import Tokenizer

PromptType = str | Mapping[str, Any]

_KEYS = ("prompt", "prompt_token_ids", "messages")
_SHAPES = "text, {'prompt': text}, {'prompt_token_ids': [ids]} or {'messages': [...]}"


@dataclasses.dataclass(frozen=True)
class ParsedPrompt:
    token_ids: list[int]
    text: str | None  # the prompt's text (the rendered chat for messages); None if unknown


def parse_prompt(
    prompt: PromptType,
    tokenizer: Tokenizer | None,
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ParsedPrompt:
    """Turns a prompt of any accepted shape into token ids (and its text).

    `tokenizer` is None for an engine started without one (`skip_tokenizer_init`):
    then only token ids are accepted. `chat_template_kwargs` go to the chat template
    with messages (e.g. `add_generation_prompt=False`; it defaults to True).
    Raises ParamError naming the field.
    """
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if not isinstance(prompt, Mapping):
        raise ParamError("prompt", f"a prompt must be {_SHAPES}; got {type(prompt).__name__}")
    unknown = sorted(set(prompt) - set(_KEYS))
    if unknown:
        raise ParamError("prompt", f"unknown prompt fields {unknown}; a prompt is {_SHAPES}")
    given = [k for k in ("prompt_token_ids", "messages") if k in prompt]
    if len(given) > 1:
        raise ParamError(
            "prompt_token_ids", "a prompt takes one of prompt_token_ids or messages, got both"
        )
    if "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ParamError("prompt", f"prompt must be text, got {type(text).__name__}")
        return ParsedPrompt(_token_ids(prompt["prompt_token_ids"]), text)
    if "messages" in prompt:
        if "prompt" in prompt:
            raise ParamError("messages", "a prompt takes one of prompt or messages, got both")
        tok = _need_tokenizer(tokenizer, "messages")
        messages = _messages(prompt["messages"])
        try:
            text = tok.apply_chat_template(messages, **(chat_template_kwargs or {}))
        except ValueError as e:
            raise ParamError("messages", f"messages: {e}") from None
        return ParsedPrompt(tok.encode(text, add_special_tokens=False), text)
    if "prompt" not in prompt:
        raise ParamError("prompt", "one of prompt, prompt_token_ids or messages is required")
    text = prompt["prompt"]
    if not isinstance(text, str):
        raise ParamError("prompt", f"prompt must be text, got {type(text).__name__}")
    ids = _need_tokenizer(tokenizer, "prompt").encode(text)
    if not ids:  # (the engine would name prompt_token_ids, which the client never sent)
        raise ParamError("prompt", f"prompt {text!r:.40} has no tokens: it must not be empty")
    return ParsedPrompt(ids, text)


def _need_tokenizer(tokenizer: Tokenizer | None, field: str) -> Tokenizer:
    if tokenizer is None:
        raise ParamError(
            field,
            f"{field}: this engine has no tokenizer (skip_tokenizer_init); "
            "pass prompt_token_ids instead",
        )
    return tokenizer


def _token_ids(ids: Any) -> list[int]:
    if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
        raise ParamError(
            "prompt_token_ids", f"prompt_token_ids must be a list of integers, got {ids!r:.80}"
        )
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool):
            raise ParamError(
                "prompt_token_ids", f"prompt_token_ids[{i}] must be an integer, got {t!r}"
            )
        try:
            out.append(operator.index(t))  # ints and numpy integers, not floats or strings
        except TypeError:
            raise ParamError(
                "prompt_token_ids", f"prompt_token_ids[{i}] must be an integer, got {t!r:.40}"
            ) from None
    return out


# What a message may carry besides its role and content (OpenAI's and Hugging Face's
# names, as chat templates read them), and the type of each.
_MESSAGE_FIELDS = {"name": str, "tool_calls": list, "tool_call_id": str, "reasoning_content": str}


def _messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes | Mapping) or not hasattr(messages, "__iter__"):
        raise ParamError("messages", "messages must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ParamError("messages", f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ParamError(
                "messages", f"messages[{i}].role must be a non-empty string, got {role!r}"
            )
        if not isinstance(content, str):
            raise ParamError(
                "messages", f"messages[{i}].content must be a string, got {content!r:.40}"
            )
        entry: dict[str, Any] = {"role": role, "content": content}
        for key, kind in _MESSAGE_FIELDS.items():
            value = m.get(key)
            if value is None:
                continue
            if not isinstance(value, kind):
                raise ParamError(
                    "messages", f"messages[{i}].{key} must be a {kind.__name__}, got {value!r:.40}"
                )
            entry[key] = value
        out.append(entry)
    if not out:
        raise ParamError("messages", "messages must not be empty")
    return out
