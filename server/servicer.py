"""The JaxServe gRPC servicer: thin, it turns messages into engine calls and back.

Every request is validated before it reaches the engine; a bad field is
INVALID_ARGUMENT naming the field, and nothing else is disturbed. Past the
pending-request bound, new requests get RESOURCE_EXHAUSTED. A client that
cancels or disconnects aborts its request (the engine stream's cleanup).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import grpc

from jaxserve.front import EngineFront, cannot_transfer_kv
from jaxserve.generate_request import GenerateRequest, client_fields
from jaxserve.inputs import ParsedPrompt, parse_prompt
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import (
    FIELDS,
    BeamSearchParams,
    ParamError,
    SamplingParams,
    StructuredOutputsParams,
)
from jaxserve.tokenizer import Tokenizer
from server import disagg, servicer_chat, servicer_lora, serving
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server.openai_api import chat_output
from server.openai_api.chat_output import ChatParsers, ChatReading
from server.openai_api.protocol import BadField
from server.prometheus import ServerMetrics
from server.servicer_lifecycle import LifecycleRPCs
from server.servicer_lora import LoRARPCs
from server.serving import Reason, Refused, ServingState

# The trailing metadata key of an INVALID_ARGUMENT's field ("temperature", ...).
FIELD_METADATA = "jaxserve-invalid-field"

_CODES = {
    Reason.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.FAILED: grpc.StatusCode.INTERNAL,
}


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Builds validated SamplingParams from the message's field of the same name for
    every `SamplingParams` field (`test_server.py` checks the message has them all):
    an unset optional field keeps vLLM's default, a repeated or map field its
    contents, a plain field its value."""
    kw: dict = {}
    for name in FIELDS:
        field = msg.DESCRIPTOR.fields_by_name[name]
        value = getattr(msg, name)
        if name == "structured_outputs":
            if msg.HasField(name):
                kw[name] = _structured_outputs(value)
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            kw[name] = dict(value) or None
        elif field.is_repeated:
            kw[name] = list(value)
        elif not field.has_presence or msg.HasField(name):
            kw[name] = value
    return SamplingParams(**kw)


_EARLY_STOPPING = {"": False, "false": False, "true": True, "never": "never"}


def beam_search_from_proto(msg: pb.BeamSearch, params: SamplingParams) -> BeamSearchParams:
    """A BeamSearch message, with the request's max_tokens, temperature and ignore_eos;
    ParamError naming the field if a value is bad."""
    if msg.early_stopping not in _EARLY_STOPPING:
        raise ParamError(
            "beam_search.early_stopping",
            'beam_search.early_stopping must be "", "false", "true" or "never", '
            f"got {msg.early_stopping!r}",
        )
    if params.max_tokens is None:
        raise ParamError("max_tokens", "beam search needs max_tokens")
    return BeamSearchParams(
        beam_width=msg.beam_width,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        temperature=params.temperature,
        length_penalty=msg.length_penalty if msg.HasField("length_penalty") else 1.0,
        include_stop_str_in_output=params.include_stop_str_in_output,
        early_stopping=_EARLY_STOPPING[msg.early_stopping],
    )


def _structured_outputs(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ParamError(
            "structured_outputs",
            "structured_outputs must set one of json, json_object, regex, choice, grammar",
        )
    value = getattr(msg, kind)
    return StructuredOutputsParams(**{kind: list(value.choices) if kind == "choice" else value})


def _logprobs_proto(entries: list[dict[int, float]], chosen: list[int]) -> list[pb.TokenLogprobs]:
    out = []
    for entry, token in zip(entries, chosen, strict=True):
        first = [_logprob_proto(token, entry[token])]
        rest = [_logprob_proto(t, v) for t, v in entry.items() if t != token]
        out.append(pb.TokenLogprobs(entries=first + rest))
    return out


def _logprob_proto(token: int, value: float) -> pb.Logprob:
    """A `Logprob`'s message, its rank where known."""
    return pb.Logprob(token_id=token, logprob=value, rank=getattr(value, "rank", None))


def _prompt_logprobs_proto(out: RequestOutput) -> list[pb.TokenLogprobs]:
    if out.prompt_logprobs is None:
        return []
    ids = out.prompt_token_ids
    return [pb.TokenLogprobs()] + _logprobs_proto(out.prompt_logprobs[1:], ids[1:])


def _usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=sum(len(c.token_ids) for c in out.outputs),
        cached_prompt_tokens=out.num_cached_tokens,
    )


