"""Tool calling and reasoning output in chat completions, end to end with the official
`openai` client, on the embedded demo model under a tool-aware chat template written
for these tests (Hermes-style calls, as Qwen's templates ask for).

The demo model knows nothing of tools: left alone it writes Python-documentation
English. What it writes when constrained (`tool_choice` required or named) must
still always be calls whose arguments validate, and whatever it writes must come
back as content or calls, never as an error. For reasoning, a copy of the demo
model reads its end-of-text token as `</think>` (a plain added token, as in Qwen3),
so it ends its reasoning where it would have ended its reply; its `<|end|>` token
is its end of sequence.
"""

import concurrent.futures
import contextlib
import json
import os

import httpx
import jsonschema
import openai
import pytest
import transformers
from conftest import ServerThread

from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.tokenizer import Tokenizer
from server.openai_api.api import HttpServer, build_app
from server.openai_api.chat_output import ChatParsers
from server.tool_parsers.json_prefix import JsonObject

# Qwen 2.5's tool template, condensed: the tools' names in a system turn, earlier
# calls in <tool_call> tags (their arguments as objects), tool results in
# <tool_response> tags; Qwen 3's enable_thinking (and DeepSeek-R1's opened <think>).
TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}."
    ' Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|end|>\n"
    "{% elif m.role == 'tool' %}<|user|><tool_response>{{ m.tool_call_id }}: {{ m.content }}"
    "</tool_response><|end|>\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined %}{% if enable_thinking %}<think>\n"
    "{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}{% endif %}"
)


def demo_copy(path, *, think_token=False):
    """The demo model under TEMPLATE; with `think_token`, its end-of-text token reads
    `</think>` and `<|end|>` ends its sequences."""
    src = EMBEDDED_MODELS["demo-model"]
    files = {}
    for name in os.listdir(src):
        if name.endswith(".json"):
            with open(os.path.join(src, name)) as f:
                files[name] = json.load(f)
        else:
            os.symlink(os.path.join(src, name), os.path.join(path, name))
    files["tokenizer_config.json"]["chat_template"] = TEMPLATE
    if think_token:
        tok = files["tokenizer.json"]
        (added,) = [t for t in tok["added_tokens"] if t["content"] == "<|endoftext|>"]
        added.update(content="</think>", special=False)
        tok["model"]["vocab"]["</think>"] = tok["model"]["vocab"].pop("<|endoftext|>")
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            files["tokenizer_config.json"][key] = "<|end|>"
        for name in ("config.json", "generation_config.json"):
            files[name].update(bos_token_id=4, eos_token_id=4)
    for name, value in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(value, f)
    return str(path)


LLM_KWARGS = dict(max_model_len=512, block_size=16, num_kv_pages=320, max_num_seqs=16)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return demo_copy(tmp_path_factory.mktemp("demo_tools"))


@pytest.fixture(scope="module")
def served(tool_model):
    server = ServerThread(
        tool_model, http_port=0, metrics_port=None, tool_call_parser="hermes", llm_kwargs=LLM_KWARGS
    )
    yield server
    server.stop()


