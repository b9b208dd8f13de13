"""Tool calls and the reasoning split on gRPC: a GenerateRequest's `tools`,
`tool_choice` and earlier calls, read back by the server's --tool_call_parser and
--reasoning_parser into `content`, `reasoning` and `tool_calls`, on the demo model
under the tool-aware test template of `test_http_tools.py`.
"""

import json

import grpc
import jsonschema
import pytest
import transformers
from conftest import ServerThread
from test_http_tools import LLM_KWARGS, SCHEMAS, WEATHER, demo_copy

from jaxserve.tokenizer import Tokenizer
from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc
from server.servicer import FIELD_METADATA

TOOLS = [
    pb.Tool(name=name, description=f"{name} tool", parameters=json.dumps(schema))
    for name, schema in SCHEMAS.items()
]
CHAT_TOOLS = [  # as chat templates take them
    {"type": "function", "function": {"name": t.name, "description": t.description,
                                      "parameters": json.loads(t.parameters)}}
    for t in TOOLS
]  # fmt: skip
QUESTION = [
    pb.ChatMessage(role="user", content="What is the weather in Paris, and book me a trip.")
]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return demo_copy(tmp_path_factory.mktemp("demo_grpc_tools"))


@pytest.fixture(scope="module")
def served(tool_model):
    server = ServerThread(
        tool_model, metrics_port=None, tool_call_parser="hermes", llm_kwargs=LLM_KWARGS
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(served):
    return pb_grpc.JaxServeStub(grpc.insecure_channel(served.target))


def chat(messages=QUESTION, *, tool_choice=None, parallel=None, kwargs=None, **params):
    params = {"max_tokens": 200, "temperature": 0.0, **params}
    req = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=messages),
        sampling_params=pb.SamplingParams(**params),
        tools=TOOLS,
    )
    if tool_choice is not None:
        req.tool_choice.CopyFrom(tool_choice)
    if parallel is not None:
        req.parallel_tool_calls = parallel
    if kwargs is not None:
        req.chat_template_kwargs = json.dumps(kwargs)
    return req


def streamed(stub, req):
    """Per sample: content, reasoning, calls [(id, name, arguments)], finish_reason."""
    out: dict[int, dict] = {}
    for msg in stub.Generate(req):
        if msg.HasField("usage"):
            continue
        got = out.setdefault(
            msg.index, {"content": "", "reasoning": "", "calls": {}, "finish": "", "text": ""}
        )
        got["content"] += msg.content
        got["reasoning"] += msg.reasoning
        got["text"] += msg.text
        for piece in msg.tool_calls:
            if piece.index not in got["calls"]:  # the first piece: its id and name
                assert piece.id.startswith("call_") and piece.name
                got["calls"][piece.index] = [piece.id, piece.name, ""]
            else:
                assert not piece.id and not piece.name
            got["calls"][piece.index][2] += piece.arguments
        got["finish"] = msg.finish_reason or got["finish"]
    return out


