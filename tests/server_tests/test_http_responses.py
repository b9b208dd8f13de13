"""The Responses API (`POST /v1/responses`) end to end with the official `openai`
client, on the demo model under the tool-aware test template of `test_http_tools.py`
(Hermes-style calls): text, function calls (flat tools), the function_call ->
function_call_output round trip, json_schema output, reasoning items, streaming
with typed events that reassemble to the non-streamed output, and the 400s.
"""

import contextlib
import json

import httpx
import jsonschema
import openai
import pytest
import transformers
from conftest import ServerThread
from test_http_tools import GREETING, LLM_KWARGS, SCHEMAS, TRIP, WEATHER, client_of, demo_copy

from jaxserve.tokenizer import Tokenizer
from server.edge import Keys
from server.openai_api.api import HttpServer, build_app
from server.openai_api.chat_output import ChatParsers
from server.openai_api.responses import OutputItems
from server.reasoning_parsers import Reasoning
from server.tool_parsers import CallArgs, CallCut, CallEnd, CallFailed, CallStart, Content
from server.tool_parsers.json_prefix import JsonObject

TOOLS = [
    {"type": "function", "name": name, "description": f"{name} tool", "parameters": schema}
    for name, schema in SCHEMAS.items()
]
QUESTION = "What is the weather in Paris, and book me a trip."


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return demo_copy(tmp_path_factory.mktemp("demo_responses"))


@pytest.fixture(scope="module")
def served(tool_model):
    server = ServerThread(
        tool_model, http_port=0, metrics_port=None, tool_call_parser="hermes", llm_kwargs=LLM_KWARGS
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return client_of(served.server.http_port)


def plain(items):
    """Output items without their ids (a stream's and a second request's differ)."""
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        d.pop("id", None)
        d.pop("call_id", None)
        out.append(d)
    return out


def reassemble(events):
    """The output items a stream describes, rebuilt from its deltas (and checked against
    its done events), and its last event's response."""
    events = list(events)
    assert events[0].type == "response.created" and events[0].response.status == "in_progress"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    items: dict[int, dict] = {}
    for e in events[1:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(items) and e.item.status == "in_progress"
            items[e.output_index] = e.item.model_dump(exclude_none=True)
            items[e.output_index]["text"] = ""
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e.output_index]["text"] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            item = items[e.output_index]
            item["arguments"] += e.delta
            assert JsonObject().feed(item["arguments"]) == len(item["arguments"])
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == items[e.output_index]["arguments"]
        elif e.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert e.text == items[e.output_index]["text"]
        elif e.type == "response.output_item.done":
            item = items[e.output_index]
            assert e.item.id == item["id"]
            text = item.pop("text")
            item = items[e.output_index] = e.item.model_dump(exclude_none=True)
            if item["type"] != "function_call":
                assert item["content"][0]["text"] == text
            else:
                assert item["arguments"] == json.loads(json.dumps(item["arguments"]))
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), last.type
    assert [i["id"] for i in items.values()] == [i.id for i in last.response.output]
    assert last.response.usage.total_tokens > 0
    return last.response


