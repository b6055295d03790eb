"""A tool's parameters schema resolves its `$ref`s against itself, recursion included, whether the call is
forced by name or by tool_choice: required, which wraps every tool in one schema (issue 46, item 6)."""
from __future__ import annotations

import json

import httpx
import pytest

from kvinfer.errors import ValidationError
from kvinfer.server.tool_calls import forced_call_spec
from server_helpers import assert_error_shape, engine_config, start_server

TREE = {"type": "object", "properties": {"value": {"type": "integer"},
                                         "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
        "required": ["value", "children"]}
TREE_OPT = {**TREE, "required": ["value"]}  # the model may end the recursion (it nests for ever where it must not)
DEFS = {"type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}},
                                          "required": ["x"]}},
        "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}


def _resolve(root: dict, ref: str):
    node = root
    for part in ref.lstrip("#").split("/")[1:]:
        node = node[part]
    return node


def _tools(*schemas) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": s}} for i, s in enumerate(schemas)]


def test_required_wrapper_resolves_each_tools_refs_against_its_own_schema():
    spec, _ = forced_call_spec(_tools(TREE, DEFS), "required", True)
    root = spec.json
    for i, schema in enumerate((TREE, DEFS)):
        args = _resolve(root, root["items"]["anyOf"][i]["properties"]["arguments"]["$ref"])
        assert args["properties"].keys() == schema["properties"].keys()
        if schema is TREE:  # '#' inside the tool is the tool, not the wrapper array
            assert _resolve(root, args["properties"]["children"]["items"]["$ref"]) is args
        else:
            assert _resolve(root, args["properties"]["p"]["$ref"])["required"] == ["x"]


def test_a_ref_to_another_document_is_refused_naming_tool_and_keyword():
    with pytest.raises(ValidationError) as e:
        forced_call_spec(_tools(TREE, {"type": "object", "properties": {"a": {"$ref": "http://x/s.json"}}}),
                         "required", True)
    assert e.value.param == "tools[1].function.parameters" and "$ref" in str(e.value)


def _valid_tree(v) -> bool:
    return (isinstance(v, dict) and set(v) <= {"value", "children"} and isinstance(v["value"], int)
            and isinstance(v.get("children", []), list) and len(v.get("children", [])) <= 1
            and all(map(_valid_tree, v.get("children", []))))


@pytest.fixture(scope="module")
def url():
    s = start_server(engine_config())
    yield s.url
    s.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f0"}}])
@pytest.mark.parametrize("schema,valid", [(TREE_OPT, _valid_tree),
                                          (DEFS, lambda v: set(v) == {"p"} and isinstance(v["p"]["x"], int))])
def test_recursive_and_defs_refs_give_a_valid_call(url, choice, schema, valid):
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "make a tree with value 1"}], "max_tokens": 120, "temperature": 0,
        "tools": _tools(schema), "tool_choice": choice})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    calls = msg.get("tool_calls") or []
    assert len(calls) >= 1, msg
    assert valid(json.loads(calls[0]["function"]["arguments"])), calls[0]


def test_external_ref_is_a_400_naming_the_tool(url):
    r = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "tools": _tools({"type": "object", "properties": {"a": {"$ref": "http://x/s.json"}}}), "tool_choice": "required"})
    err = assert_error_shape(r, 400, param="tools[0].function.parameters")
    assert "$ref" in err["message"]