def client_of(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def client(served):
    return client_of(served.server.http_port)


@contextlib.contextmanager
def app_with(served, parsers):
    """A second HTTP app on the same engine, reading replies with other parsers."""
    state, metrics = served.server.state, served.server.metrics

    async def start():
        server = HttpServer(build_app(state, metrics, parsers=parsers), "127.0.0.1", 0)
        await server.start()
        return server

    server = served.call(start())
    try:
        yield client_of(server.port)
    finally:
        served.call(server.stop(1))


WEATHER = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
TRIP = {
    "type": "object",
    "properties": {
        "traveler": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        "legs": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "from": {"type": "string", "maxLength": 8},
                    "to": {"type": "string", "maxLength": 8},
                    "class": {"enum": ["economy", "business"]},
                },
                "required": ["from", "to", "class"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "flexible": {"type": "boolean"},
    },
    "required": ["traveler", "legs"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "book_trip": TRIP}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and book me a trip."}]
PROMPTS = [
    MESSAGES,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read a file."}],
]
CHOICES = [
    ("required", False),
    ("required", True),
    ({"type": "function", "function": {"name": "book_trip"}}, True),
    ({"type": "function", "function": {"name": "get_weather"}}, False),
]


def check_calls(choice, tool_choice, parallel):
    """Every call is to an offered (or the named) function, with valid arguments."""
    calls = choice.message.tool_calls
    assert calls, choice
    names = set(SCHEMAS) if tool_choice == "required" else {tool_choice["function"]["name"]}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if not parallel:
        assert len(calls) == 1 and choice.finish_reason == "tool_calls"
    else:  # the model may go on calling until max_tokens; what it finished is valid
        assert choice.finish_reason in ("tool_calls", "length")
    assert choice.message.content is None or choice.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_calls_always_parse_and_validate(client, temperature):
    n = 1 if temperature == 0 else 3
    for messages in PROMPTS:
        for seed, (tool_choice, parallel) in enumerate(CHOICES):
            out = client.chat.completions.create(
                model="tiny",
                messages=messages,
                tools=TOOLS,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel,
                max_completion_tokens=300,
                temperature=temperature,
                seed=seed,
                n=n,
            )
            assert len(out.choices) == n
            for choice in out.choices:
                check_calls(choice, tool_choice, parallel)


def reassemble(chunks):
    """Per choice: content, tool calls [(id, name, arguments)] and finish reason, from
    streamed chunks; checks each delta's shape on the way."""
    out = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = out.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            d = c.delta
            # Every chunk says something (D7: ~28 empty deltas were streamed while a
            # tool-call marker was held back).
            assert d.content or d.tool_calls or d.role or c.finish_reason or c.logprobs, chunk
            got["content"] += d.content or ""
            for t in d.tool_calls or ():
                if t.index not in got["calls"]:  # the first entry: index, id and name
                    assert t.id and t.type == "function" and t.function.name
                    got["calls"][t.index] = [t.id, t.function.name, ""]
                else:
                    assert t.id is None and t.function.name is None
                got["calls"][t.index][2] += t.function.arguments or ""
                so_far = got["calls"][t.index][2]
                assert JsonObject().feed(so_far) == len(so_far)  # a valid JSON prefix
            if c.finish_reason is not None:
                got["finish"] = c.finish_reason
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_streamed_calls_reassemble_to_the_non_streamed(client, temperature):
    for tool_choice, parallel in CHOICES[1:3]:
        kw = dict(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            max_completion_tokens=200,
            temperature=temperature,
            seed=11,
            n=2,
        )
        whole = client.chat.completions.create(**kw)
        streamed = reassemble(client.chat.completions.create(**kw, stream=True))
        assert sorted(streamed) == [0, 1]
        for choice in whole.choices:
            got = streamed[choice.index]
            want = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            calls = [(name, args) for _, name, args in got["calls"].values()]
            if choice.finish_reason == "length" and calls[len(want) :]:
                # A call cut off by max_tokens: the stream had sent its beginning; the
                # whole reply leaves it out, and its text is no content either (D6).
                ((name, _),) = calls[len(want) :]
                calls = calls[: len(want)]
                assert name in SCHEMAS and not choice.message.content
            assert calls == want
            assert got["finish"] == choice.finish_reason
            assert got["content"] == (choice.message.content or "")
            assert len({i for i, _, _ in got["calls"].values()}) == len(got["calls"])  # ids


def test_auto_none_and_constrained_auto(served, client):
    """auto: the demo model answers in text, which comes back as content; none: the
    same, though the tools are in the prompt; auto with --tool_call_constrained: any
    call the model begins is valid (text stays possible)."""
    kw = dict(model="tiny", messages=MESSAGES, max_completion_tokens=40, temperature=0)
    plain = client.chat.completions.create(**kw)
    for tool_choice in ("auto", "none"):
        out = client.chat.completions.create(**kw, tools=TOOLS, tool_choice=tool_choice)
        c = out.choices[0]
        assert c.message.tool_calls is None and c.message.content
        assert c.finish_reason in ("stop", "length")
        assert out.usage.prompt_tokens > plain.usage.prompt_tokens  # tools rendered
    with app_with(served, ChatParsers("hermes", tool_call_constrained=True)) as constrained:
        out = constrained.chat.completions.create(
            **{**kw, "temperature": 1.0, "max_completion_tokens": 120},
            tools=TOOLS,
            tool_choice="auto",
            n=4,
            seed=3,
        )
        for c in out.choices:
            for call in c.message.tool_calls or ():
                jsonschema.validate(
                    json.loads(call.function.arguments), SCHEMAS[call.function.name]
                )
            assert c.message.content or c.message.tool_calls


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>'  # noqa: E501


@pytest.mark.parametrize(
    "regex,calls",
    [
        (CALL, [("get_weather", '{"location": "Paris", "unit": "celsius"}')]),
        ("Let me see. " + CALL, [("get_weather", '{"location": "Paris", "unit": "celsius"}')]),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"location": Paris}}\n</tool_call>',
            [],
        ),
        ('<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>', []),
    ],
)
def test_what_the_model_writes_is_parsed_or_returned_as_content(client, regex, calls):
    """Replies forced by a regex (auto, unconstrained): a call in the model's format
    is a call; one that does not parse, or calls an unknown function, is content."""
    kw = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_completion_tokens=100,
        temperature=0,
        extra_body={
            "guided_regex": "".join("\\" + ch if ch in "\\.^$|?*+()[]{}" else ch for ch in regex)
        },
    )
    out = client.chat.completions.create(**kw)
    c = out.choices[0]
    got = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()]
    assert got == calls
    if calls:
        assert c.finish_reason == "tool_calls"
        assert (c.message.content or "") == regex[: regex.index("<tool_call>")].strip()
    else:
        assert c.finish_reason == "stop" and c.message.content == regex
    streamed = reassemble(client.chat.completions.create(**kw, stream=True))[0]
    got = [(name, args) for _, name, args in streamed["calls"].values()]
    assert streamed["finish"] == c.finish_reason
    assert streamed["content"] == (c.message.content or "")
    if calls or "delete_all" in regex:
        assert got == calls
    else:  # the stream had begun the call before it broke: its valid beginning was sent
        assert got == [("get_weather", '{"location": ')]


