"""`POST /v1/responses`: OpenAI's Responses API over the chat completion path.

The request becomes a chat completion (`responses_protocol`), which renders, is
constrained and is read exactly as one (`chat_output.ChatReading`: the same tool
and reasoning parsers). The reply's events become output items (`OutputItems`):
a `reasoning` item for the text before `</think>`, `message` items with
`output_text`, and a `function_call` item per call. Streamed, the same builder
sends the Responses API's typed events as the items form (`response.created`,
`response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), so the
streamed items reassemble to the non-streamed output: both come from one builder
fed the same events.

A call the model breaks off (malformed, or cut by `max_output_tokens`) has already
been streamed in part: its item ends with status `incomplete`, and its text follows
as a message, in the stream and in the non-streamed output alike; a call a grammar
held (tool_choice required or a function, constrained auto) that is cut short is
that incomplete item alone, its text no message. A reply cut by
`max_output_tokens` is status `incomplete` (`incomplete_details.reason`), streamed
as `response.incomplete`, as OpenAI does.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from jaxserve.lora import LoRARequest
from jaxserve.outputs import RequestOutput
from server import serving
from server.openai_api.chat_output import ChoiceReader
from server.openai_api.completions import OpenAIServing, _Job, status_of
from server.openai_api.protocol import BadField
from server.openai_api.responses_protocol import FunctionToolChoice, ResponsesRequest, chat_param
from server.reasoning_parsers import Reasoning
from server.serving import Refused
from server.tool_parsers import CallArgs, CallCut, CallEnd, CallFailed, CallStart, Content


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A reply's output items, built from its reader's events; `feed` and `finish`
    return the stream's events (without `sequence_number`) as the items form."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written (output's last)
        self._calls: dict[int, dict[str, Any]] = {}  # a call's index -> its item

    def feed(self, events: Sequence) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Reasoning):
                item = self._item("reasoning", out)
                item["content"][0]["text"] += e.text
                out.append(self._at(item, "response.reasoning_text.delta", delta=e.text))
            elif isinstance(e, Content | CallFailed):
                if isinstance(e, CallFailed):  # what it sent stays, incomplete
                    self._close("incomplete", out)
                item = self._item("message", out)
                item["content"][0]["text"] += e.text
                out.append(self._at(item, "response.output_text.delta", delta=e.text, logprobs=[]))
            elif isinstance(e, CallStart):
                self._close("completed", out)
                item = self._open_item(
                    {"type": "function_call", "call_id": e.id, "name": e.name, "arguments": ""},
                    out,
                )
                self._calls[e.index] = item
            elif isinstance(e, CallArgs):
                item = self._calls[e.index]
                item["arguments"] += e.text
                out.append(self._at(item, "response.function_call_arguments.delta", delta=e.text))
            elif isinstance(e, CallEnd):
                self._close("completed", out)
            elif isinstance(e, CallCut):
                self._close("incomplete", out)
        return out

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._close("incomplete" if incomplete else "completed", out)
        return out

    # ------------------------------------------------------------------ helpers

    def _at(self, item: dict[str, Any], type_: str, **fields) -> dict[str, Any]:
        event = {"type": type_, "item_id": item["id"], "output_index": item["_index"]}
        if item["type"] != "function_call":
            event["content_index"] = 0
        return {**event, **fields}

    def _item(self, kind: str, out: list) -> dict[str, Any]:
        """The open item if it is a `kind`, else a new one."""
        if self._open is not None and self._open["type"] == kind:
            return self._open
        self._close("completed", out)
        part: dict[str, Any]
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            item = self._open_item({"type": "reasoning", "summary": [], "content": []}, out)
        else:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = self._open_item({"type": "message", "role": "assistant", "content": []}, out)
        item["content"].append(part)
        out.append(self._at(item, "response.content_part.added", part=copy.deepcopy(part)))
        return item

    def _open_item(self, fields: dict[str, Any], out: list) -> dict[str, Any]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[fields["type"]]
        item = {"id": _id(prefix), **fields, "status": "in_progress"}
        self.output.append(item)
        item["_index"] = len(self.output) - 1
        self._open = item
        out.append(
            {
                "type": "response.output_item.added",
                "output_index": item["_index"],
                "item": public(item),
            }
        )
        return item

    def _close(self, status: str, out: list) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        kind = item["type"]
        if kind == "function_call" and status == "completed":
            out.append(
                self._at(
                    item,
                    "response.function_call_arguments.done",
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        elif kind != "function_call":
            part = item["content"][0]
            if kind == "reasoning":
                out.append(self._at(item, "response.reasoning_text.done", text=part["text"]))
            else:
                done = self._at(item, "response.output_text.done", text=part["text"], logprobs=[])
                out.append(done)
            out.append(self._at(item, "response.content_part.done", part=copy.deepcopy(part)))
        item["status"] = status
        out.append(
            {
                "type": "response.output_item.done",
                "output_index": item["_index"],
                "item": public(item),
            }
        )


def public(item: dict[str, Any]) -> dict[str, Any]:
    """An item as the client sees it (a copy, without the builder's bookkeeping)."""
    return copy.deepcopy({k: v for k, v in item.items() if not k.startswith("_")})


class ResponsesServing:
    """Runs Responses requests as chat completions (`OpenAIServing.chat_job`)."""

    def __init__(self, chat: OpenAIServing):
        self.chat = chat

    def job(self, body: ResponsesRequest, lora: LoRARequest | None = None) -> _Job:
        """Validates the request; errors name the Responses field."""
        try:
            return self.chat.chat_job(body.chat(), lora)
        except BadField as e:
            message, param = _renamed(str(e)), chat_param(e.param)
            raise serving.invalid(self.chat.metrics, message, param) from None
        except Refused as e:
            e.param, e.message = chat_param(e.param), _renamed(e.message)
            e.args = (e.message,)
            raise

    async def respond(self, job: _Job, body: ResponsesRequest, rid: str) -> dict[str, Any]:
        final: RequestOutput | None = None
        async for _, out in self.chat._streams(job):
            if out.finished:
                final = out
        assert final is not None
        (c,) = final.outputs
        reader = _reader(job)
        items = OutputItems()
        items.feed([Content(c.text)] if reader is None else reader.read(c.text, c.finish_reason))
        items.finish(c.finish_reason == "length")
        return self._response(job, body, rid, items.output, final, c.finish_reason)

    async def stream(self, job: _Job, body: ResponsesRequest, rid: str) -> AsyncIterator[str]:
        sequence = 0

        def event(payload: dict[str, Any]) -> str:
            nonlocal sequence
            payload["sequence_number"] = sequence
            sequence += 1
            data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            return f"event: {payload['type']}\ndata: {data}\n\n"

        started = self._response(job, body, rid, [], None, None)
        yield event({"type": "response.created", "response": started})
        yield event({"type": "response.in_progress", "response": started})
        reader = _reader(job)
        items = OutputItems()
        reported: set[int] = set()
        final: RequestOutput | None = None
        try:
            async for _, out in self.chat._streams(job):
                for c in serving.deltas(out, reported):
                    if reader is None:
                        events: list = [Content(c.delta_text)] if c.delta_text else []
                    else:
                        events = reader.step(c.delta_text, c.finish_reason)
                    for payload in items.feed(events):
                        yield event(payload)
                if out.finished:
                    final = out
        except Refused as e:  # the engine died or failed it mid-stream
            yield event(
                {"type": "error", "code": status_of(e)[1], "message": e.message, "param": e.param}
            )
            return
        assert final is not None
        reason = final.outputs[0].finish_reason
        for payload in items.finish(reason == "length"):
            yield event(payload)
        done = self._response(job, body, rid, items.output, final, reason)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield event({"type": kind, "response": done})

    def _response(
        self,
        job: _Job,
        body: ResponsesRequest,
        rid: str,
        output: list[dict[str, Any]],
        final: RequestOutput | None,
        finish_reason: str | None,
    ) -> dict[str, Any]:
        """The response object: in progress (no `final` yet), completed or incomplete."""
        status, incomplete = "in_progress", None
        if final is not None:
            status = "incomplete" if finish_reason == "length" else "completed"
            if finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
        choice = body.tool_choice
        text_format: dict[str, Any] = {"type": "text"}
        if body.text is not None and body.text.format is not None:
            text_format = body.text.format.model_dump(by_alias=True, exclude_none=True)
        return {
            "id": rid,
            "object": "response",
            "created_at": job.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": job.model,
            "output": [public(item) for item in output],
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": (
                choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice or "auto"
            ),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "text": {"format": text_format},
            "reasoning": body.reasoning,
            "metadata": body.metadata or {},
            "store": False,
            "user": body.user,
            "usage": None if final is None else self._usage(final, output),
        }

    def _usage(self, final: RequestOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
        prompt = len(final.prompt_token_ids)
        completion = sum(len(c.token_ids) for c in final.outputs)
        # The reasoning's tokens, as its text re-encodes (the reply's own cut is not kept).
        reasoning = 0
        tok = self.chat.state.tokenizer
        for item in output:
            if item["type"] == "reasoning" and tok is not None:
                text = item["content"][0]["text"]
                reasoning += len(tok.encode(text, add_special_tokens=False))
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, completion)},
            "total_tokens": prompt + completion,
        }


def _reader(job: _Job) -> ChoiceReader | None:
    assert job.reading is not None  # (a chat job's)
    return job.reading.choice()


# Chat fields named in error messages -> the Responses fields.
_MESSAGE_NAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
)


def _renamed(message: str) -> str:
    for chat, responses in _MESSAGE_NAMES:
        message = message.replace(chat, responses)
    return message


def response_id() -> str:
    return _id("resp")
