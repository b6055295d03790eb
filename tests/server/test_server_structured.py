"""Structured outputs and tool calls through the official `openai` client against the built-in model."""
from __future__ import annotations

import asyncio
import json
from typing import Literal, Optional

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvinfer import SamplingParams
from server_helpers import assert_error_shape, engine_config, start_server

S = {"type": "string", "maxLength": 24}  # bounded strings keep a 135M model's answers short


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS = [
    obj({"name": S}),
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"city": S, "country": S, "population": {"type": "integer", "minimum": 0}}),
    obj({"answer": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 4}}),
    obj({"points": {"type": "array", "maxItems": 3, "items": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})}}),
    obj({"person": obj({"first": S, "last": S}), "email": S}),
    obj({"title": S, "subtitle": S}, required=["title"]),  # an optional field
    obj({"a": obj({"b": obj({"c": {"type": "integer", "minimum": 1, "maximum": 9}})})}),
    obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
    obj({"values": {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10},
                    "minItems": 1, "maxItems": 5}}),
    obj({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    obj({"when": {"type": "string", "format": "date"}}),
    obj({"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}),
    obj({"items": {"type": "array", "maxItems": 3, "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 99}})},
         "total": {"type": "integer", "minimum": 0, "maximum": 10000}}),
    obj({"ok": {"type": "boolean"}, "reason": S, "retry": {"type": "integer", "minimum": 0, "maximum": 5}},
        required=["ok"]),
    obj({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2,
                                                              "items": {"type": "integer"}}}}),
    {"type": "array", "maxItems": 3, "items": obj({"word": S, "len": {"type": "integer", "minimum": 0}})},
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"])}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": obj({"tz": S})}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ask(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


# The model copies the call format from earlier turns, so `auto` sees a real call to pass through.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris, 21 C."},
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_2", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"London\"}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "Rain, 12 C"},
    {"role": "assistant", "content": "It rains in London, 12 C."},
    {"role": "user", "content": "What is the weather in Berlin?"},
]


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config(max_model_len=1024, kv_cache_memory=96 << 20))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)


def gather(srv, make, args):
    """make(client, *a) for each a in args, all at once (so the engine batches them), in a fresh event loop."""
    async def run():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(make(c, *a) for a in args))

    return asyncio.run(run())


def test_json_mode_always_parses(srv):
    questions = ["Describe a cat.", "List three fruits.", "Who are you?", "What is 2+2?"]

    async def one(c, q, seed):
        return await c.chat.completions.create(
            model=srv.model_name, messages=ask(q + " Answer in JSON."), response_format={"type": "json_object"},
            temperature=0.8, seed=seed, max_tokens=120)

    for r in gather(srv, one, [(q, i) for i, q in enumerate(questions)]):
        c = r.choices[0]
        if c.finish_reason == "length":  # OpenAI's behaviour too; anything shorter must parse
            assert c.message.content.startswith("{")
            continue
        assert isinstance(json.loads(c.message.content), dict)


def test_twenty_json_schemas_validate(srv):
    async def one(c, i, schema):
        return await c.chat.completions.create(
            model=srv.model_name, messages=ask("Fill in this JSON schema with a short example."),
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}},
            temperature=0, max_tokens=200)

    results = gather(srv, one, list(enumerate(SCHEMAS)))
    for schema, r in zip(SCHEMAS, results):
        c = r.choices[0]
        assert c.finish_reason == "stop", (schema, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)


def test_completions_endpoint_takes_response_format(srv):
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": "The capital of France as JSON:", "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[0]}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMAS[0])


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    size: Literal["small", "medium", "large"]
    rank: Optional[int] = None


def test_parse_with_a_pydantic_model(srv, client):
    r = client.chat.completions.parse(model=srv.model_name, messages=ask("Describe Paris."), response_format=City,
                                      temperature=0, max_tokens=120)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.size in ("small", "medium", "large")


def _check_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    return call.function.name


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_always_parse(srv, tool_choice):
    questions = ["What is the weather in Oslo?", "What time is it in Tokyo?", "Tell me a joke."]

    async def one(c, q, seed):
        return await c.chat.completions.create(
            model=srv.model_name, messages=ask(q), tools=TOOLS, tool_choice=tool_choice, temperature=0.7,
            seed=seed, max_tokens=80, parallel_tool_calls=False)

    for r in gather(srv, one, [(q, i) for i, q in enumerate(questions)]):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert len(c.message.tool_calls) == 1
        name = _check_call(c.message.tool_calls[0])
        if isinstance(tool_choice, dict):
            assert name == "get_time"


