"""Schemathesis fuzzes the server from its own OpenAPI document: no input may cause a 5xx."""
from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
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
OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions")]
HEAVY = {"/v1/completions", "/v1/chat/completions"}


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


def test_server_is_healthy_and_kv_free_after_fuzzing(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok"}
        deadline = time.monotonic() + 15
        while kv_blocks_used(c.get("/metrics").text) != 0:
            assert time.monotonic() < deadline, "KV blocks still in use after fuzzing"
            time.sleep(0.1)
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
