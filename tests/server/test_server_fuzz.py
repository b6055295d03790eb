"""Schemathesis fuzzes the server from its own OpenAPI document: no input may cause a 5xx."""
from __future__ import annotations

import json
import time
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from server_helpers import engine_config, kv_blocks_used, start_server

# A tiny context window keeps every fuzzed generation short (n <= 16 samples of < 48 tokens each).
FUZZ_MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def fuzz_server():
    s = start_server(engine_config(max_model_len=FUZZ_MAX_MODEL_LEN, max_num_seqs=32, kv_cache_memory=64 << 20))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


# Listed here rather than via schemathesis' pytest plugin, whose lazy fixture loader does not run on this
# pytest; a test below checks that this list is every operation the document has.
OPERATIONS = [("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
              ("GET", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}/input_items"),
              ("DELETE", "/v1/responses/{response_id}"), ("POST", "/v1/messages"),
              ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/embeddings")]
HEAVY = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings"}


def test_openapi_documents_request_bodies(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.startswith("#/components/schemas/")
        assert "422" not in doc["paths"][path]["post"]["responses"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["n"]["anyOf"][0]["maximum"] >= 1 and "maximum" in props["logprobs"]["anyOf"][0]
    assert fuzz_server.model_name in props["model"]["anyOf"][0]["enum"]


def test_operations_list_is_complete(api_schema):
    found = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


# Negative cases (bodies that break the schema) exist only where there is a body.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + \
    [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_no_server_errors(api_schema, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=25 if path in HEAVY else 10, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate, Phase.shrink], database=None)
    def fuzz(case):
        case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)

    fuzz()


# Any code point, lone surrogates included: JSON can escape them (\\udcff) though they are not Unicode.
# Lone surrogates are drawn on purpose: they are 2048 of 1.1M code points, and two adjacent ones in JSON
# (\\ud83d\\ude00) make one valid character, so uniform draws would almost never send one.
TEXT = st.lists(st.characters() | st.sampled_from(["\udcff", "\ud800 ", "{", " "]), max_size=10).map("".join)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                           "content": TEXT}, optional={"name": TEXT, "tool_call_id": TEXT}),
                    min_size=1, max_size=2)
TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT | st.just("f")}, optional={"description": TEXT, "parameters": JSON})}), max_size=2)
FORMATS = st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                optional={"json_schema": st.fixed_dictionaries(
                                    {"name": TEXT}, optional={"schema": st.dictionaries(TEXT, JSON, max_size=2)})})
PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                       "text": TEXT}), max_size=2)
ITEMS = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                           "content": TEXT | PARTS}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": TEXT | st.just("f"),
                           "arguments": TEXT | st.just("{}")}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT | PARTS}),
    JSON), max_size=3)
BLOCKS = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "thinking"]), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": TEXT | st.just("f"), "input": JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT},
                          optional={"content": TEXT | st.lists(st.fixed_dictionaries(
                              {"type": st.just("text"), "text": TEXT}), max_size=2), "is_error": st.booleans()}),
    JSON), max_size=3)
ANTHROPIC = st.fixed_dictionaries({"model": TEXT, "max_tokens": st.just(1), "messages": st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": TEXT | BLOCKS}),
    min_size=1, max_size=2)}, optional={
    "system": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
    "stop_sequences": st.lists(TEXT, max_size=2), "stream": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"name": TEXT | st.just("f"), "input_schema": st.dictionaries(
        TEXT, JSON, max_size=2)}), max_size=2),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                         optional={"name": TEXT | st.just("f")})})
BODIES = {
    "/v1/messages": ANTHROPIC,
    "/v1/embeddings": st.fixed_dictionaries({"input": TEXT | st.lists(TEXT, max_size=3) | st.lists(
        st.integers(-2, 60000), max_size=3)}, optional={"dimensions": st.integers(-1, 1000), "model": TEXT,
                                                         "encoding_format": st.sampled_from(["float", "base64", "x"])}),
    "/v1/messages/count_tokens": ANTHROPIC,
    "/v1/completions": st.fixed_dictionaries({"prompt": TEXT | st.lists(TEXT, min_size=1, max_size=2),
                                             "max_tokens": st.just(1)},
                                            optional={"stop": TEXT, "model": TEXT, "response_format": FORMATS}),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": MESSAGES, "max_tokens": st.just(1)}, optional={
        "stop": st.lists(TEXT, max_size=2), "tools": TOOLS, "response_format": FORMATS,
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.just({"type": "function",
                                                                             "function": {"name": "f"}})}),
    "/v1/responses": st.fixed_dictionaries({"input": TEXT | ITEMS, "max_output_tokens": st.just(1)}, optional={
        "instructions": TEXT, "previous_response_id": TEXT, "include": st.lists(TEXT, max_size=2),
        "top_logprobs": st.integers(0, 3), "tools": st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search"]), "name": TEXT | st.just("f")},
            optional={"parameters": JSON}), max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.just({"type": "function", "name": "f"}),
        "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema"])},
            optional={"name": TEXT, "schema": st.dictionaries(TEXT, JSON, max_size=2)})})}),
    "/tokenize": st.fixed_dictionaries({}, optional={"prompt": TEXT, "messages": MESSAGES, "model": TEXT}),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 100), max_size=3)},
                                         optional={"model": TEXT}),
}


@pytest.mark.parametrize("path", list(BODIES))
def test_arbitrary_unicode_bodies(fuzz_server, path):
    """Every endpoint answers bodies with any Unicode (or none: lone surrogates) with a 2xx/4xx JSON response."""
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as c:
        @given(body=BODIES[path] | JSON)
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(body):
            r = c.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            assert r.status_code < 500, (body, r.status_code, r.text)
            assert r.status_code == 200 or "error" in r.json(), r.text

        fuzz()


def test_arbitrary_unicode_in_paths(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        @given(name=TEXT)
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(name):
            r = c.get("/v1/models/" + quote(name.encode("utf-8", "surrogatepass"), safe=""))
            assert r.status_code in (200, 404), (name, r.status_code, r.text)
            r.json()

        fuzz()


def test_lone_surrogates_are_a_400_naming_the_field(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        for path, raw, param in [
                ("/v1/completions", '{"prompt": "\\udcff", "max_tokens": 1}', "prompt"),
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
                 "messages[0].content"),
                ("/v1/responses", '{"input": [{"role": "user", "content": "\\udcff"}]}', "input[0].content"),
                ("/tokenize", '{"prompt": "\\udcff"}', "prompt"),
                ("/detokenize", '{"tokens": [1], "model": "\\udcff"}', "model")]:
            r = c.post(path, content=raw.encode(), headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == param and "surrogate" in err["message"], err


def test_server_is_healthy_and_kv_free_after_fuzzing(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok"}
        deadline = time.monotonic() + 15
        while kv_blocks_used(c.get("/metrics").text) != 0:
            assert time.monotonic() < deadline, "KV blocks still in use after fuzzing"
            time.sleep(0.1)
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
