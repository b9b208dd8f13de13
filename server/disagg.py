"""Disaggregated prefill/decode, the instances' side (the router is server/router.py).

A prefill instance answers `Prefill`: it runs the request for one token per
sample (`max_tokens=1`), exports the prompt's full KV pages from its pool
(`LLMEngine.export_prefix`) and pushes them to the decode instance the router
chose (`PushKV`, a client stream of chunks, each under the message limit); then
it tells the router which samples already finished (their messages, as one
engine would have sent them) and which go on (`Resume`: their tokens so far).
A decode instance keeps pushed pages in its host KV tier after checking every
one (`LLMEngine.import_pages`), and runs the resumed request (`Generate` with
`resume`); its prefix lookup finds the pages there, so only the prompt's last
partial page and the first token are computed again.

A push that fails (the decode instance is down, refuses the pages, times out)
is answered ABORTED, which the router reads as "choose another decode
instance"; anything else is the prefill's own failure.
"""

from __future__ import annotations

import dataclasses
import re

import grpc

from jaxserve.front import EngineFront, cannot_transfer_kv
from jaxserve.generate_request import ResumedSample
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc

PUSH_TIMEOUT_S = 60.0
AUTH_KEYS = ("authorization", "x-api-key")
# An instance's roles, and what each needs of its engine front beyond serving requests.
ROLES = {
    "both": None,  # Prefill and PushKV too, where the front can
    "prefill": "export the prompt's KV pages to push them to a decode instance",
    "decode": "import the KV pages a prefill instance pushes",
}


def check_role(front: EngineFront, role: str) -> None:
    """Raises ValueError naming the role and the front if the front cannot serve it:
    at start-up, not at every call."""
    needs = ROLES[role]
    if needs is not None and not front.model_info.can_transfer_kv:
        raise ValueError(
            f"role {role!r} needs an engine front that can {needs}; "
            f"{cannot_transfer_kv(front)}: serve the {role} role with data_parallel_size=1 "
            "(one instance per replica)"
        )


def can_disaggregate(params: SamplingParams, beam_search: bool = False) -> str | None:
    """Why a request must run on one instance (None: it may be split). min_tokens > 1
    changes what stops the first token; a grammar's state does not travel, nor do a
    beam search's beams (they share one instance's pages). A LoRA adapter's request is
    split: its pages are exported under its adapter, and the decode instance (serving
    the same adapter under the same name) finds them for it."""
    if beam_search:
        return "beam_search"
    if params.min_tokens > 1:
        return "min_tokens > 1"
    if params.structured_outputs is not None:
        return "structured_outputs"
    return None


def first_token_params(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=1)


def going_on(out: RequestOutput, max_tokens: int) -> list[CompletionOutput]:
    """The samples a decode instance continues: those the one-token run cut short."""
    return [c for c in out.outputs if c.finish_reason == "length" and max_tokens > 1]


def whole(c: CompletionOutput) -> CompletionOutput:
    """A finished sample as one message (n > 1 samples finish in different steps)."""
    return dataclasses.replace(c, delta_text=c.text, delta_token_ids=list(c.token_ids))


def auth_metadata(context) -> tuple[tuple[str, str], ...]:
    """The caller's credentials, passed on to the instances it reaches through us."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ()) if k in AUTH_KEYS)


def peer_metadata(peer_api_key: str | None, caller) -> tuple[tuple[str, str], ...]:
    """The credentials of a peer operation (Prefill, PushKV) sent to another instance:
    the peer key when one is set, else the caller's (`auth_metadata`: checked there as
    its api_key)."""
    if peer_api_key is not None:
        return (("authorization", f"Bearer {peer_api_key}"),)
    return caller


def resume_from_proto(msg: pb.Resume) -> list[ResumedSample]:
    return [
        ResumedSample(
            s.index,
            list(s.token_ids),
            [{e.token_id: _logprob(e) for e in lp.entries} for lp in s.logprobs] or None,
        )
        for s in msg.samples
    ]


def _logprob(entry: pb.Logprob) -> Logprob:
    return Logprob(entry.logprob, entry.rank if entry.HasField("rank") else None)


def chunks(pages: list[bytes], max_bytes: int):
    """KVPages messages of whole pages, each under `max_bytes` where a page allows."""
    batch, size = [], 0
    for page in pages:
        if batch and size + len(page) > max_bytes:
            yield pb.KVPages(pages=batch)
            batch, size = [], 0
        batch.append(page)
        size += len(page)
    if batch:
        yield pb.KVPages(pages=batch)


# A decode instance's gRPC address: HOST:PORT (a name, an IPv4 or a bracketed IPv6).
_TARGET = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


def check_decode_target(target: str) -> str | None:
    """Why `target` is not a decode instance's address (HOST:PORT), or None. Checked
    before the prefill: an address gRPC cannot dial left the push waiting its whole
    timeout."""
    match = _TARGET.fullmatch(target)
    if match is None or not 0 < int(match.group(1)) < 65536:
        return f"decode_target must be HOST:PORT, got {target[:100]!r}"
    return None


def channel(target: str, credentials: grpc.ChannelCredentials | None, options=()):
    """A channel to another instance: TLS with `credentials` (`server.peer_tls`: the
    deployment CA, this instance's client certificate), else plaintext."""
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


async def push(
    target: str,
    pages: list[bytes],
    *,
    max_message_bytes: int,
    metadata=(),
    credentials: grpc.ChannelCredentials | None = None,
) -> int:
    """Streams `pages` to `target`'s PushKV (over TLS with `credentials`); the pages it
    kept. Raises grpc.RpcError."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    async with channel(target, credentials, options) as peer:
        stub = pb_grpc.JaxServeStub(peer)
        reply = await stub.PushKV(
            chunks(pages, max_message_bytes // 2), metadata=metadata, timeout=PUSH_TIMEOUT_S
        )
    return reply.pages
