"""Anthropic's Messages API through the official `anthropic` SDK, unmodified, against a real server."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from server_helpers import engine_config, kv_blocks_used, start_server

KEY = "sk-ant-test"
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config(), api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)


def _ask(client, model, **kw):
    base = dict(model=model, max_tokens=24, extra_body={"temperature": 0.0},
                messages=[{"role": "user", "content": "What is the capital of France?"}])
    base.update(kw)
    return client.messages.create(**base)


def test_create_answers_with_text_and_usage(client, srv):
    msg = _ask(client, srv.model_name)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == srv.model_name
    assert [b.type for b in msg.content] == ["text"]
    assert "Paris" in msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 10 and 0 < msg.usage.output_tokens <= 24


def test_same_answer_as_chat_completions(client, srv):
    system, question = "You are a helpful geography assistant.", "What is the capital of France?"
    msg = _ask(client, srv.model_name, system=system, max_tokens=20)
    chat = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
        "max_tokens": 20, "temperature": 0, "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": question}]}).json()
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_system_as_blocks_equals_system_as_string(client, srv):
    a = _ask(client, srv.model_name, system="Answer in one word.")
    b = _ask(client, srv.model_name, system=[{"type": "text", "text": "Answer in one word."}])
    assert a.content[0].text == b.content[0].text
    assert a.usage.input_tokens + a.usage.cache_read_input_tokens == \
        b.usage.input_tokens + b.usage.cache_read_input_tokens


def test_max_tokens_and_stop_sequences(client, srv):
    short = _ask(client, srv.model_name, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    full = _ask(client, srv.model_name, max_tokens=40)
    word = full.content[0].text.split()[1]
    cut = _ask(client, srv.model_name, max_tokens=40, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text and full.content[0].text.startswith(cut.content[0].text)


def test_stream_events_and_text_equal_create(client, srv):
    whole = _ask(client, srv.model_name, max_tokens=30)
    with client.messages.stream(model=srv.model_name, max_tokens=30, extra_body={"temperature": 0.0},
                                messages=[{"role": "user", "content": "What is the capital of France?"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "text" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_raw_sse_event_sequence(srv):
    body = {"model": "claude-anything", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", srv.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_tool_use_round_trip(client, srv):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=srv.model_name, max_tokens=40, extra_body={"temperature": 0.0}, messages=messages,
                                   tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input.get("city"), str)
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                               "content": "Sunny, 24 degrees Celsius."}]}]
    second = client.messages.create(model=srv.model_name, max_tokens=30, extra_body={"temperature": 0.0}, messages=messages,
                                    tools=[WEATHER])
    assert second.content and second.content[0].type == "text" and second.content[0].text
    # The tool result reached the prompt: it is longer than the same conversation without it.
    n_with = client.messages.count_tokens(model=srv.model_name, messages=messages, tools=[WEATHER]).input_tokens
    n_without = client.messages.count_tokens(model=srv.model_name, messages=messages[:2],
                                             tools=[WEATHER]).input_tokens
    assert n_with > n_without + 5


def test_streamed_tool_use_matches_whole(client, srv):
    kw = dict(model=srv.model_name, max_tokens=40, extra_body={"temperature": 0.0}, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Rome?"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in whole.content if b.type == "tool_use"]


def test_count_tokens_matches_usage(client, srv):
    kw = dict(model=srv.model_name, system="Be brief.", messages=[{"role": "user", "content": "Name a colour."}])
    n = client.messages.count_tokens(**kw).input_tokens
    msg = client.messages.create(max_tokens=4, **kw)
    assert n == msg.usage.input_tokens + msg.usage.cache_read_input_tokens and n > 5


def _error(resp, status: int, kind: str) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("body, needle", [
    ({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "Hi"}]}, "role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
    ({"model": "m", "max_tokens": 5, "temperature": 3, "messages": [{"role": "user", "content": "Hi"}]},
     "temperature"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
      "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"model": "m", "max_tokens": 100000, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ([1, 2], "JSON object"),
])
def test_bad_bodies_get_anthropic_errors(srv, body, needle):
    r = httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert needle in _error(r, 400, "invalid_request_error")


def test_bad_json_and_keys(srv):
    r = httpx.post(srv.url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY,
                                                                            "content-type": "application/json"})
    _error(r, 400, "invalid_request_error")
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    _error(httpx.post(srv.url + "/v1/messages", json=body), 401, "authentication_error")
    _error(httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"}), 401,
           "authentication_error")
    assert httpx.post(srv.url + "/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code \
        == 200
    # x-api-key opens the OpenAI routes too
    assert httpx.get(srv.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])


def test_sdk_raises_bad_request_and_server_keeps_serving(client, srv):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=srv.model_name, max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                               tools=[WEATHER], tool_choice={"type": "tool", "name": "missing"})
    assert "missing" in str(e.value)
    assert _ask(client, srv.model_name, max_tokens=2).usage.output_tokens == 2
    assert kv_blocks_used(httpx.get(srv.url + "/metrics").text) == 0