def test_text_sync_and_streamed(client, served):
    kw = dict(
        model="tiny",
        input="Tell me about lists.",
        instructions="Be brief.",
        max_output_tokens=24,
        temperature=0,
    )
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.output_text
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 24
    # instructions render as the system message, input as the user's
    tokens = httpx.post(
        f"http://127.0.0.1:{served.server.http_port}/tokenize",
        json={
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about lists."},
            ]
        },
    ).json()["tokens"]
    assert r.usage.input_tokens == len(tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    streamed = reassemble(client.responses.create(**kw, stream=True))
    assert plain(streamed.output) == plain(r.output)
    assert streamed.output_text == r.output_text and streamed.status == r.status
    assert streamed.usage.output_tokens == r.usage.output_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_function_calls_validate_and_stream_to_the_same(client, temperature):
    for seed, (tool_choice, parallel) in enumerate(
        [("required", False), ("required", True), ({"type": "function", "name": "book_trip"}, True)]
    ):
        kw = dict(
            model="tiny",
            input=[{"role": "user", "content": QUESTION}],
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            max_output_tokens=200,
            temperature=temperature,
            extra_body={"seed": seed},
        )
        r = client.responses.create(**kw)
        calls = [item for item in r.output if item.type == "function_call"]
        assert calls and calls[0].status == "completed"
        for call in calls:
            if call.status == "completed":
                assert call.call_id.startswith("call_") and call.id.startswith("fc_")
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            else:  # a parallel call cut off by max_output_tokens
                assert r.status == "incomplete"
        if not parallel:
            assert len(r.output) == 1 and r.status == "completed"
        if isinstance(tool_choice, dict):
            assert {c.name for c in calls} == {"book_trip"}
        streamed = reassemble(client.responses.create(**kw, stream=True))
        assert plain(streamed.output) == plain(r.output) and streamed.status == r.status


def test_a_function_call_output_round_trip_renders_into_the_next_prompt(client, tool_model):
    """The client sends the model's function_call item back with its output; they
    render as the chat template renders the assistant's call and the tool's result."""
    first = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
        temperature=0,
    )
    (call,) = first.output
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        call,  # the output item itself, as the OpenAI docs do
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
    ]
    second = client.responses.create(
        model="tiny",
        instructions="You help.",
        input=conversation,
        tools=TOOLS,
        max_output_tokens=8,
        temperature=0,
    )
    hf = transformers.AutoTokenizer.from_pretrained(tool_model)
    chat = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"},
    ]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
    ]
    text = hf.apply_chat_template(
        chat, tools=chat_tools, add_generation_prompt=True, tokenize=False
    )
    assert f"<tool_response>{call.call_id}: 18 C, sunny</tool_response>" in text
    assert '"name": "get_weather", "arguments": {"location": ' in text
    want = Tokenizer(tool_model).encode(text, add_special_tokens=False)
    assert second.usage.input_tokens == len(want)
    assert second.output and second.status in ("completed", "incomplete")


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
            "tags": {"type": "array", "items": {"enum": ["sun", "rain"]}, "maxItems": 3},
        },
        "required": ["city", "days", "tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "trip", "schema": schema, "strict": True}
    for temperature in (0.0, 1.0):
        kw = dict(
            model="tiny",
            input="Plan a trip.",
            text={"format": fmt},
            max_output_tokens=120,
            temperature=temperature,
        )
        r = client.responses.create(**kw)
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.text.format.type == "json_schema"
        if temperature == 0:
            streamed = reassemble(client.responses.create(**kw, stream=True))
            assert streamed.output_text == r.output_text


def test_tool_choice_auto_answers_in_text(client):
    r = client.responses.create(
        model="tiny", input=QUESTION, tools=TOOLS, max_output_tokens=16, temperature=0
    )
    assert [item.type for item in r.output] == ["message"] and r.output_text
    assert r.tool_choice == "auto" and [t.name for t in r.tools] == list(SCHEMAS)


def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_item_alone(client):
    """A required call cut short (D6): its function_call item, as far as it got, ends
    incomplete, and its text (the marker, the partial JSON) is no message; cut before
    its name, the output is empty. It was a message holding the raw markup."""
    for max_tokens, kinds in ((8, []), (25, [("function_call", "incomplete")])):
        kw = dict(
            model="tiny",
            input=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=max_tokens,
            temperature=0,
        )
        r = client.responses.create(**kw)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert [(i.type, i.status) for i in r.output] == kinds and r.output_text == ""
        streamed = reassemble(client.responses.create(**kw, stream=True))
        assert plain(streamed.output) == plain(r.output) and streamed.status == r.status


def test_text_format_with_tools(client, served):
    """text.format beside tools (D1, what openai-agents sends for an agent with tools and
    an output type; it was a 400 with a forced call): a forced call is the turn's
    output; under auto the reply is a call or a message in the format, which ever
    the model picks, with or without --tool_call_constrained."""
    fmt = {"type": "json_schema", "name": "greeting", "schema": GREETING, "strict": True}
    kw = dict(
        model="tiny",
        input=QUESTION,
        tools=TOOLS,
        text={"format": fmt},
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    for tool_choice in ("required", {"type": "function", "name": "book_trip"}):
        forced = dict(kw, tool_choice=tool_choice, temperature=0)
        r = client.responses.create(**forced)
        (call,) = r.output
        assert call.type == "function_call" and r.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        streamed = reassemble(client.responses.create(**forced, stream=True))
        assert plain(streamed.output) == plain(r.output)
    port = served.server.http_port
    with app_with(served, parsers=ChatParsers("hermes", tool_call_constrained=True)) as flagged:
        for p in (port, flagged):
            picked = set()
            for seed in range(12):
                r = client_of(p).responses.create(**kw, temperature=1.0, extra_body={"seed": seed})
                assert r.status == "completed"
                (item,) = r.output
                if item.type == "function_call":
                    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
                else:
                    jsonschema.validate(json.loads(r.output_text), GREETING)
                picked.add(item.type)
            assert picked == {"function_call", "message"}, p


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", BAD)
def test_invalid_requests_are_400_naming_the_field(served, body, param):
    for stream in (False, True):
        r = httpx.post(
            f"http://127.0.0.1:{served.server.http_port}/v1/responses",
            json={"model": "tiny", "input": "hi", "stream": stream, **body},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()


def test_the_client_sees_the_400s(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    assert "stores no responses" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", store=True)
    assert e.value.body["param"] == "store"
    r = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    assert r.store is False


@contextlib.contextmanager
def app_with(served, **kw):
    """A second HTTP app on the same engine."""
    state, metrics = served.server.state, served.server.metrics

    async def start():
        server = HttpServer(build_app(state, metrics, **kw), "127.0.0.1", 0)
        await server.start()
        return server

    server = served.call(start())
    try:
        yield server.port
    finally:
        served.call(server.stop(1))


def test_behind_the_api_key(served):
    with app_with(served, keys=Keys(user="s3cret"), parsers=ChatParsers("hermes")) as port:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json={"input": "hi"})
        assert r.status_code == 401
        key = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret")
        assert key.responses.create(model="tiny", input="hi", max_output_tokens=2).output


# ------------------------------------------------------------------ reasoning


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """The demo copy whose end-of-text is `</think>`, read as DeepSeek-R1 reasons."""
    path = demo_copy(tmp_path_factory.mktemp("demo_think_responses"), think_token=True)
    server = ServerThread(
        path,
        http_port=0,
        metrics_port=None,
        tool_call_parser="hermes",
        reasoning_parser="deepseek_r1",
        llm_kwargs=LLM_KWARGS,
    )
    yield server
    server.stop()


def test_reasoning_item_then_the_answer(thinking):
    """The text before `</think>` is a reasoning item; the answer after it a message
    (or, constrained, a function call); streamed as reasoning_text deltas."""
    client = client_of(thinking.server.http_port)
    kw = dict(
        model="tiny",
        input="Read a file.",
        max_output_tokens=300,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    r = client.responses.create(**kw)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"], r.output
    reasoning = r.output[0].content[0].text
    assert reasoning and "</think>" not in reasoning and r.output_text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    streamed = reassemble(client.responses.create(**kw, stream=True))
    assert plain(streamed.output) == plain(r.output)
    # With tools the greedy demo model reasons on to max_output_tokens: sampled, most
    # seeds end the reasoning, and the answer is then the named call.
    kinds = []
    for seed in range(4):
        called = client.responses.create(
            **{**kw, "temperature": 1.0, "extra_body": {**kw["extra_body"], "seed": seed}},
            tools=TOOLS,
            tool_choice={"type": "function", "name": "book_trip"},
        )
        kinds = [item.type for item in called.output]
        assert kinds[0] == "reasoning"
        if called.status == "completed":
            break
    assert kinds == ["reasoning", "function_call"], called.output
    jsonschema.validate(json.loads(called.output[1].arguments), TRIP)


# ------------------------------------------------------------ the item builder


def test_items_do_not_depend_on_how_events_arrive_and_a_broken_call_stays_incomplete():
    """A call that breaks off was already streamed in part: its item ends incomplete
    and its text follows as a message, in pieces or whole."""
    events = [
        Reasoning("let me "),
        Reasoning("see"),
        Content("Sure."),
        CallStart(0, "call_a", "get_weather"),
        CallArgs(0, '{"location": '),
        CallArgs(0, '"Paris"}'),
        CallEnd(0),
        CallStart(1, "call_b", "book_trip"),
        CallArgs(1, '{"traveler": '),
        CallFailed(1, '<tool_call>{"name": "book_trip", "traveler": oops'),
        Content(" and more"),
    ]
    whole = OutputItems()
    sent = whole.feed(events) + whole.finish(incomplete=False)
    pieces = OutputItems()
    for e in events:
        pieces.feed([e])
    pieces.finish(incomplete=False)
    strip = [{k: v for k, v in i.items() if k not in ("id", "_index")} for i in whole.output]
    assert strip == [
        {k: v for k, v in i.items() if k not in ("id", "_index")} for i in pieces.output
    ]
    assert [(i["type"], i["status"]) for i in whole.output] == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "incomplete"),
        ("message", "completed"),
    ]
    assert whole.output[0]["content"][0]["text"] == "let me see"
    assert whole.output[2]["arguments"] == '{"location": "Paris"}'
    assert whole.output[3]["arguments"] == '{"traveler": '
    assert whole.output[4]["content"][0]["text"].endswith("oops and more")
    done = [e for e in sent if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"location": "Paris"}']  # not the broken one
    # A call cut short under a grammar: its item ends incomplete, no message follows.
    cut = OutputItems()
    cut.feed([CallStart(0, "call_c", "get_weather"), CallArgs(0, '{"loc'), CallCut(0)])
    cut.finish(incomplete=True)
    assert [(i["type"], i["status"], i["arguments"]) for i in cut.output] == [
        ("function_call", "incomplete", '{"loc')
    ]
    kinds = [e["type"] for e in sent]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
