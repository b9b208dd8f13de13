"""The streaming clients of `jaxserve bench --mode=serving`: gRPC (`Generate`) or the
OpenAI-compatible HTTP API (`/v1/completions` with `stream`), behind one interface.

`open_client(protocol, target)` yields `stream(request_id, prompt_ids, max_tokens,
ignore_eos)`, an async iterator of how many tokens each message carried;
`model_limits(protocol, target)` asks the server for (vocab_size, max_model_len).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable

PROTOCOLS = ("grpc", "http")

Stream = Callable[[str, list[int], int, bool], AsyncIterator[int]]


@contextlib.asynccontextmanager
async def open_client(protocol: str, target: str) -> AsyncIterator[Stream]:
    if protocol == "grpc":
        async with _grpc(target) as stream:
            yield stream
    else:
        async with _http(target) as stream:
            yield stream


async def model_limits(protocol: str, target: str) -> tuple[int, int]:
    """The server's vocabulary size and max_model_len, so prompts fit them."""
    if protocol == "grpc":
        import grpc

        from server import jaxserve_pb2 as pb
        from server import jaxserve_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(target) as channel:
            info = await pb_grpc.JaxServeStub(channel).GetModelInfo(pb.GetModelInfoRequest())
            return info.vocab_size, info.max_model_len
    import httpx

    async with httpx.AsyncClient(base_url=_base_url(target), timeout=60) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        card = response.json()["data"][0]
        return card["vocab_size"], card["max_model_len"]


@contextlib.asynccontextmanager
async def _grpc(target: str) -> AsyncIterator[Stream]:
    import grpc

    from server import jaxserve_pb2 as pb
    from server import jaxserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.JaxServeStub(channel)

        async def stream(request_id, prompt_ids, max_tokens, ignore_eos):
            request = pb.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=pb.TokenIds(ids=prompt_ids),
                sampling_params=pb.SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos
                ),
            )
            async for msg in stub.Generate(request):
                if msg.token_ids:
                    yield len(msg.token_ids)

        yield stream


@contextlib.asynccontextmanager
async def _http(target: str) -> AsyncIterator[Stream]:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=_base_url(target), timeout=None, limits=limits) as c:

        async def stream(request_id, prompt_ids, max_tokens, ignore_eos):
            body = {
                "prompt": prompt_ids,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": ignore_eos,
                "stream": True,
                "return_token_ids": True,  # tokens per chunk, as gRPC's messages carry
            }
            async with c.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise RuntimeError(
                        f"{request_id}: HTTP {response.status_code}: {response.text}"
                    )
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            raise RuntimeError(f"{request_id}: {event['error']['message']}")
                        for choice in event["choices"]:
                            if choice["token_ids"]:
                                yield len(choice["token_ids"])

        yield stream


def _base_url(target: str) -> str:
    return target if target.startswith(("http://", "https://")) else f"http://{target}"
