"""Multi-LoRA serving over HTTP and gRPC, against one live server (`--lora_modules` sql
and chat, an API key) on the tiny model: a request's model name selects its adapter and
its tokens are `LLM.generate(..., lora_request=...)`'s; /v1/models lists the adapters
under the served model; adapters are loaded and unloaded at run time (vLLM's routes,
the gRPC RPCs) and every bad load is refused by name while the server serves on; and a
`--lora_modules` entry that cannot be served stops the server at start-up."""

import os
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from conftest import SERVER_LLM, ServerThread
from lora_files import adapters, write_adapter
from test_serve_cli import free_port

from jaxserve import LLM, SamplingParams
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server.app import JaxServeServer, ServerOptions
from server.lora_registry import LoRAModule, LoRAModuleError, LoRARegistry, parse_lora_modules

KEY, ADMIN_KEY = "s3cret", "adm1n"  # inference's key; the admin operations' (adapters)
# A client of both scopes: each scope's key in the header that scope checks too.
AUTH = {"authorization": f"Bearer {KEY}", "x-api-key": ADMIN_KEY}
GRPC_AUTH = [("authorization", f"Bearer {KEY}"), ("x-api-key", ADMIN_KEY)]
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = [17, 250, 31, 99, 4, 120, 77, 5, 201, 64, 12, 300]
MESSAGES = [{"role": "user", "content": "Write a haiku."}]
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)
NAMES = ("tiny", "sql", "chat", "extra")  # the base model, then adapters ad0, ad1, ad2


@pytest.fixture(scope="module")
def offline(tiny_model_dir, tmp_path_factory):
    """Three adapter directories, and the greedy tokens of PROMPT and of MESSAGES under
    the base model and each adapter, by `LLM.generate`."""
    with LLM(tiny_model_dir, **SERVER_LLM, **LORA) as llm:
        loras = adapters(llm, tmp_path_factory.mktemp("adapters"), 3)
        chat_ids = llm.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
        prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": chat_ids}]
        params = SamplingParams(**GREEDY)
        want = {}
        for name, lora in zip(NAMES, [None, *loras], strict=True):
            outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            want[name] = [o.outputs[0].token_ids for o in outs]
    assert len({tuple(w[0]) for w in want.values()}) == 4  # every adapter changes them
    return [lora.lora_path for lora in loras], want


