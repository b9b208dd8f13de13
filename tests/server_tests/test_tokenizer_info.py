"""`GET /tokenizer_info`, vLLM's: served only when asked for (404 otherwise, as vLLM
without --enable-tokenizer-info-endpoint), behind the user key; its reply is the
tokenizer's configuration with special tokens as text, the value vLLM computes from
transformers' tokenizer for each field both send, and it is what lm-eval's
`RemoteTokenizer` needs (an `eos_token` that /tokenize turns into the EOS id, a chat
template that renders as the server renders).

No model: a fake front, the app in-process through httpx.
"""

import asyncio
import json
import shutil
import types

import httpx
import jinja2.sandbox
import pytest
import sentencepiece
import transformers
from conftest import ServerThread
from hf_models import CHAT_TEMPLATE, save_tokenizer

from jaxserve.tokenizer import Tokenizer
from server.edge import Keys
from server.openai_api.api import build_app
from server.prometheus import ServerMetrics
from server.serving import ServingState

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
FLAGS = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
# A tokenizer_config.json as transformers 4 wrote them: special tokens as AddedToken
# objects or text, named chat templates, a file path.
CONFIG = {
    "add_bos_token": True,
    "bos_token": {"__type": "AddedToken", "content": "<s>", **FLAGS},
    "eos_token": "</s>",
    "unk_token": {"__type": "AddedToken", "content": "<unk>", **FLAGS},
    "pad_token": "</s>",
    "added_tokens_decoder": {
        str(i): {"content": c, "special": True, **FLAGS} for i, c in enumerate(SPECIALS)
    },
    "additional_special_tokens": [
        {"__type": "AddedToken", "content": "<|user|>", **FLAGS},
        "<|assistant|>",
    ],
    "chat_template": [
        {"name": "default", "template": CHAT_TEMPLATE},
        {"name": "tool_use", "template": "{{ tools }}"},
    ],
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
    "sp_model_kwargs": {},
    "tokenizer_class": "PreTrainedTokenizerFast",
    "vocab_file": "/models/llama/tokenizer.model",
}
WANT = {
    "add_bos_token": True,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "</s>",
    "added_tokens_decoder": {str(i): c for i, c in enumerate(SPECIALS)},
    "additional_special_tokens": ["<|user|>", "<|assistant|>"],
    "chat_template": CHAT_TEMPLATE,  # the default one: what the server renders with
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
    "sp_model_kwargs": {},
    "tokenizer_class": "PreTrainedTokenizerFast",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """`save_tokenizer`'s tokenizer.json with the config above."""
    path = tmp_path_factory.mktemp("tokenizer_info")
    save_tokenizer(path, vocab_size=320)
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps(CONFIG))
    return path


def app(tokenizer, **kw):
    info = types.SimpleNamespace(max_model_len=128, vocab_size=tokenizer.vocab_size)
    front = types.SimpleNamespace(healthy=True, error=None, model_info=info)
    state = ServingState(engine=front, tokenizer=tokenizer, model_name="m")
    return build_app(state, ServerMetrics("m", lambda: None), **kw)


def get(app, path="/tokenizer_info", method="GET", **kw) -> httpx.Response:
    async def call():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(call())


def test_the_reply_is_the_config_with_tokens_as_text(model_dir):
    r = get(app(Tokenizer(model_dir), serve_tokenizer_info=True))
    assert r.status_code == 200, r.text
    assert r.json() == WANT


def test_each_field_is_the_value_vllm_sends(model_dir):
    """vLLM's reply is transformers' `init_kwargs` with AddedTokens as their content
    (`TokenizerInfo._get_tokenizer_config`); every field both send has one value (the
    chat template aside: vLLM sends the named list, this server the one it renders)."""
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)

    def plain(value):
        if hasattr(value, "content"):
            return value.content
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, list) else value

    vllm = json.loads(json.dumps(plain(dict(hf.init_kwargs))))  # (JSON's keys are text)
    ours = get(app(Tokenizer(model_dir), serve_tokenizer_info=True)).json()
    both = (set(ours) & set(vllm)) - {"chat_template"}
    assert {"bos_token", "eos_token", "pad_token", "model_max_length"} <= both
    assert "added_tokens_decoder" in both
    assert {k: ours[k] for k in both} == {k: vllm[k] for k in both}


def test_lm_evals_remote_tokenizer_gets_what_it_reads(model_dir):
    """lm-eval's RemoteTokenizer: `eos_token` present (its support check), encoded by
    /tokenize without special tokens to the EOS id; the chat template rendered by
    jinja2 as the server renders it."""
    tok = Tokenizer(model_dir).with_chat_template("{{ bos_token }}{{ messages[0].content }}|")
    served = app(tok, serve_tokenizer_info=True)
    info = get(served).json()
    ids = get(
        served, "/tokenize", "POST", json={"prompt": info["eos_token"], "add_special_tokens": False}
    )
    assert ids.json()["tokens"] == [tok.eos_token_id]
    assert info["chat_template"] == tok.chat_template  # --chat_template's, not the model's
    chat = [{"role": "user", "content": "hi"}]
    template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(info["chat_template"])
    assert template.render(messages=chat, **info) == tok.apply_chat_template(chat) == "<s>hi|"


def test_a_sentencepiece_models_own_special_tokens(tmp_path):
    """A tokenizer.model without tokenizer_config.json: its BOS/EOS/UNK pieces, and
    transformers' class for it; no chat template."""
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["the quick brown fox jumps over the lazy dog"] * 50),
        model_prefix=str(tmp_path / "sp"),
        model_type="bpe",
        vocab_size=40,
        num_threads=1,
        minloglevel=2,
    )
    shutil.move(tmp_path / "sp.model", tmp_path / "tokenizer.model")
    info = get(app(Tokenizer(tmp_path), serve_tokenizer_info=True)).json()
    assert info == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "tokenizer_class": "SentencePieceBackend",
    }


def test_not_served_unless_enabled_as_an_unknown_route(model_dir):
    served = app(Tokenizer(model_dir))
    off, unknown = get(served), get(served, "/no_such_route")
    assert off.status_code == unknown.status_code == 404
    assert off.json() == unknown.json()
    assert off.json()["error"]["type"] == "not_found_error"


def test_behind_the_user_key(model_dir):
    served = app(Tokenizer(model_dir), keys=Keys(user="s3cret"), serve_tokenizer_info=True)
    r = get(served)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = get(served, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["eos_token"] == "</s>"


@pytest.mark.parametrize("enabled,status", [(True, 503), (False, 404)])
def test_the_server_option_while_the_model_loads(enabled, status):
    """`ServerOptions.enable_tokenizer_info_endpoint` (--enable_tokenizer_info_endpoint)
    serves the route: 503 until the model is loaded; without it, 404."""
    server = ServerThread(
        None,
        load=False,
        grpc_port=None,
        http_port=0,
        metrics_port=None,
        enable_tokenizer_info_endpoint=enabled,
    )
    try:
        assert httpx.get(server.http_url + "/tokenizer_info").status_code == status
    finally:
        server.stop()
