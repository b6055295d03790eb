"""POST /v1/responses (and GET / DELETE of stored ones) with the official `openai` client against `kvinfer serve`."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from kvinfer.server.openai_responses import ResponseStore
from server_helpers import assert_error_shape, engine_config, kv_blocks_used, start_server

QUESTION = "What is the capital of France?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    # Strict: every body and event must validate against the SDK's own types.
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, _strict_response_validation=True)


def chat(client, messages, **kw):
    """The same request as a greedy chat completion."""
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, temperature=0,
                                          **kw)


def test_text_answer_equals_chat_completion(client, srv):
    r = client.responses.create(model=srv.model_name, input=QUESTION, temperature=0, max_output_tokens=24)
    c = chat(client, [{"role": "user", "content": QUESTION}], max_completion_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == srv.model_name
    assert r.output_text == c.choices[0].message.content and "Paris" in r.output_text
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.output[0].content[0].logprobs is None  # only with include


def test_previous_response_continues_the_conversation(client, srv):
    first = client.responses.create(model=srv.model_name, input=QUESTION, temperature=0, max_output_tokens=16,
                                    instructions="Answer briefly.")
    second = client.responses.create(model=srv.model_name, input="And of Germany?", temperature=0,
                                     max_output_tokens=16, previous_response_id=first.id,
                                     instructions="Answer in one sentence.")
    # The instructions of the first response are not carried over; its answer is.
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Germany?"}]
    c = chat(client, messages, max_completion_tokens=16)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_store_false_delete_and_unknown_ids(client, srv):
    kept = client.responses.create(model=srv.model_name, input="Hi", max_output_tokens=2)
    gone = client.responses.create(model=srv.model_name, input="Hi", max_output_tokens=2, store=False)
    assert gone.store is False and kept.store is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=srv.model_name, input="Hi", previous_response_id=gone.id)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    assert_error_shape(httpx.delete(srv.url + f"/v1/responses/{kept.id}"), 404, "response_id")


def test_stream_events_build_the_same_response(client, srv):
    kw = dict(model=srv.model_name, input="Name three colors.", temperature=0, max_output_tokens=20)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(e.delta for e in deltas) == whole.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas) and events[-1].response.output[0].id == item_id
    u, w = events[-1].response.usage, whole.usage  # (cached_tokens differ: the second request hits the prefix cache)
    assert events[-1].response.output_text == whole.output_text
    assert (u.input_tokens, u.output_tokens) == (w.input_tokens, w.output_tokens)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # The SDK's accumulating helper reads the same events into the same answer.
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()
    assert final.output_text == whole.output_text
    assert client.responses.retrieve(events[-1].response.id).output_text == whole.output_text


def test_incomplete_with_logprobs_as_chat_reports_them(client, srv):
    r = client.responses.create(model=srv.model_name, input="Count from one to one hundred.", temperature=0,
                                max_output_tokens=3, include=["message.output_text.logprobs"], top_logprobs=2)
    c = chat(client, [{"role": "user", "content": "Count from one to one hundred."}], max_completion_tokens=3,
             logprobs=True, top_logprobs=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    lps = r.output[0].content[0].logprobs
    want = c.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in lps] == [(x.token, x.logprob) for x in want] and len(lps) == 3
    assert all(len(x.top_logprobs) == 2 for x in lps)
    events = list(client.responses.create(model=srv.model_name, input="Count from one to one hundred.",
                                          temperature=0, max_output_tokens=3, stream=True,
                                          include=["message.output_text.logprobs"], top_logprobs=2))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in want]
    assert events[-1].type == "response.incomplete"


def test_function_call_and_its_output(client, srv):
    r = client.responses.create(model=srv.model_name, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                max_output_tokens=48)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"city"}
    follow = client.responses.create(model=srv.model_name, previous_response_id=r.id, tools=TOOLS, temperature=0,
                                     max_output_tokens=16, input=[{"type": "function_call_output",
                                                                   "call_id": calls[0].call_id,
                                                                   "output": "22 C and sunny"}])
    # The same turn as a chat: the assistant's call, then the tool's answer.
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": "22 C and sunny"}]
    c = chat(client, messages, tools=CHAT_TOOLS, max_completion_tokens=16)
    assert follow.usage.input_tokens == c.usage.prompt_tokens
    assert follow.output_text == (c.choices[0].message.content or "")
    # The same conversation sent whole, without the store, is the same prompt.
    whole = client.responses.create(model=srv.model_name, tools=TOOLS, temperature=0, max_output_tokens=16,
                                    store=False, input=[
                                        {"role": "user", "content": "What is the weather in Paris?"},
                                        {"type": "function_call", "call_id": calls[0].call_id,
                                         "name": "get_weather", "arguments": calls[0].arguments},
                                        {"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "22 C and sunny"}])
    assert whole.usage.input_tokens == follow.usage.input_tokens and whole.output_text == follow.output_text


def test_streamed_function_call(client, srv):
    kw = dict(model=srv.model_name, input="What is the weather in Rome?", tools=TOOLS,
              tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=48)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call" and added[0].item.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    final = events[-1].response
    assert args == done.arguments == final.output[0].arguments == whole.output[0].arguments
    assert final.output[0].id == added[0].item.id and final.output[0].status == "completed"
    assert json.loads(args)["city"]


def test_json_schema_format(client, srv):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=srv.model_name, input="Describe a person.", temperature=0,
                                max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    obj = json.loads(r.output_text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


@pytest.mark.parametrize("body,param,says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "images"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "type 'reasoning'"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "item 0 (role)"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "call_id"),
    ({"input": []}, "input", "empty"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning", "does not reason"),
    ({"input": "x", "truncation": "auto"}, "truncation", "context window"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format", "name and a schema"),
    ({"input": "x", "previous_response_id": "resp_missing"}, "previous_response_id", "not found"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than"),
    # the chat machinery's errors name the Responses request's own fields
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens (100000)"),
    ({"input": "word " * 1100}, "input", "context window"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}}},
     "text.format.schema", "text.format.schema: the grammar is invalid"),
])
def test_bad_requests_get_clear_errors(srv, body, param, says):
    err = assert_error_shape(httpx.post(srv.url + "/v1/responses", json=body), 404 if param == "model" else 400,
                             param)
    assert says in err["message"], err
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


def test_store_keeps_the_newest_within_its_byte_budget():
    store = ResponseStore(max_bytes=400)
    conv = lambda n: [{"role": "user", "content": "x" * n}]  # noqa: E731
    for i in range(4):
        store.put({"id": f"r{i}"}, conv(40))  # 83 bytes of JSON each
    assert store.bytes == sum(e.size for e in store.items.values()) == 4 * store.items["r0"].size <= 400
    assert store.get("r0") is not None and store.evicted == 0
    store.put({"id": "big", "metadata": {"k": "y" * 150}}, conv(10))  # the body's bytes count too
    assert store.get("r0") is None and store.get("big") is not None and store.evicted >= 1
    store.put({"id": "huge"}, conv(400))  # could never fit: not kept, nothing else dropped for it
    assert store.get("huge") is None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big")
    assert store.bytes == sum(e.size for e in store.items.values())


def _events(srv, body) -> list[dict]:
    """The raw SSE events of a streamed response: each `event:` line must name its data's type."""
    out = []
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == kind
                out.append(data)
    return out


