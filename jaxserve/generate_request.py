"""One request as a front end builds it: `GenerateRequest`.

A front end (`LLM.generate`, the gRPC servicer, the HTTP handlers, the CLI) builds
it once; every layer below (`jaxserve.front.EngineFront`: the async engine, the
data-parallel router, a Ray replica and its actor) passes it on unchanged down to
`LLMEngine.add_request`. A new per-request input (say, a LoRA adapter) is a field
here plus the code that reads it; the layers between need no change.

The engine validates the fields (`jaxserve.engine.validate_request`, errors naming
the field and the value): this type only puts the sequences into tuples, so that a
request cannot change on its way down.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import BeamSearchParams, SamplingParams


@dataclasses.dataclass(frozen=True)
class ResumedSample:
    """A sample another instance started (disaggregated prefill): its tokens so far and,
    if the request asks for logprobs, their entries ({token id: logprob}, chosen included)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """What to generate: the prompt's token ids (and its text, if it had one), how to
    sample, and how to serve it.

    `priority`: lower runs first (vLLM's convention). `cache_salt`: requests with
    different salts never share prefix-cache pages (tenants). `resume` (disaggregated
    decode): continue only these samples, from the tokens another instance sampled
    for them, after it pushed the prompt's KV pages here. `lora`: serve it with this
    LoRA adapter (an engine with enable_lora); None: the base model. `beam`: generate
    by beam search instead of sampling (`jaxserve.engine.beams`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    resume: tuple[ResumedSample, ...] | None = None
    lora: LoRARequest | None = None
    # A beam search (`LLM.beam_search`, HTTP `use_beam_search`): `params` then say only
    # how text is made (and are checked for settings a beam search cannot honour).
    beam: BeamSearchParams | None = None

    def __post_init__(self):
        # Integer-like ids (numpy's) become ints; anything else stays as it is, for
        # the engine's validation to name.
        ids = tuple(
            int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t
            for t in self.prompt_token_ids
        )
        object.__setattr__(self, "prompt_token_ids", ids)
        if self.resume is not None:
            object.__setattr__(self, "resume", tuple(self.resume))


# The fields of GenerateRequest a client sets, on every front end: the HTTP bodies
# take them by these names and types (`server.openai_api.protocol.ClientFields`),
# gRPC's GenerateRequest has a field of each name, and every front end passes them on
# with `client_fields`. A new one is a GenerateRequest field, its name here, the
# proto's field, and the engine's code that reads it.
CLIENT_FIELDS = ("priority", "cache_salt")


@functools.cache
def client_field_types() -> dict[str, tuple[Any, Any]]:
    """Each client field's (type, default), from GenerateRequest's declaration."""
    hints = typing.get_type_hints(GenerateRequest)
    defaults = {f.name: f.default for f in dataclasses.fields(GenerateRequest)}
    return {name: (hints[name], defaults[name]) for name in CLIENT_FIELDS}


def client_fields(source: Any) -> dict[str, Any]:
    """The client fields `source` (an HTTP body, a gRPC message) carries, by name, as
    GenerateRequest's keyword arguments. An empty string is the field unset (gRPC
    cannot tell the two apart)."""
    out = {}
    for name, (_, default) in client_field_types().items():
        value = getattr(source, name, default)
        out[name] = default if value is None or value == "" else value
    return out
