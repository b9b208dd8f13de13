"""Completions and chat completions: requests to engine streams, outputs to OpenAI JSON.

Each prompt of a request is one engine request (`server.serving.stream`); a
completions request with several prompts runs them side by side, its choices
numbered prompt by prompt (`prompt_index * n + sample`), as OpenAI does. Every
prompt is validated before any is queued, so a stream either fails with its
status code up front or starts; an engine that dies mid-stream ends it with an
error event.

Each choice's last JSON (the choice, or its stream's chunk with the finish_reason)
also says which weights sampled it, beside vLLM's `stop_reason`: `weight_version` (the
last token's) and `first_weight_version` (the first's); they differ when the weights
were updated while it ran (`LLMEngine.update_weights`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from jaxserve.front import EngineFront
from jaxserve.generate_request import GenerateRequest, client_fields
from jaxserve.inputs import ParsedPrompt, parse_prompt
from jaxserve.lora import LoRARequest
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from server import serving
from server.openai_api import chat_output
from server.openai_api.chat_output import ChatParsers, ChatReading
from server.openai_api.protocol import BadField, ChatCompletionRequest, CompletionRequest
from server.prometheus import ServerMetrics
from server.serving import Reason, Refused, ServingState

# JSON has no -inf: a logprob below this is reported as this (vLLM's convention).
_MIN_LOGPROB = -9999.0


@dataclasses.dataclass
class _Job:
    """One HTTP request's engine requests, ready to run."""

    request_id: str
    engine: EngineFront
    prompts: list[ParsedPrompt]
    requests: list[GenerateRequest]  # one per prompt
    params: SamplingParams
    body: CompletionRequest | ChatCompletionRequest
    model: str  # as the replies name it: the served model's name, or the adapter's
    reading: ChatReading | None = None  # chat: how its replies are read
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class OpenAIServing:
    def __init__(
        self, state: ServingState, metrics: ServerMetrics, parsers: ChatParsers | None = None
    ):
        self.state = state
        self.metrics = metrics
        self.parsers = parsers or ChatParsers()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ admission

    def _job(
        self,
        prefix: str,
        body,
        prompts: list,
        lora: LoRARequest | None,
        chat_kwargs=None,
        reading=None,
    ) -> _Job:
        """Validates everything a request can get wrong before anything is queued;
        `lora`: the adapter its model names (`ServingState.lora_of`)."""
        body.check_unsupported()
        engine = serving.admit(self.state, self.metrics, extra=len(prompts) - 1)
        prompt_field = "messages" if chat_kwargs is not None else "prompt"
        names = {"prompt_token_ids": prompt_field, "prompt": prompt_field}
        rid = f"{prefix}-{uuid.uuid4().hex[:16]}{next(self._ids)}"
        try:
            params, renamed = body.sampling_params()
            names.update(renamed)
            echo = isinstance(body, CompletionRequest) and body.echo
            if echo and params.logprobs is not None:  # echoed prompt tokens get logprobs too
                params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
            parsed = []
            for p in prompts:
                try:
                    parsed.append(
                        parse_prompt(p, self.state.tokenizer, chat_template_kwargs=chat_kwargs)
                    )
                except TypeError as e:  # a chat_template_kwargs key the template owns
                    raise BadField("chat_template_kwargs", f"chat_template_kwargs: {e}") from None
            if reading is not None:
                constraint = names["structured_outputs"]
                params = reading.sampling_params(
                    params,
                    parsed[0].text,
                    constraint,
                    answer_format=constraint == "response_format",
                )
            requests = [
                GenerateRequest(
                    rid if len(parsed) == 1 else f"{rid}-{i}",
                    p.token_ids,
                    params,
                    prompt=p.text,
                    **client_fields(body),
                    beam=body.beam_search(params),
                    lora=lora,
                )
                for i, p in enumerate(parsed)
            ]
            for request in requests:
                engine.validate(request)
        except BadField as e:
            raise serving.invalid(self.metrics, str(e), e.param) from None
        except ValueError as e:
            field = getattr(e, "field", None)
            raise serving.invalid(self.metrics, str(e), names.get(field, field)) from None
        model = self.state.model_name if lora is None else lora.lora_name
        return _Job(rid, engine, parsed, requests, params, body, model, reading)

    def _streams(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        return _merge([serving.stream(job.engine, self.metrics, r) for r in job.requests])

    # ---------------------------------------------------------------- completions

    def completion_job(self, body: CompletionRequest, lora: LoRARequest | None = None) -> _Job:
        return self._job("cmpl", body, body.prompts(), lora)

    async def complete(self, job: _Job) -> dict:
        finals = await _collect(self._streams(job), len(job.prompts))
        n, body = job.params.n, job.body
        # (a beam search's hypotheses carry logprobs whether or not they were asked for)
        wants_logprobs = job.params.logprobs is not None
        if body.scores_prompt:  # (the one token computed is not part of the reply)
            finals = [_prompt_only(out) for out in finals]
        choices = []
        for i, out in enumerate(finals):
            echo = self._echo_text(job.prompts[i]) if body.echo else ""
            for c in out.outputs:
                choice = {
                    "index": i * n + c.index,
                    "text": echo + c.text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **_versions(out),
                }
                if c.logprobs is not None and wants_logprobs:
                    tokens, entries = list(c.token_ids), list(c.logprobs)
                    if body.echo:
                        tokens = out.prompt_token_ids + tokens
                        entries = list(out.prompt_logprobs) + entries
                    choice["logprobs"] = self._completion_logprobs(tokens, entries, 0, body)
                if body.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choices.append(choice)
        return {
            "id": job.request_id,
            "object": "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": _usage(finals),
        }

    async def complete_stream(self, job: _Job) -> AsyncIterator[str]:
        body, n = job.body, job.params.n
        offsets: dict[int, int] = {}  # per choice: text offset of its next token
        wants_logprobs = job.params.logprobs is not None  # (a beam's carry them anyway)

        def chunk(i: int, c: CompletionOutput, out: RequestOutput, first: bool) -> dict:
            index = i * n + c.index
            text = c.delta_text
            if first and body.echo:
                text = self._echo_text(job.prompts[i]) + text
            choice = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if c.logprobs is not None and wants_logprobs:
                k = len(c.delta_token_ids)
                tokens, entries = c.delta_token_ids, c.logprobs[len(c.logprobs) - k :]
                if first and body.echo:
                    tokens = out.prompt_token_ids + tokens
                    entries = list(out.prompt_logprobs) + entries
                lp = self._completion_logprobs(tokens, entries, offsets.get(index, 0), body)
                if lp["text_offset"]:
                    offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                choice["logprobs"] = lp
            if body.return_token_ids:
                choice["token_ids"] = list(c.delta_token_ids)
                if first:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
            return {
                "id": job.request_id,
                "object": "text_completion",
                "created": job.created,
                "model": job.model,
                "choices": [choice],
            }

        async for event in self._sse(job, chunk, None):
            yield event

    def _echo_text(self, prompt: ParsedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        tok = self.state.tokenizer
        return "" if tok is None else tok.decode(prompt.token_ids, skip_special_tokens=False)

    # ----------------------------------------------------------- chat completions

    def chat_job(self, body: ChatCompletionRequest, lora: LoRARequest | None = None) -> _Job:
        prompt, kwargs = body.prompt()
        reading = ChatReading.of(self.parsers, self.state.tokenizer, body)
        return self._job("chatcmpl", body, [prompt], lora, chat_kwargs=kwargs, reading=reading)

    def _chat_echo(self, body: ChatCompletionRequest) -> str:
        last = body.messages[-1]
        if body.echo and last.role == "assistant" and isinstance(last.content, str):
            return last.content
        return ""

    async def chat(self, job: _Job) -> dict:
        (out,) = await _collect(self._streams(job), 1)
        body = job.body
        echo = self._chat_echo(body)
        choices = []
        for c in out.outputs:
            reader = job.reading.choice()
            if reader is None:
                message = {"role": "assistant", "content": echo + c.text}
            else:
                events = reader.read(c.text, c.finish_reason)
                message = chat_output.message(events, reasoning=reader.reasoning is not None)
                if echo:
                    message["content"] = echo + (message["content"] or "")
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": None,
                "finish_reason": chat_output.finish_reason(c.finish_reason, reader),
                "stop_reason": c.stop_reason,
                **_versions(out),
            }
            if c.logprobs is not None:
                choice["logprobs"] = {"content": self._chat_logprobs(c.token_ids, c.logprobs, body)}
            if body.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        response = {
            "id": job.request_id,
            "object": "chat.completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": _usage([out]),
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = list(out.prompt_token_ids)
        return response

    async def chat_stream(self, job: _Job) -> AsyncIterator[str]:
        body = job.body
        readers = {j: job.reading.choice() for j in range(job.params.n)}

        def wrap(choice: dict) -> dict:
            return {
                "id": job.request_id,
                "object": "chat.completion.chunk",
                "created": job.created,
                "model": job.model,
                "choices": [choice],
            }

        def chunk(i: int, c: CompletionOutput, out: RequestOutput, first: bool) -> dict | None:
            reader = readers[c.index]
            if reader is None:
                delta = {"content": c.delta_text} if c.delta_text else {}
            else:
                delta = chat_output.delta(reader.step(c.delta_text, c.finish_reason))
            choice = {
                "index": c.index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": chat_output.finish_reason(c.finish_reason, reader),
                "stop_reason": c.stop_reason,
            }
            if c.logprobs is not None and c.delta_token_ids:
                k = len(c.delta_token_ids)
                entries = c.logprobs[len(c.logprobs) - k :]
                choice["logprobs"] = {
                    "content": self._chat_logprobs(c.delta_token_ids, entries, body)
                }
            if body.return_token_ids:
                choice["token_ids"] = list(c.delta_token_ids)
            elif not delta and choice["finish_reason"] is None and choice["logprobs"] is None:
                return None  # (text held back, a tool-call marker's: no empty chunk, D7)
            return wrap(choice)

        def opening() -> list[dict]:  # each choice's first chunk carries the role
            delta = {"role": "assistant", "content": self._chat_echo(body)}
            return [
                wrap({"index": j, "delta": delta, "logprobs": None, "finish_reason": None})
                for j in range(job.params.n)
            ]

        async for event in self._sse(job, chunk, opening):
            yield event

    # ------------------------------------------------------------------ streaming

    async def _sse(
        self,
        job: _Job,
        chunk: Callable[[int, CompletionOutput, RequestOutput, bool], dict | None],
        opening: Callable[[], list[dict]] | None,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per choice per step with new tokens (and its
        finish; `chunk` returns None for a step with nothing to send), the usage
        chunk if asked for, then `[DONE]`."""
        n = job.params.n
        started: set[int] = set()  # choices that sent a chunk
        reported: list[set[int]] = [set() for _ in job.prompts]  # per prompt: samples done
        finals: list[RequestOutput] = []
        try:
            for event in opening() if opening else ():
                yield _event(event)
            async for i, out in self._streams(job):
                for c in serving.deltas(out, reported[i]):
                    index = i * n + c.index
                    event = chunk(i, c, out, index not in started)
                    if event is None:  # nothing to say this step
                        continue
                    if c.finished:
                        event["choices"][0].update(_versions(out))
                    yield _event(event)
                    started.add(index)
                if out.finished:
                    finals.append(out)
        except Refused as e:  # the engine died or failed it mid-stream: the status is sent
            yield _event(error_body(e.message, _ERROR_TYPES[e.reason][1], e.param))
        else:
            options = job.body.stream_options
            if options is not None and options.include_usage:
                yield _event(
                    {
                        "id": job.request_id,
                        "object": (
                            "chat.completion.chunk"
                            if isinstance(job.body, ChatCompletionRequest)
                            else "text_completion"
                        ),
                        "created": job.created,
                        "model": job.model,
                        "choices": [],
                        "usage": _usage(finals),
                    }
                )
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------- logprobs

    def _token_str(self, token_id: int, as_ids: bool) -> str:
        tok = self.state.tokenizer
        if as_ids or tok is None:
            return f"token_id:{token_id}"
        return tok.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, tokens, entries, offset: int, body) -> dict:
        """OpenAI's legacy completions logprobs; `entries[i]` is None for a prompt's
        first token (nothing predicts it)."""
        as_ids = body.return_tokens_as_token_ids
        k = body.logprobs
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(tokens, entries, strict=True):
            text = self._token_str(token, as_ids)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(max(entry[token], _MIN_LOGPROB))
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            if all(t != token for t, _ in top):  # k + 1 then, as OpenAI's and vLLM's
                top.append((token, entry[token]))
            out["top_logprobs"].append(
                {self._token_str(t, as_ids): max(v, _MIN_LOGPROB) for t, v in top}
            )
        return out

    def _chat_logprobs(self, tokens, entries, body) -> list[dict]:
        """OpenAI's chat logprobs `content`: per token its logprob and its top_logprobs."""
        k, as_ids = body.top_logprobs or 0, body.return_tokens_as_token_ids
        content = []
        for token, entry in zip(tokens, entries, strict=True):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                {
                    **self._logprob(token, entry[token], as_ids),
                    "top_logprobs": [self._logprob(t, v, as_ids) for t, v in top],
                }
            )
        return content

    def _logprob(self, token: int, value: float, as_ids: bool) -> dict:
        text = self._token_str(token, as_ids)
        return {
            "token": text,
            "logprob": max(value, _MIN_LOGPROB),
            "bytes": list(text.encode("utf-8")),
        }


# Reason -> (HTTP status, OpenAI error type).
_ERROR_TYPES = {
    Reason.INVALID: (400, "invalid_request_error"),
    Reason.OVERLOADED: (429, "rate_limit_exceeded"),
    Reason.UNAVAILABLE: (503, "service_unavailable"),
    Reason.CONFLICT: (409, "conflict_error"),
    Reason.FAILED: (500, "server_error"),
}


def status_of(e: Refused) -> tuple[int, str]:
    return _ERROR_TYPES[e.reason]


def error_body(message: str, type_: str, param: str | None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _versions(out: RequestOutput) -> dict[str, int]:
    return {"weight_version": out.weight_version, "first_weight_version": out.first_weight_version}


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """`out` with its samples' tokens left out: a prompt scored with max_tokens 0."""
    outputs = [
        dataclasses.replace(
            c,
            text="",
            token_ids=[],
            logprobs=[] if c.logprobs is not None else None,
            cumulative_logprob=0.0 if c.logprobs is not None else None,
            delta_text="",
            delta_token_ids=[],
            finish_reason="length",
            stop_reason=None,
        )
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=outputs)


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)},
    }


async def _collect(merged: AsyncIterator[tuple[int, RequestOutput]], k: int) -> list:
    finals: list[RequestOutput | None] = [None] * k
    async for i, out in merged:
        if out.finished:
            finals[i] = out
    return finals


async def _merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several engine streams as they come, tagged with the stream's
    index. Closing this iterator (a client gone) closes them all, aborting each."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out, None))
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                done += 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
