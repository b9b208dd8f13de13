"""`GET /tokenizer_info`, vLLM's (served with `--enable_tokenizer_info_endpoint`, as
vLLM serves it only with `--enable-tokenizer-info-endpoint`): the tokenizer's
configuration, so that a client can tokenize and render chats as the server does
(lm-eval's `RemoteTokenizer` reads `bos_token`, `eos_token`, `pad_token` and
`chat_template`).

The reply is vLLM's: the model's tokenizer_config.json with each special token as its
text (an `AddedToken` object as its `content`, `added_tokens_decoder` as id -> text),
the special tokens the tokenizer uses (a SentencePiece model's own BOS/EOS when the
config names none), `tokenizer_class`, and the chat template the server renders
with (`--chat_template`'s when given), if any. No file paths (vLLM drops
`vocab_file` and `merges_file`).
"""

from __future__ import annotations

from typing import Any

from jaxserve.tokenizer import Tokenizer

_PATHS = ("vocab_file", "merges_file", "tokenizer_file")


def tokenizer_info(tok: Tokenizer) -> dict[str, Any]:
    info = {k: _plain(v) for k, v in tok.config.items() if k not in _PATHS}
    info.update(tok.special_tokens)
    info["tokenizer_class"] = tok.tokenizer_class
    info.pop("chat_template", None)  # (a list of named templates, or the model's own)
    if tok.chat_template is not None:
        info["chat_template"] = tok.chat_template
    return info


def _plain(value: Any) -> Any:
    """An `AddedToken` (a dict with its `content`) as its text, through dicts and lists."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
