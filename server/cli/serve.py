"""`jaxserve serve [MODEL]`: the OpenAI-compatible HTTP API on --port (8000, as vLLM's)
and the gRPC API (jaxserve.v1.JaxServe, health, reflection) on --grpc_port (50051), in
one process over one engine; --port=0 or --grpc_port=0 leaves that server off.

  jaxserve serve                                   (embedded demo model: HTTP 8000, gRPC 50051)
  jaxserve serve DIR --config=configs/gpu.toml     (the model: DIR, or --model=DIR)
  jaxserve serve --port=0 --metrics_port=9090      (gRPC only; Prometheus /metrics on 9090)
  jaxserve serve --grpc_port=0 --tls_cert=c.pem --tls_key=k.pem  (HTTPS only)

Flag names take dashes too (--max-model-len=4096, as in vLLM). --http_port is the old
name of --port, still accepted with a warning; gRPC was on --port before --grpc_port.
A port that is taken stops the server at start-up, naming the port and its flag.

Disaggregated prefill/decode (server/router.py, server/disagg.py); the instances talk
gRPC, and the router serves gRPC only:

  jaxserve serve --role=prefill --grpc_port=50061 --port=0
  jaxserve serve --role=decode --grpc_port=50071 --port=0 --kv_offload_bytes=2000000000
  jaxserve serve --role=router --grpc_port=50051 \\
      --prefill_targets=127.0.0.1:50061 --decode_targets=127.0.0.1:50071,...

Between the instances, mutual TLS instead of (or beside) --peer_api_key: one CA signs
every instance's server and client certificate; each instance serves its peers on a port
of their own that requires a client certificate signed by it, and the router's targets
name those ports (server/peer_tls.py):

  jaxserve serve --role=decode --grpc_port=50071 --peer_grpc_port=50072 \\
      --tls_cert=decode.pem --tls_key=decode.key --peer_tls_ca=ca.pem
  jaxserve serve --role=prefill --grpc_port=50061 --peer_grpc_port=50062 \\
      --tls_cert=prefill.pem --tls_key=prefill.key --peer_tls_ca=ca.pem \\
      --peer_tls_cert=client.pem --peer_tls_key=client.key
  jaxserve serve --role=router --prefill_targets=host:50062 --decode_targets=host:50072 \\
      --peer_tls_ca=ca.pem --peer_tls_cert=client.pem --peer_tls_key=client.key

Every role but the router serves the whole API over one engine (`both`, the
default, and `prefill` are the same server; `decode` needs a host KV tier to
receive pages in, 1 GiB unless --kv_offload_bytes says otherwise); the router
loads no model. Data-parallel replicas do not transfer KV pages: `prefill` and
`decode` over them are refused at start-up.

Multi-host (`--num_processes=N --process_id=I --coordinator_address=HOST:PORT`, the
same command on every host): process 0 serves; the others only run its steps. When
process 0 stops it stops the others (they exit with status 0); a process that finds
a peer dead or stalled for --step_timeout_s exits at once with status 1, naming it
(`jaxserve.distributed.multihost`). A follower ends at once on SIGTERM.

LoRA adapters (PEFT directories) served beside the model, each by its own model name:

  jaxserve serve --enable_lora --max_lora_rank=16 \\
      --lora_modules=sql=/adapters/sql --lora_modules=chat=/adapters/chat

Each adapter is read and checked at start-up (lora_int_id 1, 2, ... in order); an
entry that is malformed, a name given twice or the served model's, or an adapter that
does not load (a bad path, another base model's shapes, an unsupported target) stops
the server before it serves, with status 1 and the entry named. More adapters come and
go at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter; gRPC
LoadLoRAAdapter, UnloadLoRAAdapter).

SIGTERM (or Ctrl-C) drains: the server reports NOT_SERVING (HTTP /health: 503),
refuses new calls (HTTP: 503) and lets running ones finish for --drain_grace_s
seconds before it exits; while the model is still loading, it exits at once. If the
model fails to load (bad directory or config, out of memory at warm-up), the error
is logged with its cause and the process exits with status 1, so a supervisor sees
it and restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import NoReturn

from absl import flags

from jaxserve.distributed.multihost import FollowerLostError, Leader, LeaderLostError
from jaxserve.llm import LLM, resolve_model_dir
from jaxserve.tokenizer import check_chat_template
from server import reasoning_parsers, tool_parsers
from server.app import ListenError
from server.cli import logs
from server.cli.engine_flags import engine_kwargs
from server.lora_registry import LoRAModule, LoRAModuleError, parse_lora_modules

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for all).")
flags.DEFINE_integer(
    "port",
    8000,
    "The OpenAI-compatible HTTP API's port, as vLLM's (/v1/completions, "
    "/v1/chat/completions, /v1/responses, /v1/models, /tokenize, /detokenize, /health, "
    "/metrics); 0: no HTTP server. (gRPC's port was --port until it became --grpc_port.)",
    lower_bound=0,
    upper_bound=65535,
)
flags.DEFINE_integer(
    "grpc_port",
    50051,
    "The gRPC API's port (jaxserve.v1.JaxServe, grpc.health.v1, reflection); 0: no gRPC server.",
    lower_bound=0,
    upper_bound=65535,
)
flags.DEFINE_integer(
    "http_port",
    None,
    "Deprecated: the old name of --port (the HTTP API), accepted with a warning.",
    lower_bound=0,
    upper_bound=65535,
)
flags.DEFINE_integer("metrics_port", None, "Prometheus /metrics port (unset: no endpoint).")
flags.DEFINE_integer(
    "max_pending_requests", 1024, "Requests in flight past which new ones get RESOURCE_EXHAUSTED."
)
flags.DEFINE_integer("max_message_bytes", 4 << 20, "Largest gRPC message accepted or sent.")
flags.DEFINE_string(
    "api_key",
    None,
    "Require this key in 'authorization: Bearer KEY' or "
    "'x-api-key' metadata or HTTP headers (default: $JAXSERVE_API_KEY, else no key).",
)
flags.DEFINE_string(
    "admin_api_key",
    None,
    "Serve the admin operations (pause/resume, sleep/wake_up, update_weights, LoRA "
    "load/unload, reset_prefix_cache, start/stop_profile and their state queries) behind "
    "this key only (default: $JAXSERVE_ADMIN_API_KEY; unset: they are not served: HTTP "
    "404, gRPC UNIMPLEMENTED).",
)
flags.DEFINE_string(
    "peer_api_key",
    None,
    "The key between disaggregated instances (Prefill, PushKV): checked by this "
    "server, sent by it and by the router (default: $JAXSERVE_PEER_API_KEY, else the "
    "--api_key).",
)
flags.DEFINE_list(
    "allowed_local_paths",
    [],
    "Roots under which an admin call may name a file of this machine (update_weights' "
    "path, a LoRA adapter's lora_path, a profile's output_dir); none: no call may.",
)
flags.DEFINE_string("tls_cert", None, "PEM certificate chain (with --tls_key) to serve TLS.")
flags.DEFINE_string("tls_key", None, "PEM private key.")
flags.DEFINE_integer(
    "peer_grpc_port",
    None,
    "Mutual TLS between disaggregated instances: a second gRPC port (0: any free one) "
    "for the router and the other instances, TLS with --tls_cert that requires a client "
    "certificate signed by --peer_tls_ca, which grants Prefill and PushKV (as "
    "--peer_api_key does; without that key, only the certificate does). The router's "
    "targets name these ports. Unset: none.",
    lower_bound=0,
    upper_bound=65535,
)
flags.DEFINE_string(
    "peer_tls_ca",
    None,
    "PEM certificate of the CA that signs every instance's certificates (one deployment "
    "CA): it verifies the client certificates on --peer_grpc_port and, when this "
    "instance or the router calls a peer, that peer's server certificate.",
)
flags.DEFINE_string(
    "peer_tls_cert",
    None,
    "PEM client certificate (with --peer_tls_key), signed by --peer_tls_ca, that this "
    "instance or the router shows the peers it calls (the router's Prefill, a prefill "
    "instance's PushKV).",
)
flags.DEFINE_string("peer_tls_key", None, "PEM private key of --peer_tls_cert.")
flags.DEFINE_float("drain_grace_s", 30.0, "Seconds in-flight requests may finish on SIGTERM.")
flags.DEFINE_enum(
    "role",
    "both",
    ["both", "prefill", "decode", "router"],
    "Disaggregated serving: what this instance does (both: prefill and decode).",
)
flags.DEFINE_list("prefill_targets", [], "--role=router: prefill instances (host:port).")
flags.DEFINE_list("decode_targets", [], "--role=router: decode instances (host:port).")
flags.DEFINE_enum(
    "tool_call_parser",
    None,
    sorted(tool_parsers.PARSERS),
    "HTTP chat completions: parse the model's tool calls in this format (Hermes "
    "<tool_call> tags: Qwen 2.5/3; Llama 3.x JSON; Mistral [TOOL_CALLS]); unset: "
    "requests with tools are refused unless tool_choice is 'none'.",
)
flags.DEFINE_bool(
    "tool_call_constrained",
    False,
    "With --tool_call_parser: constrain tool_choice 'auto' replies too, so that a call "
    "the model begins always parses ('required' and named functions always are).",
)
flags.DEFINE_enum(
    "reasoning_parser",
    None,
    sorted(reasoning_parsers.PARSERS),
    "HTTP chat completions: return the text between <think> and </think> as "
    "reasoning_content; output constraints apply to the answer after it.",
)
flags.DEFINE_multi_string(
    "lora_modules",
    [],
    "With --enable_lora: a LoRA adapter served from start-up, as name=path (a PEFT "
    'directory) or vLLM\'s JSON {"name": ..., "path": ..., "base_model_name": ...}; '
    "repeat the flag for more. Requests select it by that name as their model "
    "(HTTP `model`, gRPC `lora_name`); /v1/models lists it with the served model as its "
    "parent. An adapter that does not load stops the server at start-up",
)
flags.DEFINE_string(
    "chat_template",
    None,
    "The chat template (a Jinja file, or the template itself) to render chat messages "
    "with instead of the model's: for a model whose template has no tools, or none.",
)
flags.DEFINE_bool(
    "enable_tokenizer_info_endpoint",
    False,
    "Serve GET /tokenizer_info (vLLM's, for lm-eval's remote tokenizer): the tokenizer's "
    "configuration, special tokens and chat template; off: 404.",
)
DECODE_TIER_BYTES = 1 << 30  # --role=decode without --kv_offload_bytes
flags.DEFINE_string(
    "served_model_name",
    None,
    "Name reported by GetModelInfo and /v1/models, and accepted as the HTTP `model` "
    "(default: the model directory's name).",
)


def main(argv) -> None:
    _model_from_argv(argv[1:])
    logs.configure()
    try:
        if FLAGS.process_id > 0 and FLAGS.role != "router":
            _follow()
        else:
            asyncio.run(_serve())
    except ListenError as e:  # (no traceback: one line naming the port and its flag)
        raise SystemExit(f"jaxserve serve: {_cannot_listen(e)}") from None
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"jaxserve serve: {e}") from None


PORT_FLAGS = {
    "HTTP": "--port",
    "gRPC": "--grpc_port",
    "peer gRPC": "--peer_grpc_port",
    "metrics": "--metrics_port",
}


def _cannot_listen(e: ListenError) -> str:
    flag = f"{PORT_FLAGS[e.server]}={e.port}"
    if e.in_use:
        return (
            f"port {e.port} is in use ({flag}, the {e.server} server, on {e.host}); "
            "stop what holds it or choose another port"
        )
    return f"cannot listen on {e.host}:{e.port} ({flag}, the {e.server} server): {e.strerror}"


def _ports(role: str) -> tuple[int | None, int | None]:
    """(gRPC port, HTTP port) from the flags, None for a server that is off; ValueError,
    naming the flags, for a combination that cannot serve."""
    http = FLAGS.port
    if FLAGS["http_port"].present:
        if FLAGS["port"].present and FLAGS.port != FLAGS.http_port:
            raise ValueError(
                f"--port={FLAGS.port} and --http_port={FLAGS.http_port} both set the HTTP "
                "port (--http_port is --port's old name); gRPC moved from --port to --grpc_port"
            )
        logging.warning(
            "--http_port is deprecated: use --port (the HTTP API, 8000 unless given); "
            "gRPC moved from --port to --grpc_port (50051 unless given)"
        )
        http = FLAGS.http_port
    grpc_port, http = FLAGS.grpc_port or None, http or None
    if role == "router":  # (an HTTP port given by default is not used)
        if grpc_port is None:
            raise ValueError("--role=router serves gRPC only; --grpc_port=0 leaves it nothing")
        if http is not None and (FLAGS["port"].present or FLAGS["http_port"].present):
            raise ValueError(f"--role=router serves gRPC only (--grpc_port), not --port={http}")
        return grpc_port, None
    if role in ("prefill", "decode") and grpc_port is None:
        raise ValueError(f"--role={role} transfers KV pages over gRPC: it needs --grpc_port")
    if grpc_port is None and http is None:
        raise ValueError("--port=0 and --grpc_port=0: no server to start")
    if grpc_port == http:
        raise ValueError(
            f"--port (HTTP) and --grpc_port (gRPC) are both {http}: each needs its own "
            "(gRPC moved from --port to --grpc_port)"
        )
    return grpc_port, http


def _model_from_argv(positional: list[str]) -> None:
    """`jaxserve serve MODEL` (vLLM's way) is `jaxserve serve --model=MODEL`."""
    if len(positional) > 1:
        raise SystemExit(f"jaxserve serve: one MODEL expected, got {' '.join(positional)}")
    if positional:
        (model,) = positional
        if FLAGS.model is not None and FLAGS.model != model:
            raise SystemExit(
                f"jaxserve serve: two models given, {model!r} and --model={FLAGS.model!r}; give one"
            )
        FLAGS.model = model


def _exit_now(status: int, message: str) -> NoReturn:
    """Logs `message` and ends the process at once. A normal exit would wait: for
    a model load, which cannot be interrupted, to finish in its thread; with a lost
    multi-host peer, at the distributed runtime's shutdown barrier for that peer."""
    logging.log(logging.ERROR if status else logging.INFO, "%s", message)
    logging.shutdown()  # flushes the handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _options(role: str = "both", lora_modules: tuple[LoRAModule, ...] = ()):
    from server.app import ServerOptions

    grpc_port, http_port = _ports(FLAGS.role)
    return ServerOptions(
        role=role,
        host=FLAGS.host,
        grpc_port=grpc_port,
        http_port=http_port,
        metrics_port=FLAGS.metrics_port,
        max_pending=FLAGS.max_pending_requests,
        max_message_bytes=FLAGS.max_message_bytes,
        api_key=FLAGS.api_key or os.environ.get("JAXSERVE_API_KEY") or None,
        admin_api_key=FLAGS.admin_api_key or os.environ.get("JAXSERVE_ADMIN_API_KEY") or None,
        peer_api_key=FLAGS.peer_api_key or os.environ.get("JAXSERVE_PEER_API_KEY") or None,
        allowed_local_paths=tuple(FLAGS.allowed_local_paths),
        tls_cert=FLAGS.tls_cert,
        tls_key=FLAGS.tls_key,
        peer_grpc_port=FLAGS.peer_grpc_port,
        peer_tls_ca=FLAGS.peer_tls_ca,
        peer_tls_cert=FLAGS.peer_tls_cert,
        peer_tls_key=FLAGS.peer_tls_key,
        drain_grace_s=FLAGS.drain_grace_s,
        tool_call_parser=FLAGS.tool_call_parser,
        tool_call_constrained=FLAGS.tool_call_constrained,
        reasoning_parser=FLAGS.reasoning_parser,
        lora_modules=lora_modules,
        enable_tokenizer_info_endpoint=FLAGS.enable_tokenizer_info_endpoint,
    )


async def _until_signal() -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()


async def _route() -> None:
    from server.router import RouterServer, RouterServicer

    if FLAGS.peer_grpc_port is not None:
        raise ValueError(
            "--peer_grpc_port is for the instances: the router serves no peer operations "
            "(--peer_tls_ca, --peer_tls_cert and --peer_tls_key are what it calls them with)"
        )
    options = _options()
    tls = options.peer_tls()
    servicer = RouterServicer(
        FLAGS.prefill_targets,
        FLAGS.decode_targets,
        options.max_message_bytes,
        peer_api_key=options.peer_api_key,
        peer_credentials=None if tls is None else tls.channel_credentials(),
    )
    server = RouterServer(servicer, options)
    await server.start()
    await _until_signal()
    await server.stop()


async def _serve() -> None:
    from server.app import JaxServeServer, default_model_name

    if FLAGS.role == "router":
        if FLAGS.lora_modules:
            raise ValueError("--lora_modules is for the instances behind the router, not it")
        return await _route()
    if FLAGS.prefill_targets or FLAGS.decode_targets:
        raise ValueError(
            f"--prefill_targets/--decode_targets are for --role=router, not {FLAGS.role}"
        )
    model_dir, kwargs = _engine_args()
    lora_modules = _lora_modules(kwargs)
    template = chat_template(FLAGS.chat_template)  # (checked before the model loads)
    if template is not None and kwargs["skip_tokenizer_init"]:
        raise ValueError("--chat_template needs a tokenizer; --skip_tokenizer_init loads none")
    llm = None

    def make_engine():
        nonlocal llm
        llm = LLM(model_dir, **kwargs)
        tokenizer = llm.tokenizer
        if template is not None:
            tokenizer = tokenizer.with_chat_template(template)
        return llm.engine, tokenizer

    options = _options(FLAGS.role, lora_modules)
    server = JaxServeServer(
        make_engine, options, model_name=FLAGS.served_model_name or default_model_name(model_dir)
    )
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    load = asyncio.create_task(server.load())
    stop = asyncio.create_task(stopping.wait())
    await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # a signal while the model loads
        await server.stop(grace=0)
        _exit_now(0, "stopped before the model finished loading")
    if load.exception() is not None:
        error = load.exception()
        stop.cancel()
        if isinstance(error, LoRAModuleError):  # (its message names the entry and why)
            await server.stop(grace=0)
            raise SystemExit(f"jaxserve serve: {error}")
        logging.error("loading the model failed", exc_info=error)
        await server.stop(grace=0)
        raise SystemExit(f"jaxserve serve: loading the model failed: {error!r}")
    leader = llm.leader  # multi-host: the followers' side of every step
    if leader is not None:
        lost = asyncio.create_task(_until_lost(leader))
        await asyncio.wait({stop, lost}, return_when=asyncio.FIRST_COMPLETED)
        if lost.done():
            await server.stop(grace=0)
            _exit_now(1, f"jaxserve serve: {lost.result()}")
        lost.cancel()
    await stop
    logging.info("draining for up to %.0fs", options.drain_grace_s)
    await server.stop()
    if leader is not None:
        if leader.lost is not None:
            _exit_now(1, f"jaxserve serve: {leader.lost}")
        leader.stop_followers()  # they exit once they have run the steps sent
    logging.info("stopped")


def _engine_args() -> tuple[str, dict]:
    """The model directory and the `LLM` arguments, from the flags."""
    model_dir = resolve_model_dir(FLAGS.model)
    kwargs = engine_kwargs()
    if FLAGS.role == "decode" and not kwargs["kv_offload_bytes"]:
        kwargs["kv_offload_bytes"] = DECODE_TIER_BYTES  # where pushed pages land
    return model_dir, kwargs


def chat_template(value: str | None) -> str | None:
    """--chat_template's template (vLLM's flag): a file's contents, or the value itself
    when it is Jinja; ValueError naming the flag for anything else, or a template that
    does not compile."""
    if not value:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"--chat_template {value!r:.80} is neither a file nor a Jinja template")
    try:
        check_chat_template(template)
    except ValueError as e:
        raise ValueError(f"--chat_template does not compile: {e}") from None
    return template


def _lora_modules(kwargs: dict) -> tuple[LoRAModule, ...]:
    """--lora_modules, parsed; LoRAModuleError naming the flag and the entry for one
    that is malformed, or for any without --enable_lora."""
    modules = tuple(parse_lora_modules(FLAGS.lora_modules))
    if modules and not kwargs["enable_lora"]:
        raise LoRAModuleError(
            f"--lora_modules {FLAGS.lora_modules[0]!r}: serving LoRA adapters needs --enable_lora"
        )
    return modules


def _follow() -> None:
    """A multi-host follower: loads its shards, then runs the leader's steps until the
    leader stops them (exit 0) or is lost (exit 1, naming it). No server, nothing to
    drain: SIGTERM keeps its default action and ends the process."""
    model_dir, kwargs = _engine_args()
    llm = LLM(model_dir, **kwargs)
    try:
        steps = llm.follow()
    except LeaderLostError as e:
        _exit_now(1, f"jaxserve serve: {e}")
    logging.info("the leader stopped; ran %d steps", steps)


async def _until_lost(leader: Leader) -> FollowerLostError:
    """Returns once the multi-host leader has lost a follower."""
    while leader.lost is None:
        await asyncio.sleep(0.5)
    return leader.lost
