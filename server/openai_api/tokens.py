"""Tokens in, tokens out: `POST /inference/v1/generate`, vLLM's endpoint of that name.

The request gives the prompt's token ids and `sampling_params` by `SamplingParams`'
own names (a name it does not have is refused, not ignored); the reply gives each
sample's token ids, their logprobs (as the engine's `logprobs_mode` says, which the
reply names), finish reason, the prompt logprobs if asked, usage, and the weight
versions that sampled the tokens (`RequestOutput.weight_version`,
`first_weight_version`: a rollout is on-policy for one version when they are equal).

No text on this path: requests run with `detokenize=False` unless they set it
(stop strings need it), and logprobs name tokens by id, as vLLM's: `"token":
"token_id:N"`, with the integer beside it as `"token_id"`. A value JSON cannot hold
(-inf: a token the processed distribution excludes) is sent as -9999.0, vLLM's
convention. With `stream`, the same pieces as server-sent events, per step.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from jaxserve.front import EngineFront
from jaxserve.generate_request import GenerateRequest, client_fields
from jaxserve.inputs import parse_prompt
from jaxserve.lora import LoRARequest
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import FIELDS, SamplingParams, StructuredOutputsParams
from server import serving
from server.openai_api.completions import (
    _ERROR_TYPES,
    _MIN_LOGPROB,
    OpenAIServing,
    _event,
    _usage,
    error_body,
)
from server.openai_api.protocol import BadField, ClientFields, StreamOptions
from server.serving import Refused


class GenerateTokensRequest(ClientFields):
    """vLLM's `GenerateRequest` (tokens in, tokens out)."""

    model: str | None = None
    request_id: str | None = None  # default: a fresh one
    token_ids: list[int]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def params(self) -> SamplingParams:
        """The validated SamplingParams; errors name `sampling_params.<field>`."""
        sp = dict(self.sampling_params)
        unknown = sorted(set(sp) - set(FIELDS))
        if unknown:
            raise BadField(
                f"sampling_params.{unknown[0]}",
                f"unknown sampling parameters {unknown}; known: {list(FIELDS)}",
            )
        sp.setdefault("detokenize", False)
        so = sp.get("structured_outputs")
        if so is not None:
            if not isinstance(so, dict):
                raise BadField(
                    "sampling_params.structured_outputs", "structured_outputs must be an object"
                )
            try:
                sp["structured_outputs"] = StructuredOutputsParams(**so)
            except (TypeError, ValueError) as e:
                raise BadField("sampling_params.structured_outputs", str(e)) from None
        if isinstance(sp.get("logit_bias"), dict):  # JSON object keys are strings
            try:
                sp["logit_bias"] = {int(t): v for t, v in sp["logit_bias"].items()}
            except ValueError:
                raise BadField(
                    "sampling_params.logit_bias", "logit_bias keys must be token ids"
                ) from None
        try:
            return SamplingParams(**sp)
        except ValueError as e:
            field = getattr(e, "field", None)
            raise BadField(
                f"sampling_params.{field}" if field else "sampling_params", str(e)
            ) from None