@pytest.fixture(scope="module")
def served(tiny_model_dir, offline, tmp_path_factory):
    paths, _ = offline
    modules = (LoRAModule("sql", paths[0]), LoRAModule("chat", paths[1]))
    server = ServerThread(
        tiny_model_dir,
        http_port=0,
        api_key=KEY,
        admin_api_key=ADMIN_KEY,
        allowed_local_paths=(str(tmp_path_factory.getbasetemp()),),  # (the tests' files)
        llm_kwargs=LORA,
        lora_modules=modules,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(served):
    base = served.http_url
    with httpx.Client(base_url=base, timeout=60, headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def stub(served):
    with grpc.insecure_channel(served.target) as channel:
        yield pb_grpc.JaxServeStub(channel)


def complete(http, model: str, **kw) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "return_token_ids": True, **GREEDY, **kw}
    return http.post("/v1/completions", json=body)


def tokens_of(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def error_of(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def test_http_model_selects_the_adapter(served, http, offline):
    _, want = offline
    for name in NAMES[:3]:
        r = complete(http, name)
        assert tokens_of(r) == want[name][0] and r.json()["model"] == name
        r = http.post(
            "/inference/v1/generate",
            json={"model": name, "token_ids": PROMPT, "sampling_params": GREEDY},
        )
        assert tokens_of(r) == want[name][0] and r.json()["model"] == name
        r = http.post(
            "/v1/chat/completions",
            json={"model": name, "messages": MESSAGES, "return_token_ids": True, **GREEDY},
        )
        assert tokens_of(r) == want[name][1] and r.json()["model"] == name
    r = http.post("/v1/responses", json={"model": "sql", "input": "Hi", "max_output_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "sql", r.text
    # The model's directory names the base model too, as before.
    assert tokens_of(complete(http, served.engine.config.model_dir)) == want["tiny"][0]


def test_an_unknown_model_is_404_as_vllm_answers(http):
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/inference/v1/generate", {"token_ids": PROMPT}),
    ]:
        r = http.post(path, json={"model": "nope", **body})
        assert error_of(r, 404, "model") == "The model `nope` does not exist."
        assert r.json()["error"]["code"] == "model_not_found"


def test_models_lists_each_adapter_under_the_served_model(http, offline):
    paths, _ = offline
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert list(cards) == ["tiny", "sql", "chat"]
    assert cards["tiny"]["parent"] is None
    assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("tiny", paths[0])
    assert (cards["chat"]["parent"], cards["chat"]["root"]) == ("tiny", paths[1])
    assert cards["sql"]["max_model_len"] == 128


def test_grpc_lora_name_selects_the_adapter(stub, offline, served):
    paths, want = offline
    for name in ("", "tiny", "sql", "chat"):
        request = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=PROMPT),
            sampling_params=pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
            lora_name=name,
        )
        reply = stub.Complete(request, metadata=GRPC_AUTH, timeout=60)
        assert list(reply.completions[0].token_ids) == want[name or "tiny"][0], name
    request.lora_name = "nope"
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(request, metadata=GRPC_AUTH, timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "lora_name 'nope'" in e.value.details()
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=GRPC_AUTH)
    assert [(a.name, a.path, a.id) for a in info.lora_adapters] == [
        ("sql", paths[0], 1),
        ("chat", paths[1], 2),
    ]
    engine_view = served.call(served.server.state.engine.list_loras())  # (by id, in memory)
    assert sorted((a.lora_int_id, a.lora_name) for a in engine_view) == [(1, "sql"), (2, "chat")]


def test_http_load_and_unload_at_run_time(served, http, offline, tmp_path):
    paths, want = offline
    load = {"lora_name": "extra", "lora_path": paths[2]}
    r = http.post("/v1/load_lora_adapter", json=load)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' added successfully."
    assert tokens_of(complete(http, "extra")) == want["extra"][0]
    assert [c["id"] for c in http.get("/v1/models").json()["data"]][-1] == "extra"

    # Every bad load is 400 naming the problem; nothing changes, requests are served.
    other_base = write_adapter(tmp_path / "other", {"layers.0.self_attn.q_proj": (48, 64)})
    modules = served.engine.adapters.layout.modules
    dora = write_adapter(tmp_path / "dora", modules, use_dora=True)
    not_an_object = _with_list_header(write_adapter(tmp_path / "list", modules))
    for body, param, words in [
        (load, "lora_name", "The lora adapter 'extra' has already been loaded."),
        ({**load, "lora_name": "tiny"}, "lora_name", "the served model's name"),
        ({"lora_name": "x"}, "lora_path", "Both 'lora_name' and 'lora_path'"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "no")}, "lora_path", "not a directory"),
        ({"lora_name": "x", "lora_path": other_base}, "lora_path", "maps 48 -> 64 features"),
        ({"lora_name": "x", "lora_path": dora}, "lora_path", "DoRA (use_dora) is not supported"),
        ({"lora_name": "x", "lora_path": not_an_object}, "lora_path", "header is a JSON list"),
        ({"lora_name": 3, "lora_path": "p"}, "lora_name", "string"),
        # Outside --allowed_local_paths: refused alike whether it exists or not.
        ({"lora_name": "x", "lora_path": "/etc"}, "lora_path", "not under the roots"),
        ({"lora_name": "x", "lora_path": "/no/such"}, "lora_path", "not under the roots"),
        ({"lora_name": "x", "lora_path": "p"}, "lora_path", "not under the roots"),
    ]:
        message = error_of(http.post("/v1/load_lora_adapter", json=body), 400, param)
        assert words in message, message
    assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [*NAMES]
    assert tokens_of(complete(http, "sql")) == want["sql"][0]

    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' removed successfully."
    assert error_of(complete(http, "extra"), 404) == "The model `extra` does not exist."
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert error_of(r, 400, "lora_name") == "The lora adapter 'extra' cannot be found."
    r = http.post("/v1/load_lora_adapter", json=load)  # back, under a new id (never reused)
    assert r.status_code == 200
    assert served.server.state.loras.named("extra").lora_int_id > 3
    assert tokens_of(complete(http, "extra")) == want["extra"][0]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200