def test_auto_passes_calls_through_and_streams_them(srv, client):
    r = client.chat.completions.create(model=srv.model_name, messages=FEW_SHOT, tools=TOOLS, temperature=0,
                                       max_tokens=40)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert _check_call(c.message.tool_calls[0]) == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments)["city"] == "Berlin"
    # Streamed: no tag leaks into content, the call arrives as tool_calls deltas, then finish_reason.
    content, calls, finish = _joined_stream(client, model=srv.model_name, messages=FEW_SHOT, tools=TOOLS,
                                            temperature=0, max_tokens=40)
    assert finish == "tool_calls" and "<tool_call>" not in content
    assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == \
        [("get_weather", json.loads(c.message.tool_calls[0].function.arguments))]
    # tool_choice none: the same text stays content.
    r = client.chat.completions.create(model=srv.model_name, messages=FEW_SHOT, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason == "stop" and "<tool_call>" in r.choices[0].message.content


def test_tokenize_renders_tools_as_chat_does(srv, client):
    msgs = ask("Weather in Oslo?")
    r = client.chat.completions.create(model=srv.model_name, messages=msgs, tools=TOOLS, max_tokens=1)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with_tools = c.post("/tokenize", json={"messages": msgs, "tools": TOOLS}).json()
        plain = c.post("/tokenize", json={"messages": msgs}).json()
        assert_error_shape(c.post("/tokenize", json={"prompt": "x", "tools": TOOLS}), 400, "tools")
    assert with_tools["count"] == r.usage.prompt_tokens > plain["count"]


def test_offline_chat_renders_tools_as_the_server_does(srv, builtin_llm):
    # LLM.chat(tools=...) and the chat endpoint give the same prompt tokens: tool definitions, assistant tool calls
    # and tool results alike (the built-in model's template has no place for tools: Hermes-style text).
    sp = SamplingParams(temperature=0, max_tokens=1)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for msgs, tools in ((ask("Weather in Oslo?"), TOOLS), (FEW_SHOT, TOOLS), (FEW_SHOT, None)):
            served = c.post("/tokenize", json={"messages": msgs, **({"tools": tools} if tools else {})}).json()
            [offline] = builtin_llm.chat(msgs, sp, tools=tools)
            assert offline.prompt_token_ids == served["tokens"]
    assert "<tool_call>" in builtin_llm.get_tokenizer().decode(builtin_llm.chat(FEW_SHOT, sp)[0].prompt_token_ids)


def _joined_stream(client, **kw):
    """content, {index: {name, arguments}} and finish_reason from a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_forced_call_sends_arguments_as_they_come(srv, client, tool_choice):
    chunks = list(client.chat.completions.create(
        model=srv.model_name, messages=ask("Time in Rome?"), tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice=tool_choice, stream=True))
    pieces = [tc.function.arguments for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert len(pieces) > 2  # arguments arrive in several deltas, not whole at the end
    content, calls, finish = _joined_stream(client, model=srv.model_name, messages=ask("Time in Rome?"),
                                            tools=TOOLS, temperature=0, max_tokens=60, tool_choice=tool_choice)
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["name"] in PARAMS
    if isinstance(tool_choice, dict):
        assert calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])


def test_forced_required_stream_deltas_rebuild_every_call():
    from kvinfer.server.tool_calls import ToolStream, parse_forced, partial_calls

    text = '[{"name": "get_weather", "arguments": {"city": "O\\"slo", "n": [1, {"a": "}"}]}}, ' \
           '{"name":"get_time","arguments":{}}]'
    assert partial_calls('[{"name": "get_wea') == [(None, "")]
    assert partial_calls('[{"name": "get_weather", "arguments": {"ci') == [("get_weather", '{"ci')]
    ts = ToolStream("hermes", {"get_weather", "get_time"}, forced=True)
    calls: dict = {}
    for ch in text:  # one character per step: every cut point of the output
        content, deltas = ts.step(ch)
        assert content == ""
        for d in deltas:
            slot = calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
            assert ("id" in d) == (slot["arguments"] == "")  # the id comes once, with the name
            slot["arguments"] += d["function"]["arguments"]
    assert ts.end() == ("", [], True)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c["name"], c["arguments"]) for c in json.loads(text)]
    # The whole reply's calls carry the same argument strings as the streamed deltas joined (as generated).
    assert [(c.name, c.arguments) for c in parse_forced(text, None)] == \
        [(c["name"], c["arguments"]) for c in calls.values()]
    assert [c.arguments for c in parse_forced('{"city": "Oslo",  "n": 1}', "get_weather")] == \
        ['{"city": "Oslo",  "n": 1}']


def test_streamed_json_schema_and_length(srv, client):
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=srv.model_name, messages=ask("A person as JSON."), stream=True, temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[1]}}))
    jsonschema.validate(json.loads(text), SCHEMAS[1])
    r = client.chat.completions.create(model=srv.model_name, messages=ask("A person as JSON."), max_tokens=3,
                                       temperature=0, response_format={"type": "json_schema", "json_schema": {
                                           "name": "p", "schema": SCHEMAS[1]}})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_structured_requests_are_400(srv, extra, param):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": ask("hi"), "max_tokens": 2, **extra})
        err = assert_error_shape(r, 400)
        assert (err["param"] or "").startswith(param), err
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
