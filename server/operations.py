"""What the servers can be asked to do, declared once: each operation's name, scope,
HTTP route and gRPC method, and the bytes its request may hold.

Scopes:
- "open": answers without a key, as vLLM's `/health` and `/metrics` (and gRPC's health
  checks and reflection, which are other services);
- "user": inference and what serves it (`--api_key`, when given);
- "admin": what changes the engine for everybody (pause, sleep, weights, adapters,
  caches, profiles). These exist only on a server started with `--admin_api_key`, and
  take only that key; elsewhere they are 404 / UNIMPLEMENTED, as vLLM serves its
  development endpoints only in development mode;
- "peer": another jaxserve instance's traffic (disaggregated serving's `Prefill` and
  `PushKV`): `--peer_api_key`, when given, or a client certificate verified against
  `--peer_tls_ca` (on `--peer_grpc_port`: `server.peer_tls`), checked before any of a
  stream is read.

`server.edge` enforces the table for both servers, before a handler runs or a body is
read; the table is the one place a new operation's scope and limits are declared. An
operation that runs an engine control (`control`: a name in `jaxserve.controls`) is
served from the table alone: its HTTP route and gRPC method take the control's
arguments and answer the engine's state after it (`server.serving.control`).
"""

from __future__ import annotations

import dataclasses
import re

SCOPES = ("open", "user", "admin", "peer")
ADMIN_BODY_BYTES = 64 << 10  # an admin request names a mode, a path, an adapter


@dataclasses.dataclass(frozen=True)
class Operation:
    name: str
    scope: str
    http: tuple[tuple[str, str], ...] = ()  # (method, path) routes
    grpc: tuple[str, ...] = ()  # JaxServe's methods
    # The request's bytes, at most: None for the server's `max_message_bytes` (its
    # gRPC message bound, the HTTP body bound too); a stream's bound is its handler's.
    max_body_bytes: int | None = None
    control: str | None = None  # the engine control its route and method run

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"{self.name}: scope must be one of {SCOPES}, got {self.scope!r}")


def _admin(
    name: str,
    http: tuple[tuple[str, str], ...],
    grpc: tuple[str, ...],
    control: str | None = None,
) -> Operation:
    return Operation(name, "admin", http, grpc, ADMIN_BODY_BYTES, control)


OPERATIONS: tuple[Operation, ...] = (
    Operation("health", "open", (("GET", "/health"),)),
    Operation("metrics", "open", (("GET", "/metrics"),)),
    Operation("models", "user", (("GET", "/v1/models"),), ("GetModelInfo",)),
    Operation("model", "user", (("GET", "/v1/models/{model:path}"),)),
    Operation("completions", "user", (("POST", "/v1/completions"),), ("Complete",)),
    Operation("chat_completions", "user", (("POST", "/v1/chat/completions"),)),
    Operation("responses", "user", (("POST", "/v1/responses"),)),
    Operation("generate", "user", (("POST", "/inference/v1/generate"),), ("Generate",)),
    Operation("tokenize", "user", (("POST", "/tokenize"),), ("Tokenize",)),
    Operation("detokenize", "user", (("POST", "/detokenize"),), ("Detokenize",)),
    # Served with --enable_tokenizer_info_endpoint; without it, 404 (as vLLM's).
    Operation("tokenizer_info", "user", (("GET", "/tokenizer_info"),)),
    _admin("pause", (("POST", "/pause"),), ("PauseGeneration",), "pause_generation"),
    _admin("resume", (("POST", "/resume"),), ("ResumeGeneration",), "resume_generation"),
    _admin("is_paused", (("GET", "/is_paused"),), ("IsPaused",)),
    _admin("sleep", (("POST", "/sleep"),), ("Sleep",), "sleep"),
    _admin("wake_up", (("POST", "/wake_up"),), ("WakeUp",), "wake_up"),
    _admin("is_sleeping", (("GET", "/is_sleeping"),), ("IsSleeping",)),
    _admin("update_weights", (("POST", "/update_weights"),), ("UpdateWeights",), "update_weights"),
    _admin("weight_version", (("GET", "/weight_version"),), ()),
    _admin(
        "reset_prefix_cache",
        (("POST", "/reset_prefix_cache"),),
        ("ResetPrefixCache",),
        "reset_prefix_cache",
    ),
    # Traces of the device work with JAX's profiler (vLLM's and SGLang's routes).
    _admin("start_profile", (("POST", "/start_profile"),), ("StartProfile",), "start_profile"),
    _admin("stop_profile", (("POST", "/stop_profile"),), ("StopProfile",), "stop_profile"),
    _admin("load_lora_adapter", (("POST", "/v1/load_lora_adapter"),), ("LoadLoRAAdapter",)),
    _admin("unload_lora_adapter", (("POST", "/v1/unload_lora_adapter"),), ("UnloadLoRAAdapter",)),
    Operation("prefill", "peer", (), ("Prefill",)),
    Operation("push_kv", "peer", (), ("PushKV",)),
)

BY_ROUTE: dict[tuple[str, str], Operation] = {r: op for op in OPERATIONS for r in op.http}
BY_METHOD: dict[str, Operation] = {m: op for op in OPERATIONS for m in op.grpc}


def _pattern(path: str) -> re.Pattern:
    """A route's path as a regex: "{name}" one segment, "{name:path}" the rest."""
    parts = re.split(r"(\{[^}]+\})", path)
    return re.compile(
        "^"
        + "".join(
            (".+" if p.endswith(":path}") else "[^/]+") if p.startswith("{") else re.escape(p)
            for p in parts
        )
        + "$"
    )


# Routes with a parameter ("/v1/models/{model:path}").
_TEMPLATES = [(m, _pattern(path), op) for (m, path), op in BY_ROUTE.items() if "{" in path]


def route(method: str, path: str) -> Operation | None:
    """The operation an HTTP request names, or None (a route no operation declares). A
    HEAD is its GET's (Starlette answers HEAD by running the GET route)."""
    method = "GET" if method == "HEAD" else method
    op = BY_ROUTE.get((method, path))
    if op is None:
        for m, pattern, candidate in _TEMPLATES:
            if m == method and pattern.match(path):
                return candidate
    return op


def check_table(
    *, http_routes: set[tuple[str, str]] | None = None, grpc_methods: set[str] | None = None
) -> None:
    """Raises unless the table declares exactly the routes (or methods) a server serves:
    a route or method without a scope would be a power with no boundary."""
    missing, stale = [], []
    if http_routes is not None:
        missing += sorted(http_routes - BY_ROUTE.keys())
        stale += sorted(BY_ROUTE.keys() - http_routes)
    if grpc_methods is not None:
        missing += sorted(grpc_methods - BY_METHOD.keys())
        stale += sorted(BY_METHOD.keys() - grpc_methods)
    if missing or stale:
        raise RuntimeError(
            f"server.operations is out of date: not declared {missing}, declared but "
            f"not served {stale}"
        )