def test_an_adapter_running_requests_use_is_not_unloaded(served, http, offline):
    """Its requests are frozen by a pause (they hold the adapter): the unload is 400 and
    the adapter serves on; once they finished, it unloads."""
    paths, want = offline
    front = served.server.state.engine
    load = {"lora_name": "extra", "lora_path": paths[2]}
    assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
    served.call(front.pause_generation("keep"))
    answers = []
    thread = threading.Thread(target=lambda: answers.append(complete(http, "extra")))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not served.engine.requests:  # until the engine holds it
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
        message = error_of(r, 400, "lora_name")
        assert "cannot be unloaded now" in message and "1 live request" in message
        assert "extra" in [c["id"] for c in http.get("/v1/models").json()["data"]]
    finally:
        served.call(front.resume_generation())
        thread.join(60)
    assert tokens_of(answers[0]) == want["extra"][0]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200


def test_the_lora_routes_and_rpcs_need_the_admin_key(served, stub):
    """Loading an adapter is an admin operation: inference's key does not open it."""
    base = served.http_url
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for headers in ({}, {"authorization": f"Bearer {KEY}"}):
            r = httpx.post(
                base + path, json={"lora_name": "sql", "lora_path": "p"}, headers=headers
            )
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for call, request in [
        (stub.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest(lora_name="x", lora_path="p")),
        (stub.UnloadLoRAAdapter, pb.UnloadLoRAAdapterRequest(lora_name="sql")),
    ]:
        for metadata in ([("x-api-key", "wrong")], [("authorization", f"Bearer {KEY}")]):
            with pytest.raises(grpc.RpcError) as e:
                call(request, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [a.lora_name for a in served.server.state.loras.adapters()] == ["sql", "chat"]


def _with_list_header(path: str) -> str:
    """The adapter at `path`, its safetensors header a JSON list (not an object)."""
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write((6).to_bytes(8, "little") + b"[1, 2]")
    return path


def test_grpc_load_and_unload(stub, offline, served, tmp_path):
    paths, want = offline
    modules = served.engine.adapters.layout.modules
    not_an_object = _with_list_header(write_adapter(tmp_path / "list", modules))
    reply = stub.LoadLoRAAdapter(
        pb.LoadLoRAAdapterRequest(lora_name="extra", lora_path=paths[2]), metadata=GRPC_AUTH
    )
    assert [a.name for a in reply.adapters] == ["sql", "chat", "extra"]
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT),
        sampling_params=pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        lora_name="extra",
    )
    assert (
        list(stub.Complete(request, metadata=GRPC_AUTH).completions[0].token_ids)
        == (want["extra"][0])
    )
    for call, bad, words in [
        (
            stub.LoadLoRAAdapter,
            pb.LoadLoRAAdapterRequest(lora_name="extra", lora_path="p"),
            "already",
        ),
        (stub.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest(lora_name="y", lora_path="/no"), "/no"),
        (
            stub.LoadLoRAAdapter,
            pb.LoadLoRAAdapterRequest(lora_name="y", lora_path=not_an_object),
            "cannot read adapter_model.safetensors: its header is a JSON list",
        ),
        (stub.UnloadLoRAAdapter, pb.UnloadLoRAAdapterRequest(lora_name="y"), "cannot be found"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            call(bad, metadata=GRPC_AUTH)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    reply = stub.UnloadLoRAAdapter(
        pb.UnloadLoRAAdapterRequest(lora_name="extra"), metadata=GRPC_AUTH
    )
    assert [a.name for a in reply.adapters] == ["sql", "chat"]


# ------------------------------------------------------------ start-up refusals


@pytest.mark.parametrize(
    "entries, words",
    [
        (["sql"], "--lora_modules 'sql': expected name=path"),
        (["=/a"], "--lora_modules '=/a': expected name=path"),
        (['{"name": "sql"}'], "a JSON entry needs a name and a path"),
        (['{"name": "a", "path": "p", "rank": 4}'], "unknown keys ['rank']"),
        (["{oops"], "not JSON"),
    ],
)
def test_malformed_lora_modules_are_refused_naming_the_entry(entries, words):
    with pytest.raises(LoRAModuleError, match="^--lora_modules") as e:
        parse_lora_modules(entries)
    assert words in str(e.value)


def test_lora_modules_that_could_never_be_served_are_refused_before_the_model_loads():
    assert parse_lora_modules(["a=/p/a", ' {"name": "b", "path": "/p/b"}']) == [
        LoRAModule("a", "/p/a"),
        LoRAModule("b", "/p/b"),
    ]
    for modules, words in [
        (
            [LoRAModule("a", "/x"), LoRAModule("a", "/y")],
            "--lora_modules a=/y: the name 'a' is given twice",
        ),
        ([LoRAModule("tiny", "/x")], "--lora_modules tiny=/x: 'tiny' is the served model's name"),
        ([LoRAModule("a", "/x", "other")], "base_model_name 'other' is not the served model"),
    ]:
        with pytest.raises(LoRAModuleError) as e:
            LoRARegistry("tiny").check_modules(modules)
        assert words in str(e.value)
        with pytest.raises(LoRAModuleError):  # the server refuses them as it is made
            JaxServeServer(lambda: None, ServerOptions(lora_modules=modules), model_name="tiny")


def test_an_adapter_that_does_not_load_stops_the_start_up(tiny_model_dir, tmp_path):
    """Before the server reports SERVING; the engine is shut down again."""
    modules = (LoRAModule("bad", str(tmp_path / "missing")),)
    server = ServerThread(tiny_model_dir, load=False, llm_kwargs=LORA, lora_modules=modules)
    try:
        with pytest.raises(LoRAModuleError) as e:
            server.load()
        assert str(e.value).startswith(f"--lora_modules bad={tmp_path / 'missing'}: ")
        assert "lora_path is not a directory" in str(e.value)
        assert server.server.state.engine is None and not server.server.ready.is_set()
    finally:
        server.stop()


def test_serve_documents_and_refuses_lora_modules_without_enable_lora(tiny_model_dir):
    help_text = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "--lora_modules: With --enable_lora: a LoRA adapter served from start-up" in help_text
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "serve", f"--model={tiny_model_dir}"]
        + ["--port=0", f"--grpc_port={free_port()}", "--lora_modules=sql=/adapters/sql"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "--lora_modules 'sql=/adapters/sql': serving LoRA adapters needs --enable_lora" in (
        proc.stderr
    )
    assert "gRPC on" not in proc.stderr  # (refused before the port opened)


@pytest.mark.slow
def test_serve_exits_naming_an_adapter_of_another_model(tiny_model_dir, tmp_path):
    other = write_adapter(tmp_path / "other", {"layers.0.self_attn.q_proj": (48, 64)})
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "serve", f"--model={tiny_model_dir}"]
        + ["--port=0", f"--grpc_port={free_port()}", "--compilation_cache_dir="]
        + ["--enable_lora", "--max_lora_rank=8"]
        + [f"--lora_modules=other={other}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"jaxserve serve: --lora_modules other={other}: "), last
    assert "maps 48 -> 64 features" in last and "server.app: SERVING" not in proc.stderr


@pytest.mark.slow
def test_disaggregated_requests_carry_their_adapter(tiny_model_dir, offline):
    """Through the router, a request of an adapter is prefilled on one instance and
    decoded on another (both serving the adapters under the same names): the pages
    pushed are found under its adapter there, and its stream is one engine's."""
    from test_disagg import DECODE, RouterThread, collect

    paths, _ = offline
    modules = (LoRAModule("sql", paths[0]), LoRAModule("chat", paths[1]))
    prefill = ServerThread(tiny_model_dir, llm_kwargs=LORA, lora_modules=modules)
    decode = ServerThread(tiny_model_dir, llm_kwargs={**LORA, **DECODE}, lora_modules=modules)
    router = RouterThread([prefill.target], [decode.target])
    try:
        params = pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        for name in ("sql", "chat", ""):
            loads = decode.engine.stats().kv_tier_loads
            req = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=PROMPT * 4), sampling_params=params,
                lora_name=name,
            )  # fmt: skip
            want = collect(prefill.target, req)  # one engine, the whole request
            assert collect(router.target, req) == want, name
            assert decode.engine.stats().kv_tier_loads > loads, name  # the pushed pages
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
