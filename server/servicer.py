"""The JaxServe gRPC servicer: thin, it turns messages into engine calls and back.

Every request is validated before it reaches the engine; a bad field is
INVALID_ARGUMENT naming the field, and nothing else is disturbed. Past the
pending-request bound, new requests get RESOURCE_EXHAUSTED. A client that
cancels or disconnects aborts its request (the engine stream's cleanup).
"""

from __future__ import annotations

import itertools

import grpc

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.inputs import ParsedPrompt, parse_prompt
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server import serving
from server.metrics import ServerMetrics
from server.serving import Reason, Refused, ServingState

_CODES = {
    Reason.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}

_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "n",
    "skip_special_tokens",
)


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Builds validated SamplingParams; unset optional fields keep vLLM's defaults."""
    kw = {f: getattr(msg, f) for f in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(f)}
    kw.update(
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        logit_bias=dict(msg.logit_bias) or None,
    )
    if msg.HasField("structured_outputs"):
        kw["structured_outputs"] = _structured_outputs(msg.structured_outputs)
    return SamplingParams(**kw)


def _structured_outputs(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError(
            "structured_outputs must set one of json, json_object, regex, choice, grammar"
        )
    value = getattr(msg, kind)
    return StructuredOutputsParams(**{kind: list(value.choices) if kind == "choice" else value})


def _logprobs_proto(entries: list[dict[int, float]], chosen: list[int]) -> list[pb.TokenLogprobs]:
    out = []
    for entry, token in zip(entries, chosen, strict=True):
        first = [pb.Logprob(token_id=token, logprob=entry[token])]
        rest = [pb.Logprob(token_id=t, logprob=v) for t, v in entry.items() if t != token]
        out.append(pb.TokenLogprobs(entries=first + rest))
    return out


def _prompt_logprobs_proto(out: RequestOutput) -> list[pb.TokenLogprobs]:
    if out.prompt_logprobs is None:
        return []
    ids = out.prompt_token_ids
    return [pb.TokenLogprobs()] + _logprobs_proto(out.prompt_logprobs[1:], ids[1:])


def _messages(msg: pb.ChatMessages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in msg.messages]


def _usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=sum(len(c.token_ids) for c in out.outputs),
        cached_prompt_tokens=out.num_cached_tokens,
    )


class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, state: ServingState, metrics: ServerMetrics):
        self.state = state
        self.metrics = metrics
        self._ids = itertools.count()

    # ---------------------------------------------------------------- helpers

    async def _ready(self, context) -> AsyncLLMEngine:
        try:
            return serving.ready(self.state)
        except Refused as e:
            await context.abort(_CODES[e.reason], e.message)

    async def _invalid(self, context, message: str):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, serving.invalid(self.metrics, message).message
        )

    async def _prompt(self, request, context) -> ParsedPrompt:
        """The request's prompt through the one parser all front ends share."""
        kind = request.WhichOneof("input")
        prompt = {}
        if kind == "prompt":
            prompt = {"prompt": request.prompt}
        elif kind == "prompt_token_ids":
            prompt = {"prompt_token_ids": list(request.prompt_token_ids.ids)}
        elif kind == "messages":
            prompt = {"messages": _messages(request.messages)}
        try:
            return parse_prompt(prompt, self.state.tokenizer)
        except ValueError as e:
            await self._invalid(context, str(e))

    async def _stream(self, request, context):
        """Validates a GenerateRequest; yields (request_id, RequestOutput)."""
        try:
            engine = serving.admit(self.state, self.metrics)
        except Refused as e:
            await context.abort(_CODES[e.reason], e.message)
        prompt = await self._prompt(request, context)
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as e:
            await self._invalid(context, str(e))
        rid = request.request_id or f"req-{next(self._ids)}"
        try:
            async for out in serving.stream(
                engine,
                self.metrics,
                rid,
                prompt,
                params,
                priority=request.priority,
                cache_salt=request.cache_salt or None,
            ):
                yield rid, out
        except Refused as e:
            await context.abort(_CODES[e.reason], e.message)

    # -------------------------------------------------------------------- RPCs

    async def Generate(self, request, context):
        sent_prompt_logprobs = False
        reported: set[int] = set()
        async for rid, out in self._stream(request, context):
            for c in serving.deltas(out, reported):
                msg = self._delta(rid, c, out)
                if not sent_prompt_logprobs:
                    msg.prompt_logprobs.extend(_prompt_logprobs_proto(out))
                    sent_prompt_logprobs = True
                yield msg
            if out.finished:
                yield pb.GenerateResponse(request_id=rid, usage=_usage(out))

    @staticmethod
    def _delta(rid: str, c: CompletionOutput, out: RequestOutput) -> pb.GenerateResponse:
        msg = pb.GenerateResponse(
            request_id=rid, index=c.index, text=c.delta_text, token_ids=c.delta_token_ids
        )
        if c.finished:
            msg.finish_reason = c.finish_reason
            if c.stop_reason is not None:
                msg.stop_reason = str(c.stop_reason)
        if c.logprobs is not None and c.delta_token_ids:
            n = len(c.delta_token_ids)
            msg.logprobs.extend(_logprobs_proto(c.logprobs[-n:], c.delta_token_ids))
        return msg

    async def Complete(self, request, context):
        final, rid = None, ""
        async for request_id, out in self._stream(request, context):
            final, rid = out, request_id
        completions = []
        for c in final.outputs:
            comp = pb.Completion(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                finish_reason=c.finish_reason or "",
                stop_reason="" if c.stop_reason is None else str(c.stop_reason),
            )
            if c.logprobs is not None:
                comp.logprobs.extend(_logprobs_proto(c.logprobs, c.token_ids))
                comp.cumulative_logprob = c.cumulative_logprob
            completions.append(comp)
        return pb.CompleteResponse(
            request_id=rid,
            completions=completions,
            usage=_usage(final),
            prompt_logprobs=_prompt_logprobs_proto(final),
        )

    async def _tokenizer(self, context) -> Tokenizer:
        await self._ready(context)
        if self.state.tokenizer is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this server has no tokenizer (skip_tokenizer_init)",
            )
        return self.state.tokenizer

    async def Tokenize(self, request, context):
        tok = await self._tokenizer(context)
        kind = request.WhichOneof("input")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        if kind == "text":
            return pb.TokenizeResponse(
                token_ids=tok.encode(request.text, add_special_tokens=add_special)
            )
        if kind == "messages":
            try:
                parsed = parse_prompt({"messages": _messages(request.messages)}, tok)
            except ValueError as e:
                await self._invalid(context, str(e))
            return pb.TokenizeResponse(token_ids=parsed.token_ids)
        await self._invalid(context, "one of text or messages is required")

    async def Detokenize(self, request, context):
        tok = await self._tokenizer(context)
        vocab = self.state.engine.model_info.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await self._invalid(
                context, f"token_ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(
            text=tok.decode(list(request.token_ids), skip_special_tokens=skip)
        )

    async def GetModelInfo(self, request, context):
        info = (await self._ready(context)).model_info
        return pb.ModelInfo(
            model=self.state.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            kv_cache_tokens=info.kv_cache_tokens,
            max_num_seqs=info.max_num_seqs,
            dtype=info.dtype,
            block_size=info.block_size,
            kv_cache_dtype=info.kv_cache_dtype,
            quantization=info.quantization or "",
        )