class JaxServeServicer(LifecycleRPCs, LoRARPCs, pb_grpc.JaxServeServicer):  # pause, LoRA: bases
    def __init__(
        self,
        state: ServingState,
        metrics: ServerMetrics,
        *,
        max_message_bytes: int = 4 << 20,
        parsers: ChatParsers | None = None,
        peer_api_key: str | None = None,
        peer_credentials: grpc.ChannelCredentials | None = None,
    ):
        self.state = state
        self.peer_api_key = peer_api_key  # sent with PushKV (None: the caller's key)
        self.peer_credentials = peer_credentials  # PushKV's TLS (None: plaintext)
        self.metrics = metrics
        self.parsers = parsers or ChatParsers()
        self.max_message_bytes = max_message_bytes
        self._ids = itertools.count()

    # ---------------------------------------------------------------- helpers

    async def _ready(self, context) -> EngineFront:
        try:
            return serving.ready(self.state)
        except Refused as e:
            await self._abort(context, e)

    async def _invalid(self, context, error: ValueError | str):
        """Aborts INVALID_ARGUMENT with `error`'s message, and its field (a request
        field's name, `ParamError.field`) as trailing metadata when it names one."""
        field = getattr(error, "field", None) or getattr(error, "param", None)
        await self._abort(context, serving.invalid(self.metrics, str(error), field))

    @staticmethod
    async def _abort(context, refused: Refused):
        metadata = ((FIELD_METADATA, refused.param),) if refused.param else ()
        await context.abort(_CODES[refused.reason], refused.message, trailing_metadata=metadata)

    async def _prompt(self, request, context, chat_kwargs=None) -> ParsedPrompt:
        """The request's prompt through the one parser all front ends share."""
        kind = request.WhichOneof("input")
        prompt = {}
        if kind == "prompt":
            prompt = {"prompt": request.prompt}
        elif kind == "prompt_token_ids":
            prompt = {"prompt_token_ids": list(request.prompt_token_ids.ids)}
        try:
            if kind == "messages":
                prompt = {"messages": servicer_chat.messages(request.messages)}
            # Off the event loop: a long prompt takes seconds to tokenize, and every
            # other call on this server would wait meanwhile.
            return await asyncio.to_thread(
                parse_prompt, prompt, self.state.tokenizer, chat_template_kwargs=chat_kwargs
            )
        except ValueError as e:
            await self._invalid(context, e)
        except TypeError as e:  # a chat_template_kwargs key the template owns
            await self._invalid(context, BadField("chat_template_kwargs", str(e)))

    async def _request(
        self, request, context, params: SamplingParams | None = None
    ) -> tuple[GenerateRequest, ChatReading | None]:
        """The engine's request for a GenerateRequest message (with `params` if they
        were parsed already), and how a chat's reply is read (tools, reasoning);
        INVALID_ARGUMENT for a bad prompt, tool or sampling field (the engine checks
        the rest)."""
        try:
            reading = servicer_chat.reading(self.parsers, self.state.tokenizer, request)
            kwargs = None if reading is None else servicer_chat.template_kwargs(request)
        except BadField as e:
            await self._invalid(context, e)
        prompt = await self._prompt(request, context, kwargs)
        if params is None:
            params = await self._params(request, context)
        if reading is not None:
            try:
                params = reading.sampling_params(params, prompt.text, "structured_outputs")
            except BadField as e:
                await self._invalid(context, e)
        lora = await self._lora(request, context)
        resume = beam = None
        if request.HasField("resume"):
            resume = disagg.resume_from_proto(request.resume)
        if request.HasField("beam_search"):
            try:
                beam = beam_search_from_proto(request.beam_search, params)
            except ValueError as e:
                await self._invalid(context, e)
        gen = GenerateRequest(
            request.request_id or f"req-{next(self._ids)}",
            prompt.token_ids,
            params,
            prompt=prompt.text,
            **client_fields(request),
            resume=resume,
            beam=beam,
            lora=lora,
        )
        return gen, reading

    async def _stream(self, request, context, gen: GenerateRequest | None = None):
        """Validates a GenerateRequest message (or runs `gen`, built from one); yields
        (request_id, RequestOutput, how a chat's reply is read)."""
        try:
            engine = serving.admit(self.state, self.metrics)
        except Refused as e:
            await self._abort(context, e)
        reading = None
        if gen is None:
            gen, reading = await self._request(request, context)
        try:
            async for out in serving.stream(engine, self.metrics, gen):
                yield gen.request_id, out, reading
        except Refused as e:
            await self._abort(context, e)

    async def _params(self, request, context) -> SamplingParams:
        try:
            return sampling_params_from_proto(request.sampling_params)
        except ValueError as e:
            await self._invalid(context, e)

    # -------------------------------------------------------------------- RPCs

    async def Generate(self, request, context):
        sent_prompt_logprobs = False
        reported: set[int] = set()
        readers: dict[int, chat_output.ChoiceReader | None] = {}
        async for rid, out, reading in self._stream(request, context):
            for c in serving.deltas(out, reported):
                msg = self._delta(rid, c, out)
                if reading is not None:
                    if c.index not in readers:
                        readers[c.index] = reading.choice()
                    reader = readers[c.index]
                    if reader is not None:
                        events = reader.step(c.delta_text, c.finish_reason)
                        if c.finished:
                            msg.finish_reason = (
                                chat_output.finish_reason(c.finish_reason, reader) or ""
                            )
                        servicer_chat.set_delta(msg, events)
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
            msg.weight_version = out.weight_version
            msg.first_weight_version = out.first_weight_version
        if c.logprobs is not None and c.delta_token_ids:
            n = len(c.delta_token_ids)
            msg.logprobs.extend(_logprobs_proto(c.logprobs[-n:], c.delta_token_ids))
        return msg

    async def Complete(self, request, context):
        final, rid, reading = None, "", None
        async for request_id, out, read in self._stream(request, context):
            final, rid, reading = out, request_id, read
        completions = []
        for c in final.outputs:
            comp = pb.Completion(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                finish_reason=c.finish_reason or "",
                stop_reason="" if c.stop_reason is None else str(c.stop_reason),
                weight_version=final.weight_version,
                first_weight_version=final.first_weight_version,
            )
            if c.logprobs is not None:
                comp.logprobs.extend(_logprobs_proto(c.logprobs, c.token_ids))
                comp.cumulative_logprob = c.cumulative_logprob
            reader = None if reading is None else reading.choice()
            if reader is not None:
                servicer_chat.set_whole(comp, reader.read(c.text, c.finish_reason))
                comp.finish_reason = chat_output.finish_reason(c.finish_reason, reader) or ""
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
        # Off the event loop (a long prompt held every stream).
        if kind == "text":
            ids = await asyncio.to_thread(tok.encode, request.text, add_special_tokens=add_special)
            return pb.TokenizeResponse(token_ids=ids)
        if kind == "messages":
            try:
                messages = {"messages": servicer_chat.messages(request.messages)}
                parsed = await asyncio.to_thread(parse_prompt, messages, tok)
            except ValueError as e:
                await self._invalid(context, e)
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
        ids = list(request.token_ids)
        text = await asyncio.to_thread(tok.decode, ids, skip_special_tokens=skip)
        return pb.DetokenizeResponse(text=text)

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
            tensor_parallel_size=info.tensor_parallel_size,
            data_parallel_size=info.data_parallel_size,
            num_devices=info.num_devices,
            num_processes=info.num_processes,
            kv_cache_bytes_per_device=info.kv_cache_bytes_per_device,
            kv_cache_dtype=info.kv_cache_dtype,
            quantization=info.quantization or "",
            lora_adapters=servicer_lora.adapters_proto(self.state),
        )

    # ------------------------------------------- disaggregated serving (disagg.py)

    async def _transferring(self, context) -> EngineFront:
        """The engine, if it is ready and can export and import KV pages (a front that
        cannot is refused the prefill and decode roles at start-up; these RPCs of a
        `both` server over it are FAILED_PRECONDITION)."""
        engine = await self._ready(context)
        if not engine.model_info.can_transfer_kv:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{cannot_transfer_kv(engine)}: disaggregated serving needs an instance "
                "of one engine (data_parallel_size=1)",
            )
        return engine

    async def Prefill(self, request, context):
        why = disagg.check_decode_target(request.decode_target)
        if why is not None:
            await self._invalid(context, BadField("decode_target", why))
        msg = request.request
        params = await self._params(msg, context)
        why = disagg.can_disaggregate(params, msg.HasField("beam_search"))
        if why is not None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{why}: run this request on one instance"
            )
        engine = await self._transferring(context)
        if msg.tools:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "tools: run this request on one instance"
            )
        gen, _ = await self._request(msg, context, params)
        try:  # the whole request, before the one-token run that checks only its first token
            engine.validate(gen)
        except ValueError as e:
            await self._invalid(context, e)
        first = dataclasses.replace(gen, params=disagg.first_token_params(gen.params))
        final, rid = None, ""
        async for request_id, out, _ in self._stream(msg, context, first):
            final, rid = out, request_id
        limit = engine.model_info.max_model_len
        max_tokens = params.max_tokens or limit - len(final.prompt_token_ids)
        going = disagg.going_on(final, max_tokens)
        reply = pb.PrefillResponse(
            messages=[
                self._delta(rid, disagg.whole(c), final) for c in final.outputs if c not in going
            ],
            usage=_usage(final),
            prompt_logprobs=_prompt_logprobs_proto(final),
        )
        if not going:
            return reply
        for c in going:
            sample = pb.ResumedSample(index=c.index, token_ids=c.token_ids)
            if c.logprobs is not None:
                sample.logprobs.extend(_logprobs_proto(c.logprobs, c.token_ids))
            reply.resume.samples.append(sample)
        pages = await engine.control(
            "export_prefix", token_ids=gen.prompt_token_ids, salt=gen.cache_salt, lora=gen.lora
        )
        try:
            reply.pages_pushed = await disagg.push(
                request.decode_target,
                pages,
                max_message_bytes=self.max_message_bytes,
                metadata=disagg.peer_metadata(self.peer_api_key, disagg.auth_metadata(context)),
                credentials=self.peer_credentials,
            )
        except grpc.RpcError as e:
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"pushing {len(pages)} KV pages to decode instance {request.decode_target} "
                f"failed: {e.code().name}: {e.details()}",
            )
        return reply

    async def PushKV(self, request_iterator, context):
        """Bounded before it is read: refused at once without a tier to keep pages in,
        and as soon as the stream passes the tier's bytes."""
        engine = await self._transferring(context)
        bound = engine.model_info.kv_tier_bytes
        if not bound:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this instance has no KV tier to receive pages in (kv_offload_bytes)",
            )
        pages, size = [], 0
        async for msg in request_iterator:
            size += sum(len(page) for page in msg.pages)
            if size > bound:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the pushed pages pass {bound} bytes, this instance's KV tier",
                )
            pages.extend(msg.pages)
        try:
            kept = await engine.control("import_pages", pages=pages)
        except ValueError as e:  # a bad page (none kept), or no tier to keep them in
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.PushKVResponse(pages=kept)
