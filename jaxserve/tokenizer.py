"""Hugging Face tokenizers and chat templates, without transformers.

`tokenizer.json` is loaded with the `tokenizers` library; a directory that ships
only a SentencePiece `tokenizer.model` (many Llama 2 and Mistral repositories)
with the `sentencepiece` library. `tokenizer_config.json` (or
`chat_template.jinja`) supplies the special tokens and the chat template, which
is rendered with jinja2 the way transformers renders it: a sandboxed environment
with trim_blocks/lstrip_blocks, loop controls, `tojson`, `raise_exception` and
`strftime_now`.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import re
from collections.abc import Sequence
from typing import Any, Protocol

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


def check_chat_template(template: str) -> None:
    """Raises ValueError where `template` does not compile (jinja2's message)."""
    try:
        _jinja_env().from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(str(e)) from None


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


def _named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... -> its text, as tokenizer_config.json names them."""
    named = {name: _token_content(config.get(name)) for name in _SPECIAL_NAMES}
    return {name: content for name, content in named.items() if content is not None}


def _extra_special_tokens(config: dict[str, Any]) -> list[str]:
    """The special tokens besides the named ones (transformers 4 and 5 spell the key apart)."""
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        extra = list(extra.values())
    return [_token_content(token) for token in extra]


class _Backend(Protocol):
    """One tokenizer file's model: what `Tokenizer` needs besides the chat template."""

    special_tokens: dict[str, str]  # bos_token, eos_token, ... -> its text
    all_special_ids: list[int]
    hf_class: str  # transformers' class for this kind of tokenizer file

    @property
    def vocab_size(self) -> int: ...

    def token_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...


class _TokenizersBackend:
    """`tokenizer.json` with the `tokenizers` library; its post-processor adds BOS/EOS."""

    hf_class = "TokenizersBackend"  # transformers 5's class for a tokenizer.json

    def __init__(self, path: str, config: dict[str, Any]):
        self._tok = tokenizers.Tokenizer.from_file(path)
        self.special_tokens = _named_special_tokens(config)
        self.all_special_ids = sorted(
            i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: a 0.9 MB
        # encode on a worker thread blocked the event loop's thread 3.7 s).
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer.json text (the grammar engine builds its vocabulary from it)."""
        return self._tok.to_str()


class _SentencePieceBackend:
    """`tokenizer.model` with the `sentencepiece` library, as transformers' LlamaTokenizer.

    Ids are those of the slow (sentencepiece) LlamaTokenizer in its default `legacy`
    mode (a config's `"legacy": false` is not followed): the text is cut at the added
    tokens and sentencepiece encodes each cut on its own, dummy-prefix space included.
    Text is that of the tokenizers-based LlamaTokenizer (and of Llama 2's
    tokenizer.json): pieces decode as sentencepiece decodes them and only the text's
    first dummy-prefix space is dropped, so a window of ids decodes as it reads inside
    the whole sequence (the incremental detokenizer relies on it). The slow
    tokenizer's decode is not window-stable: it drops a second space when the text
    starts with "▁▁" and inserts one when a special token follows text.
    Added tokens' lstrip/rstrip flags are not applied (Llama and Mistral set none).
    """

    hf_class = "SentencePieceBackend"  # transformers 5's class for a tokenizer.model

    def __init__(self, path: str, config: dict[str, Any]):
        import sentencepiece  # only for tokenizer.model directories

        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self._num_pieces = self._sp.get_piece_size()
        self._unk_text = self._sp.decode([self._sp.unk_id()])

        model_ids = {
            "bos_token": self._sp.bos_id(),
            "eos_token": self._sp.eos_id(),
            "unk_token": self._sp.unk_id(),
            "pad_token": self._sp.pad_id(),
        }
        self.special_tokens = {
            **{name: self._sp.id_to_piece(i) for name, i in model_ids.items() if i >= 0},
            **_named_special_tokens(config),
        }
        # Added tokens (id -> text) are matched whole in the text and decoded verbatim.
        added_decoder = config.get("added_tokens_decoder", {})
        self._added = {int(i): tok["content"] for i, tok in added_decoder.items()}
        self._added_ids = {content: i for i, content in self._added.items()}
        special = {int(i) for i, tok in added_decoder.items() if tok.get("special")}
        for token in [*self.special_tokens.values(), *_extra_special_tokens(config)]:
            i = self.token_id(token)
            if i is None:  # as transformers: a special token the vocabulary lacks is appended
                i = self.vocab_size
            self._added[i], self._added_ids[token] = token, i
            special.add(i)
        self.all_special_ids = sorted(special)
        self._special_ids = frozenset(special)
        longest_first = sorted(self._added_ids, key=len, reverse=True)
        # "(?!)" never matches: a model with no added tokens at all.
        self._added_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")

        def added(name: str, default: bool) -> list[int]:
            i = self.token_id(self.special_tokens.get(name, ""))
            return [i] if config.get(f"add_{name}", default) and i is not None else []

        self._prefix, self._suffix = added("bos_token", True), added("eos_token", False)

    @property
    def vocab_size(self) -> int:
        return max([self._num_pieces, *(i + 1 for i in self._added)])

    def token_id(self, token: str) -> int | None:
        if token in self._added_ids:
            return self._added_ids[token]
        i = self._sp.piece_to_id(token)  # the unknown piece's id when there is no such piece
        return i if self._sp.id_to_piece(i) == token else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids, start = [], 0
        for match in self._added_re.finditer(text):
            ids += self._sp.encode(text[start : match.start()])
            ids.append(self._added_ids[match.group()])
            start = match.end()
        ids += self._sp.encode(text[start:])
        return self._prefix + ids + self._suffix if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        parts: list[str] = []  # runs of pieces, and added tokens between them
        run: list[int] = []
        for i in ids:
            if skip_special_tokens and i in self._special_ids:
                continue
            if i in self._added:
                parts += [self._decode_run(run, after_added=bool(parts)), self._added[i]]
                run = []
            elif 0 <= i < self._num_pieces:  # an unknown id decodes to nothing, as in tokenizers
                run.append(i)
        parts.append(self._decode_run(run, after_added=bool(parts)))
        return "".join(parts)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as they read inside a text (the grammar engine matches on them):
        "▁" is a space, a byte piece <0xNN> its byte, an added token its text."""
        out = []
        for i in range(self.vocab_size):
            if i in self._added:
                out.append(self._added[i].encode())
            elif i >= self._num_pieces or self._sp.is_control(i) or self._sp.is_unknown(i):
                out.append(b"")
            elif self._sp.is_byte(i):
                out.append(bytes([int(self._sp.id_to_piece(i)[3:-1], 16)]))
            else:
                out.append(self._sp.id_to_piece(i).replace("\u2581", " ").encode())
        return out

    def _decode_run(self, run: list[int], after_added: bool) -> str:
        if not after_added:
            return self._sp.decode(run)
        # sentencepiece drops the "▁" of a text's first piece (its dummy prefix); after an added
        # token that space is real. Decoded after the unknown piece, the run keeps it.
        return self._sp.decode([self._sp.unk_id(), *run])[len(self._unk_text) :]


def _load_backend(model_dir: str | os.PathLike, config: dict[str, Any]) -> _Backend:
    """tokenizer.json when the directory has one (as transformers prefers), else tokenizer.model."""
    json_path = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(json_path):
        return _TokenizersBackend(json_path, config)
    model_path = os.path.join(model_dir, "tokenizer.model")
    if os.path.exists(model_path):
        return _SentencePieceBackend(model_path, config)
    raise FileNotFoundError(
        f"model directory {str(model_dir)!r} has neither tokenizer.json nor tokenizer.model"
    )


class Tokenizer:
    """A model directory's tokenizer: encode, decode, special tokens, chat template."""

    def __init__(self, model_dir: str | os.PathLike):
        config: dict[str, Any] = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        self.config = config  # tokenizer_config.json as read ({} without one)
        self._backend = _load_backend(model_dir, config)
        self.special_tokens = self._backend.special_tokens
        self.chat_template = self._load_chat_template(model_dir, config)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self.all_special_ids = self._backend.all_special_ids

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

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer rendering chats with `template` instead of the model's (a
        server's --chat_template); `check_chat_template` it first."""
        other = copy.copy(self)
        other.chat_template = template
        return other

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def tokenizer_class(self) -> str:
        """The config's `tokenizer_class`, else transformers' class for the file loaded."""
        return self.config.get("tokenizer_class") or self._backend.hf_class

    @property
    def backend(self) -> _Backend:
        """The loaded tokenizer file (structured output reads its vocabulary)."""
        return self._backend

    def token_id(self, token: str) -> int | None:
        return self._backend.token_id(token)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.token_id(bos)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.token_id(eos)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
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