@dataclasses.dataclass
class TokensJob:
    """One request, validated: what `respond` and `stream` run."""

    engine: EngineFront
    request: GenerateRequest
    stream_options: StreamOptions | None
    logprobs_mode: str  # the engine's: what the values are
    model: str  # as the replies name it: the served model's name, or the adapter's
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class TokensServing:
    """The endpoint's work, on `OpenAIServing`'s state and metrics."""

    def __init__(self, openai: OpenAIServing):
        self.state, self.metrics = openai.state, openai.metrics

    def job(self, body: GenerateTokensRequest, lora: LoRARequest | None = None) -> TokensJob:
        """The request validated before anything is queued; Refused (400) names the
        field as this request does. `lora`: the adapter its model names."""
        engine = serving.admit(self.state, self.metrics)
        rid = body.request_id or f"gen-{uuid.uuid4().hex}"
        try:
            params = body.params()
            prompt = parse_prompt({"prompt_token_ids": body.token_ids}, None)
            request = GenerateRequest(
                rid,
                prompt.token_ids,
                params,
                **client_fields(body),
                lora=lora,
            )
            engine.validate(request)
        except BadField as e:
            raise serving.invalid(self.metrics, str(e), e.param) from None
        except ValueError as e:
            raise serving.invalid(self.metrics, str(e), _param(getattr(e, "field", None))) from None
        info = engine.model_info
        model = self.state.model_name if lora is None else lora.lora_name
        return TokensJob(engine, request, body.stream_options, info.logprobs_mode, model)

    async def respond(self, job: TokensJob) -> dict:
        final = None
        async for out in serving.stream(job.engine, self.metrics, job.request):
            final = out
        assert final is not None and final.finished
        k = job.request.params.logprobs
        return {
            **self._head(job, final),
            "choices": [
                {
                    "index": c.index,
                    "token_ids": list(c.token_ids),
                    "logprobs": _logprobs(c.token_ids, c.logprobs, k),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in final.outputs
            ],
            "prompt_logprobs": _prompt_logprobs(final),
            "usage": _usage([final]),
        }

    async def stream(self, job: TokensJob) -> AsyncIterator[str]:
        """A chunk per step with each sample's new tokens (and its finish); the first
        chunk also has the prompt logprobs, if asked; then the usage chunk if asked
        for, then `[DONE]`. An engine that fails mid-stream ends it with an error."""
        k = job.request.params.logprobs
        reported: set[int] = set()
        final, first = None, True
        try:
            async for out in serving.stream(job.engine, self.metrics, job.request):
                final = out
                choices = [_delta(c, k) for c in serving.deltas(out, reported)]
                if not choices:
                    continue
                chunk = {**self._head(job, out), "choices": choices}
                if first and job.request.params.prompt_logprobs is not None:
                    chunk["prompt_logprobs"] = _prompt_logprobs(out)
                first = False
                yield _event(chunk)
        except Refused as e:
            yield _event(error_body(e.message, _ERROR_TYPES[e.reason][1], e.param))
        else:
            options = job.stream_options
            if options is not None and options.include_usage and final is not None:
                yield _event({**self._head(job, final), "choices": [], "usage": _usage([final])})
        yield "data: [DONE]\n\n"

    def _head(self, job: TokensJob, out: RequestOutput) -> dict:
        return {
            "request_id": out.request_id,
            "created": job.created,
            "model": job.model,
            "logprobs_mode": job.logprobs_mode,
            "weight_version": out.weight_version,
            "first_weight_version": out.first_weight_version,
        }


def _param(field: str | None) -> str | None:
    """The engine's name for a refused field, as this request names it."""
    if field in ("prompt_token_ids", "prompt"):
        return "token_ids"
    if field in FIELDS:
        return f"sampling_params.{field}"
    return field


def _value(v: float) -> float:
    return max(v, _MIN_LOGPROB)


def _token(token: int, value: float) -> dict:
    return {"token": f"token_id:{token}", "token_id": token, "logprob": _value(value)}


def _logprobs(tokens, entries: list[dict[int, float]] | None, k: int | None) -> dict | None:
    """vLLM's logprobs `content`: per token its value and the top k of its step."""
    if entries is None:
        return None
    content = []
    for token, entry in zip(tokens, entries, strict=True):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[: k or 0]
        content.append(
            {**_token(token, entry[token]), "top_logprobs": [_token(t, v) for t, v in top]}
        )
    return {"content": content}


def _delta(c: CompletionOutput, k: int | None) -> dict:
    n = len(c.delta_token_ids)
    entries = None if c.logprobs is None else c.logprobs[len(c.logprobs) - n :]
    return {
        "index": c.index,
        "token_ids": list(c.delta_token_ids),
        "logprobs": _logprobs(c.delta_token_ids, entries, k),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def _prompt_logprobs(out: RequestOutput) -> list[dict[str, dict] | None] | None:
    """vLLM's: None for the first prompt token, then {token id: {"logprob": v}}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None if e is None else {str(t): {"logprob": _value(v)} for t, v in e.items()}
        for e in out.prompt_logprobs
    ]