CHOICES = [
    (pb.ToolChoice(mode="required"), False),
    (pb.ToolChoice(mode="required"), True),
    (pb.ToolChoice(function="book_trip"), True),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_calls_validate_and_stream_to_the_same(stub, temperature):
    for tool_choice, parallel in CHOICES:
        req = chat(tool_choice=tool_choice, parallel=parallel, temperature=temperature, seed=5, n=2)
        whole = stub.Complete(req)
        parts = streamed(stub, req)
        for c in whole.completions:
            assert c.tool_calls, c
            if not parallel:
                assert len(c.tool_calls) == 1 and c.finish_reason == "tool_calls"
            for call in c.tool_calls:
                assert call.id.startswith("call_")
                if tool_choice.function:
                    assert call.name == tool_choice.function
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            got = parts[c.index]
            assert got["text"] == c.text  # the model's own text is unchanged
            calls = [(name, args) for _, name, args in got["calls"].values()]
            want = [(call.name, call.arguments) for call in c.tool_calls]
            if c.finish_reason == "length":  # a call cut off: its start was streamed
                calls = calls[: len(want)]
            assert calls == want and got["finish"] == c.finish_reason
            assert got["content"] == c.content


def test_auto_answers_in_content(stub):
    c = stub.Complete(chat(max_tokens=16)).completions[0]
    assert not c.tool_calls and c.content == c.text and c.finish_reason in ("stop", "length")


def test_earlier_calls_and_results_render_as_the_template_says(stub, tool_model):
    arguments = {"location": "Paris", "unit": "celsius"}
    conversation = [
        pb.ChatMessage(role="user", content="Weather in Paris?"),
        pb.ChatMessage(
            role="assistant",
            tool_calls=[
                pb.ToolCall(id="call_1", name="get_weather", arguments=json.dumps(arguments))
            ],
        ),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="18 C, sunny"),
    ]
    done = stub.Complete(
        chat(conversation, tool_choice=pb.ToolChoice(function="get_weather"), max_tokens=100)
    )
    jsonschema.validate(json.loads(done.completions[0].tool_calls[0].arguments), WEATHER)
    hf = transformers.AutoTokenizer.from_pretrained(tool_model)
    text = hf.apply_chat_template(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
        tools=CHAT_TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<tool_response>call_1: 18 C, sunny</tool_response>" in text
    want = Tokenizer(tool_model).encode(text, add_special_tokens=False)
    assert done.usage.prompt_tokens == len(want)


def _invalid(**fields):
    req = chat(max_tokens=4)
    for key, value in fields.items():
        if key == "prompt":
            req.prompt = value
        elif key == "tools":
            del req.tools[:]
            req.tools.extend(value)
        elif key == "tool_choice":
            req.tool_choice.CopyFrom(value)
        else:
            setattr(req, key, value)
    return req


BAD = [
    (_invalid(prompt="hi"), "tools"),
    (_invalid(tool_choice=pb.ToolChoice(function="nope")), "tool_choice"),
    (_invalid(tool_choice=pb.ToolChoice(mode="sometimes")), "tool_choice"),
    (_invalid(tools=[], tool_choice=pb.ToolChoice(mode="required")), "tool_choice"),
    (_invalid(tools=[pb.Tool(name="bad name!")]), "tools[0].name"),
    (_invalid(tools=[pb.Tool(name="f", parameters="{nope")]), "tools[0].parameters"),
    (_invalid(chat_template_kwargs="[1]"), "chat_template_kwargs"),
]


@pytest.mark.parametrize("req,field", BAD)
def test_invalid_tool_fields_name_themselves(stub, req, field):
    for call in (stub.Complete, lambda r: list(stub.Generate(r))):
        with pytest.raises(grpc.RpcError) as e:
            call(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert dict(e.value.trailing_metadata())[FIELD_METADATA] == field


def test_reasoning_is_split_from_the_answer(tmp_path_factory):
    """deepseek_r1 on the demo copy whose end-of-text is `</think>`: the text before it
    is `reasoning`, the answer after it `content`; streamed to the same."""
    path = demo_copy(tmp_path_factory.mktemp("demo_grpc_think"), think_token=True)
    server = ServerThread(
        path, metrics_port=None, reasoning_parser="deepseek_r1", llm_kwargs=LLM_KWARGS
    )
    try:
        s = pb_grpc.JaxServeStub(grpc.insecure_channel(server.target))
        req = pb.GenerateRequest(
            messages=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="Read a file.")]
            ),
            sampling_params=pb.SamplingParams(max_tokens=300, temperature=0.0),
            chat_template_kwargs=json.dumps({"enable_thinking": True}),
        )
        c = s.Complete(req).completions[0]
        reasoning, answer = c.text.split("</think>", 1)
        assert c.reasoning == reasoning and c.content == answer.lstrip() and c.content
        got = streamed(s, req)[0]
        assert (got["reasoning"], got["content"], got["text"]) == (c.reasoning, c.content, c.text)
        # A plain prompt is not a chat: not read.
        plain = s.Complete(
            pb.GenerateRequest(prompt="Hello", sampling_params=pb.SamplingParams(max_tokens=4))
        ).completions[0]
        assert plain.text and not plain.reasoning and not plain.content
        # This server reads no tool calls: tools are refused unless tool_choice is none.
        with pytest.raises(grpc.RpcError) as e:
            s.Complete(chat(max_tokens=4))
        assert dict(e.value.trailing_metadata())[FIELD_METADATA] == "tools"
        assert "--tool_call_parser" in e.value.details()
        none = s.Complete(chat(tool_choice=pb.ToolChoice(mode="none"), max_tokens=4))
        assert not none.completions[0].tool_calls
    finally:
        server.stop()