def _kv_free(srv, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while kv_blocks_used(httpx.get(srv.url + "/metrics").text) != 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_failing_step_ends_the_stream_with_an_error_event(srv):
    eng = srv.engine.engine
    real_step = eng.step_core

    def broken_step():
        eng.step_core = real_step  # fail once
        raise RuntimeError("injected failure")

    eng.step_core = broken_step
    try:
        events = _events(srv, {"input": "Hi", "max_output_tokens": 4})
    finally:
        eng.step_core = real_step
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "error" and "injected failure" in events[-1]["message"]
    assert _kv_free(srv) and httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert _events(srv, {"input": "Hi", "max_output_tokens": 2})[-1]["type"] in ("response.completed",
                                                                                "response.incomplete")


def test_a_client_that_leaves_mid_stream_frees_its_blocks(srv):
    body = {"input": "Tell me a very long story about a lighthouse.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # leave after the first token
    assert _kv_free(srv)


def test_events_for_text_then_whole_calls():
    """The event mapping alone: text, then two calls sent whole at the end (how `auto` tool output streams)."""
    from kvinfer.server.openai_responses import ResponseBuilder, ResponsesRequest, _EventStream

    b = ResponseBuilder(ResponsesRequest.model_validate({"input": "x", "tools": TOOLS}), "m", [])
    es = _EventStream(b)
    calls = [{"index": i, "id": f"call_{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
             for i, c in enumerate(["Oslo", "Rome"])]
    raw = es.choice({"index": 0, "delta": {"content": "Let me check."}, "logprobs": None, "finish_reason": None})
    raw += es.choice({"index": 0, "delta": {"content": " Both.", "tool_calls": calls}, "logprobs": None,
                      "finish_reason": None})
    raw += es.choice({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"})
    events = [json.loads(r.split("data: ", 1)[1]) for r in raw]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [(i["type"], i.get("call_id")) for i in es.output] == [("message", None), ("function_call", "call_0"),
                                                                 ("function_call", "call_1")]
    assert es.output[0]["content"][0]["text"] == "Let me check. Both."
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert b.conversation(es.output)[-1] == {"role": "assistant", "content": "Let me check. Both.",
                                             "tool_calls": [{k: v for k, v in c.items() if k != "index"}
                                                            for c in calls]}


def test_input_items_list_the_request_input(client, srv):
    items = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "3 C, snow"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Snowy."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text",
                                                                                   "text": "tomorrow?"}]}]
    r = client.responses.create(model=srv.model_name, input=items, tools=TOOLS, max_output_tokens=2)
    newest_first = list(client.responses.input_items.list(r.id))  # the SDK pages with limit 20, newest first
    assert [i.type for i in newest_first] == ["message", "message", "function_call_output", "function_call",
                                              "message", "message"]
    oldest_first = list(client.responses.input_items.list(r.id, order="asc", limit=2))  # three pages of two
    assert [i.id for i in oldest_first] == [i.id for i in newest_first][::-1]
    assert oldest_first[0].role == "system" and oldest_first[0].content[0].text == "Be brief."
    assert oldest_first[2].call_id == "call_1" and oldest_first[2].arguments == '{"city": "Oslo"}'
    assert oldest_first[3].output == "3 C, snow" and oldest_first[4].content[0].type == "output_text"
    assert oldest_first[5].content[0].text == "And tomorrow?"
    page = httpx.get(srv.url + f"/v1/responses/{r.id}/input_items",
                     params={"order": "asc", "after": oldest_first[1].id, "before": oldest_first[4].id}).json()
    assert [i["id"] for i in page["data"]] == [i.id for i in oldest_first[2:4]] and page["has_more"] is False
    assert [i.type for i in client.responses.input_items.list(
        client.responses.create(model=srv.model_name, input="Hi", max_output_tokens=1).id)] == ["message"]
    for params, param in [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_none"}, "after")]:
        assert_error_shape(httpx.get(srv.url + f"/v1/responses/{r.id}/input_items", params=params), 400, param)
    assert_error_shape(httpx.get(srv.url + "/v1/responses/resp_none/input_items"), 404, "response_id")
