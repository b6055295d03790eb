"""Each malformed request gets a 400 that names the field and what is wrong with it, in the endpoint's own
error shape (issue 46, items 7 and 8)."""
from __future__ import annotations

import httpx
import pytest

from server_helpers import assert_error_shape, engine_config, start_server

JSON = {"content-type": "application/json"}
CHAT = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1'


@pytest.fixture(scope="module")
def url():
    s = start_server(engine_config())
    yield s.url
    s.stop()


@pytest.mark.parametrize("path,body,offset", [
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"a\xff"}]}', 40),
    ("/v1/responses", b'{"input":"caf\xe9"}', 13)])
def test_invalid_utf8_names_the_byte(url, path, body, offset):
    err = assert_error_shape(httpx.post(url + path, content=body, headers=JSON), 400)
    assert "not valid UTF-8" in err["message"] and f"offset {offset}" in err["message"], err


def test_too_deep_json_says_so(url):
    deep = "[" * 5000 + "]" * 5000
    for path, body in [("/v1/chat/completions", '{"messages":' + deep + "}"),
                       ("/v1/responses", '{"input":"hi","metadata":{"a":' + deep + "}}")]:
        err = assert_error_shape(httpx.post(url + path, content=body, headers=JSON), 400)
        assert "nested too deeply" in err["message"], err


def test_lone_surrogate_in_a_key_names_only_what_was_sent(url):
    err = assert_error_shape(httpx.post(url + "/v1/chat/completions", content=CHAT + ',"\\udcff":1}', headers=JSON),
                             400, param=None)
    assert "field name" in err["message"] and "surrogate" in err["message"] and "body" not in err["message"], err
    err = assert_error_shape(httpx.post(url + "/v1/responses", content='{"input":"a","metadata":{"\\udcff":"x"}}',
                                        headers=JSON), 400, param="metadata")
    assert "key in metadata" in err["message"], err


def test_json_schema_errors_name_the_schema_not_json(url):
    bad = {"type": "bogus"}
    r = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}})
    err = assert_error_shape(r, 400, param="response_format.json_schema")
    assert err["message"].startswith("response_format.json_schema:") and "'json'" not in err["message"], err
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1,
                                                "text": {"format": {"type": "json_schema", "name": "x", "schema": bad}}})
    err = assert_error_shape(r, 400, param="text.format.schema")
    assert err["message"].startswith("text.format.schema:") and "'json'" not in err["message"], err


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                       ("/v1/completions", {"prompt": "hi", "stream": False})])
def test_stream_options_need_stream(url, path, body):
    r = httpx.post(url + path, json={**body, "max_tokens": 1, "stream_options": {"include_usage": True}})
    err = assert_error_shape(r, 400, param="stream_options")
    assert "stream: true" in err["message"]
    ok = httpx.post(url + path, json={**body, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}})
    assert ok.status_code == 200 and "[DONE]" in ok.text


def test_unsupported_responses_include_is_refused(url):
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1,
                                                "include": ["file_search_call.results"]})
    err = assert_error_shape(r, 400, param="include")
    assert "file_search_call.results" in err["message"] and "message.output_text.logprobs" in err["message"]
    ok = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1,
                                                 "include": ["message.output_text.logprobs"]})
    assert ok.status_code == 200, ok.text


# ---- the Host header check (DNS rebinding) --------------------------------------------------------------
def test_loopback_server_answers_only_loopback_host_names():
    from kvinfer.server.hosts import allowed_hosts_for

    s = start_server(engine_config(), allowed_hosts=allowed_hosts_for("127.0.0.1", ["myhost.lan"]))
    try:
        for host in ("evil.example.com", "evil.example.com:8000", "127.0.0.1.nip.io"):
            r = httpx.get(s.url + "/v1/models", headers={"Host": host})
            err = assert_error_shape(r, 403, param=None)
            assert host.split(":")[0] in err["message"] and "--allowed-hosts" in err["message"], err
        assert httpx.get(s.url + "/", headers={"Host": "evil.example.com"}).status_code == 403  # the page too
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "MyHost.lan:1234", "127.0.0.2"):
            assert httpx.get(s.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    finally:
        s.stop()


def test_allowed_hosts_for_the_bind_address():
    from kvinfer.server.hosts import allowed_hosts_for

    assert allowed_hosts_for("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts_for("localhost", ["a.lan,b.lan"]) >= {"a.lan", "b.lan", "localhost"}
    assert allowed_hosts_for("127.0.0.1", ["*"]) is None
    assert allowed_hosts_for("0.0.0.0") is None  # bound to the network: the operator's proxy decides
    assert allowed_hosts_for("0.0.0.0", ["api.example.com"]) == {"api.example.com"}
