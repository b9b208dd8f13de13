"""Hugging Face tokenizers and chat templates, without transformers.

`tokenizer.json` is loaded with the `tokenizers` library; `tokenizer_config.json`
(or `chat_template.jinja`) supplies the special tokens and the chat template,
which is rendered with jinja2 the way transformers renders it: a sandboxed
environment with trim_blocks/lstrip_blocks, loop controls, `tojson`,
`raise_exception` and `strftime_now`.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: drop spaces before punctuation and contractions."""
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


@functools.cache
def _jinja_env() -> jinja2.Environment:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Tokenizer:
    """A model directory's tokenizer: encode, decode, special tokens, chat template."""

    def __init__(self, model_dir: str | os.PathLike):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in model directory {str(model_dir)!r}")
        self._tok = tokenizers.Tokenizer.from_file(path)
        config: dict[str, Any] = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        self.special_tokens = {
            name: _token_content(config.get(name))
            for name in _SPECIAL_NAMES
            if _token_content(config.get(name)) is not None
        }
        self.chat_template = self._load_chat_template(model_dir, config)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self.all_special_ids = sorted(
            i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        )

    @staticmethod
    def _load_chat_template(model_dir, config) -> str | None:
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        return template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.token_id(eos)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders `messages` to the prompt text (the template adds any BOS itself)."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat_template; send a plain prompt")
        if not messages:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with a 'role', got {m!r}")
        try:
            template = _jinja_env().from_string(self.chat_template)
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template failed on these messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat, as transformers' apply_chat_template(tokenize=True)."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)