def test_a_conversation_with_tool_results_renders_as_the_template_says(client, served, tool_model):
    """The earlier call (arguments sent as JSON text, as OpenAI does) and the tool's
    result render as transformers renders them (arguments as an object)."""
    arguments = {"location": "Paris", "unit": "celsius"}
    conversation = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    out = client.chat.completions.create(
        model="tiny",
        messages=conversation,
        tools=TOOLS,
        tool_choice="required",
        max_completion_tokens=120,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    check_calls(out.choices[0], "required", True)
    hf = transformers.AutoTokenizer.from_pretrained(tool_model)
    hf_conversation = [dict(m) for m in conversation]
    hf_conversation[2] = {
        **conversation[2],
        "content": "",
        "tool_calls": [
            {
                **conversation[2]["tool_calls"][0],
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    text = hf.apply_chat_template(
        hf_conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert "<tool_response>call_1: 18 C, sunny</tool_response>" in text
    assert '"arguments": {"location": "Paris", "unit": "celsius"}' in text
    want = Tokenizer(tool_model).encode(text, add_special_tokens=False)
    assert out.model_extra["prompt_token_ids"] == want
    # /tokenize renders the same.
    r = httpx.post(
        f"http://127.0.0.1:{served.server.http_port}/tokenize",
        json={"messages": conversation, "tools": TOOLS},
    )
    assert r.status_code == 200 and r.json()["tokens"] == want


HI = [{"role": "user", "content": "hi"}]
BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", BAD)
def test_invalid_tool_requests_are_400_naming_the_param(served, body, param):
    for stream in (False, True):
        r = httpx.post(
            f"http://127.0.0.1:{served.server.http_port}/v1/chat/completions",
            json={"model": "tiny", "messages": HI, "stream": stream, **body},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_forced_call_cut_by_max_tokens_leaks_no_markup(client):
    """A required or named call cut by max_tokens (D6): the reply is not its text as
    content (the marker and partial JSON), nor a call with broken arguments: no
    content, no calls, finish_reason "length". Streamed, the call is sent as far as
    it got (as OpenAI streams one), its arguments a valid JSON prefix, and no content."""
    sent = 0
    for tool_choice in ("required", NAMED):
        for max_tokens in (3, 8, 15, 25):
            kw = dict(
                model="tiny",
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=tool_choice,
                parallel_tool_calls=False,
                max_completion_tokens=max_tokens,
                temperature=0,
            )
            c = client.chat.completions.create(**kw).choices[0]
            assert c.finish_reason == "length"
            assert not c.message.content and c.message.tool_calls is None, c.message
            streamed = reassemble(client.chat.completions.create(**kw, stream=True))[0]
            assert streamed["finish"] == "length" and streamed["content"] == ""
            for _, name, arguments in streamed["calls"].values():
                assert name in SCHEMAS
                sent += bool(arguments)
    assert sent  # some cut came after the arguments began


GREETING = {
    "type": "object",
    "properties": {"greeting": {"type": "string", "maxLength": 12}},
    "required": ["greeting"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "greeting", "schema": GREETING}}
LT, BRACE = 32, 95  # the demo tokenizer's "<" (a call's first token) and "{" (JSON's)


def check_call_or_answer(c):
    """A reply under auto with a format: valid calls, or content in the format."""
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls" and not c.message.content
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        return "call"
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.message.content), GREETING)
    return "answer"


def test_a_forced_call_replaces_the_answer_format(client):
    """response_format with tool_choice required or a named function (D1): OpenAI takes
    it, and the turn is the call (the format is the final answer's); it was a 400."""
    for tool_choice in ("required", NAMED):
        kw = dict(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            response_format=FORMAT,
            max_completion_tokens=200,
            temperature=0,
        )
        c = client.chat.completions.create(**kw).choices[0]
        check_calls(c, tool_choice, False)
        streamed = reassemble(client.chat.completions.create(**kw, stream=True))[0]
        got = [(name, args) for _, name, args in streamed["calls"].values()]
        assert got == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        assert streamed["finish"] == "tool_calls"


@pytest.mark.parametrize("constrained", [False, True])
def test_auto_with_an_answer_format_calls_or_answers_in_it(served, client, constrained):
    """tool_choice auto with response_format (D1; what openai-agents sends for an agent
    with tools and an output type): the reply is calls or an answer in the format.
    It was locked to the format (no call possible), and with --tool_call_constrained
    refused. A logit bias toward a call's first token, or JSON's, picks the branch."""
    parsers = ChatParsers("hermes", tool_call_constrained=constrained)
    with app_with(served, parsers) as chat:
        kw = dict(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="auto",
            parallel_tool_calls=False,
            response_format=FORMAT,
            max_completion_tokens=200,
            temperature=0,
        )
        for token, want in ((LT, "call"), (BRACE, "answer")):
            out = chat.chat.completions.create(**kw, logit_bias={str(token): 30})
            assert check_call_or_answer(out.choices[0]) == want
        out = chat.chat.completions.create(**{**kw, "temperature": 1.0}, n=4, seed=5)
        for c in out.choices:
            check_call_or_answer(c)
        stream = chat.chat.completions.create(**kw, logit_bias={str(LT): 30}, stream=True)
        streamed = reassemble(stream)[0]
        assert streamed["finish"] == "tool_calls" and streamed["calls"]


def test_tools_without_a_parser_are_refused_unless_none(served):
    with app_with(served, ChatParsers()) as plain:
        with pytest.raises(openai.BadRequestError) as e:
            plain.chat.completions.create(model="tiny", messages=HI, tools=TOOLS)
        assert e.value.body["param"] == "tools" and "--tool_call_parser" in str(e.value)
        for tools, tool_choice in ((TOOLS, "none"), ([], "auto")):
            out = plain.chat.completions.create(
                model="tiny",
                messages=HI,
                tools=tools,
                tool_choice=tool_choice,
                max_completion_tokens=4,
            )
            assert out.choices[0].message.tool_calls is None


# ------------------------------------------------------------------ reasoning


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """The demo copy whose end-of-text is `</think>`, reasoning as DeepSeek-R1 does,
    with n-gram speculative decoding on."""
    path = demo_copy(tmp_path_factory.mktemp("demo_think"), think_token=True)
    spec = dict(method="ngram", num_speculative_tokens=3)
    server = ServerThread(
        path,
        http_port=0,
        metrics_port=None,
        tool_call_parser="hermes",
        reasoning_parser="deepseek_r1",
        llm_kwargs={**LLM_KWARGS, "speculative_config": spec},
    )
    server.model_dir = path
    yield server
    server.stop()


THINK_PROMPTS = [
    [{"role": "user", "content": "Read a file."}],
    [{"role": "user", "content": "Write a function."}],
    [{"role": "user", "content": "What is the weather in Paris?"}],
    [{"role": "user", "content": "How do I sort a list?"}],
]
THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True}}
# (prompt, temperature, seed): greedy, the first prompt ends its reasoning early; the
# others do when sampled (the greedy demo model loops).
THINK_CASES = [(0, 0.0, 0)] + [(i, 1.0, seed) for i in range(4) for seed in (2, 3)]


def test_reasoning_is_split_from_the_answer(thinking):
    """reasoning_content is the text before `</think>`, content what follows it
    (less leading whitespace); streamed as their own deltas, to the same."""
    client = client_of(thinking.server.http_port)
    tok = Tokenizer(thinking.model_dir)
    ended = 0
    for i, temperature, seed in THINK_CASES:
        kw = dict(
            model="tiny",
            messages=THINK_PROMPTS[i],
            max_completion_tokens=300,
            temperature=temperature,
            seed=seed,
        )
        out = client.chat.completions.create(
            **kw, extra_body={**THINKING_ON, "return_token_ids": True}
        )
        c = out.choices[0]
        text = tok.decode(c.model_extra["token_ids"], skip_special_tokens=False)
        if "</think>" in text:
            ended += 1
            reasoning, answer = text.split("</think>", 1)
            assert c.message.content == answer.lstrip()
        else:
            reasoning = text
            assert not c.message.content
        assert c.message.model_extra["reasoning_content"] == (reasoning or None)
        chunks = list(client.chat.completions.create(**kw, extra_body=THINKING_ON, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
        assert streamed == reasoning
        assert "".join(d.content or "" for d in deltas) == (c.message.content or "")
    assert ended >= len(THINK_CASES) // 2, ended  # the split was seen


def test_output_constraints_apply_to_the_answer_after_the_reasoning(thinking):
    """A JSON schema, and tool calls, hold for the answer only: the reasoning before
    `</think>` is free text. Speculative decoding is on: constrained replies are not
    drafted for (the engine fills a grammar's bitmask for one token at a time), while
    an unconstrained reply in the same batches is."""
    client = client_of(thinking.server.http_port)
    before = thinking.engine.stats()
    beside = concurrent.futures.ThreadPoolExecutor(1).submit(
        client_of(thinking.server.http_port).chat.completions.create,
        model="tiny",
        messages=THINK_PROMPTS[1],
        max_completion_tokens=400,
        temperature=0,
        extra_body=THINKING_ON,
    )
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["n", "tags"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    answered = called = 0
    for i, temperature, seed in THINK_CASES:
        kw = dict(
            model="tiny",
            messages=THINK_PROMPTS[i],
            max_completion_tokens=400,
            temperature=temperature,
            seed=seed,
            extra_body=THINKING_ON,
        )
        c = client.chat.completions.create(**kw, response_format=response_format).choices[0]
        reasoning = c.message.model_extra["reasoning_content"]
        assert reasoning and "</think>" not in reasoning
        if c.finish_reason != "length":  # (the reasoning may run to max_tokens)
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), schema)
            answered += 1
        c = client.chat.completions.create(
            **kw, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
        ).choices[0]
        assert c.message.model_extra["reasoning_content"]
        if c.finish_reason != "length":
            check_calls(c, "required", False)
            called += 1
    assert answered >= len(THINK_CASES) // 2 and called >= len(THINK_CASES) // 2
    assert beside.result().choices[0].message.model_extra["reasoning_content"]
    after = thinking.engine.stats()
    assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens


def test_qwen3_reasons_only_when_thinking(thinking):
    """qwen3: with enable_thinking false the template closes an empty <think> block,
    and the whole reply is the answer; with it on, the reply reasons first."""
    with app_with(thinking, ChatParsers(reasoning_parser="qwen3")) as client:
        kw = dict(model="tiny", messages=THINK_PROMPTS[0], max_completion_tokens=60, temperature=0)
        off = client.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        ).choices[0]
        assert off.message.model_extra["reasoning_content"] is None and off.message.content
        on = client.chat.completions.create(**kw, extra_body=THINKING_ON).choices[0]
        assert on.message.model_extra["reasoning_content"]
