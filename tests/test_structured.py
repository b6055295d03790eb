"""Structured outputs in the Python API (JSON Schema, regex, choice through llguidance) and the tool-call parsers."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvinfer.engine.llm import LLM
from kvinfer.errors import ValidationError
from kvinfer.sampling_params import SamplingParams, StructuredOutput
from kvinfer.server.tool_calls import (HERMES, LLAMA3, ToolStream, closed_objects, parse_tool_calls,
                                  parser_for_template)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}}}}


@pytest.fixture(scope="module")
def llm(builtin_llm):
    return builtin_llm


def chat(llm, question):
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)


def test_json_regex_choice_n_and_stop_in_one_batch(llm):
    p = chat(llm, "Describe a person with pets as JSON.")
    outs = llm.generate([p, p, p, p, p], [
        SamplingParams(max_tokens=80, temperature=0, structured_output={"json": PERSON}),
        SamplingParams(max_tokens=60, temperature=1.0, seed=7, n=3, structured_output=StructuredOutput(json=True)),
        SamplingParams(max_tokens=12, temperature=0.7, seed=1, structured_output={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
        SamplingParams(max_tokens=8, temperature=0, structured_output={"choice": ["red fox", "blue whale"]}),
        # A stop string still ends a constrained request early.
        SamplingParams(max_tokens=8, temperature=0, stop=[" "], structured_output={"choice": ["red fox", "red"]}),
    ])
    person = outs[0].outputs[0]
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    assert len(outs[1].outputs) == 3
    for o in outs[1].outputs:
        assert o.finish_reason == "length" or isinstance(json.loads(o.text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[2].outputs[0].text)
    assert outs[3].outputs[0].text in ("red fox", "blue whale")
    stopped = outs[4].outputs[0]
    assert stopped.text == "red" and stopped.finish_reason == "stop"


def test_min_tokens_under_a_grammar(llm):
    p = chat(llm, "What color is the sky? One word.")
    words = {"regex": "[a-z]+( [a-z]+)*"}
    short, longer, choice = llm.generate([p, p, p], [
        SamplingParams(max_tokens=20, temperature=0, structured_output=words),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=12, structured_output=words),
        # Complete before min_tokens: the grammar's end wins, the request stops.
        SamplingParams(max_tokens=20, temperature=0, min_tokens=15, structured_output={"choice": ["yes", "no"]}),
    ])
    assert short.outputs[0].finish_reason == "stop" and len(short.outputs[0].token_ids) < 12
    assert re.fullmatch("[a-z]+( [a-z]+)*", longer.outputs[0].text) and len(longer.outputs[0].token_ids) >= 12
    assert choice.outputs[0].text in ("yes", "no") and choice.outputs[0].finish_reason == "stop"


def test_length_before_the_json_closes(llm):
    out = llm.generate(chat(llm, "JSON please"), SamplingParams(max_tokens=3, temperature=0,
                                                               structured_output={"json": PERSON}))[0].outputs[0]
    assert out.finish_reason == "length" and out.text.startswith("{")


def test_preempted_requests_keep_their_grammar():
    # Room for under two sequences: the others are preempted and recomputed mid-JSON.
    small = LLM(None, kv_cache_memory=4 << 20, max_model_len=256, block_size=16)
    p = chat(small, "Describe a person with pets as JSON.")
    outs = small.generate([p] * 6, SamplingParams(max_tokens=70, temperature=0.8, seed=3,
                                                 structured_output={"json": PERSON}))
    assert small.engine.scheduler.num_preemptions > 0
    for out in outs:
        o = out.outputs[0]
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), PERSON)
        else:  # cut by max_tokens: still a prefix of valid JSON, never garbage
            assert o.text.startswith("{")
    small.engine.check_integrity()


def test_compiled_grammars_are_cached(llm):
    llm.generate(chat(llm, "hi"), SamplingParams(max_tokens=2, structured_output={"regex": "[ab]+c"}))
    stats = dict(llm.engine.sampler.grammars.stats)
    # The same schema with keys in another order is the same grammar.
    llm.generate(chat(llm, "hi"), SamplingParams(max_tokens=2, structured_output={"regex": "[ab]+c"}))
    assert llm.engine.sampler.grammars.stats["compiled"] == stats["compiled"]
    assert llm.engine.sampler.grammars.stats["cache_hits"] == stats["cache_hits"] + 1


@pytest.mark.parametrize("spec,needle", [
    ({"json": {"type": "nonsense"}}, "nonsense"),
    ({"json": '{"type": '}, "not valid JSON"),
    ({"json": {"type": "string", "format": "no-such-format"}}, "no-such-format"),
    ({"regex": "(unclosed"}, "regex"),
    ({"choice": []}, "choice"),
    ({"json": True, "regex": "a"}, "exactly one"),
    ({"jsn": {}}, "unknown keys"),
])
def test_bad_specs_name_the_parameter(llm, spec, needle):
    """Rejected before anything is queued, by SamplingParams or when the grammar compiles."""
    with pytest.raises(ValidationError) as e:
        llm.engine.add_request("bad-spec", "hi", SamplingParams(structured_output=spec))
    assert e.value.param == "structured_output" and needle in str(e.value)
    assert "bad-spec" not in llm.engine.groups


# ---- tool-call parsing --------------------------------------------------------------------------------------
NAMES = {"get_weather", "get_time"}


def test_parser_chosen_from_template():
    assert parser_for_template("{{ '<tool_call>' }}") == HERMES
    assert parser_for_template("{{ '<|python_tag|>' }} ipython") == LLAMA3
    assert parser_for_template("{{ message.content }}") == HERMES


def test_hermes_calls_and_passthrough():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}'  # the last one cut before its tag
    content, calls = parse_tool_calls(text, HERMES, NAMES)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_time", {"tz": "CET"})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    for text in ("Just words.", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                 "<tool_call>{not json</tool_call>"):
        assert parse_tool_calls(text, HERMES, NAMES) == (text, [])


def test_llama3_calls():
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                                      '{"name": "get_weather", "parameters": {"city": "Oslo"}}', LLAMA3, NAMES)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo"}
    assert parse_tool_calls("The time is noon.", LLAMA3, NAMES) == ("The time is noon.", [])


def test_tool_stream_holds_back_a_possible_tag():
    ts = ToolStream(HERMES, NAMES)
    sent = "".join(ts.feed(d) for d in ["Let me ", "check.<tool", "_call>\n{\"name\": \"get_time\", ",
                                        "\"arguments\": {\"tz\": \"UTC\"}}\n</tool_call>"])
    assert sent == "Let me check."
    rest, calls = ts.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    plain = ToolStream(HERMES, NAMES)
    sent = "".join(plain.feed(d) for d in ["a <", "b"])
    rest, calls = plain.finish()
    assert sent + rest == "a <b" and not calls


def test_closed_objects():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {}}},
              "anyOf": [{"properties": {"a": {}}}], "$defs": {"x": {"properties": {}, "additionalProperties": True}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["x"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_bench_structured_json(capsys):
    from kvinfer.cli import main

    assert main(["bench", "structured", "--requests", "2", "--tokens", "4", "--rounds", "1",
                 "--kv-cache-memory", "32MiB", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    free, constrained = res["best"]["unconstrained"], res["best"]["json_schema"]
    assert free["decode_tokens"] == constrained["decode_tokens"] > 0  # same batch, same number of decode steps
    assert constrained["mask_calls"] > 0 and free["mask_calls"] == 0
    assert res["constrained_vs_unconstrained"] == constrained["decode_tps"] / free["decode_tps"]


def test_a_dead_grammar_ends_the_sequence_and_both_sampler_paths_agree(llm):
    # A matcher in an error state allows nothing: its row allows the EOS tokens (in bits, for the one-call C path,
    # and unpacked, for the per-row path), so the request ends instead of drawing from nothing.
    import torch

    from kvinfer.core.sampler import Sampler, SampleRow

    eng = llm.engine
    dead = eng.grammar_matcher(StructuredOutput(choice=["yes", "no"]))
    live = eng.grammar_matcher(StructuredOutput(choice=["yes", "no"]))
    compiler = eng.sampler.grammars
    bad = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert not dead.consume_token(bad)
    eos = set(compiler.eos_token_ids)
    allowed = compiler.allowed([dead, live])
    assert set(allowed[0].nonzero()[0].tolist()) == eos
    words = compiler.bitmask([dead]).numpy().view("uint32")[0]
    assert {w * 32 + b for w in range(len(words)) for b in range(32) if words[w] >> b & 1} == eos
    logits = torch.randn(4, allowed.shape[1], generator=torch.Generator().manual_seed(0))
    sp = [SamplingParams(temperature=0.9), SamplingParams(temperature=0), SamplingParams(temperature=1.2),
          SamplingParams(temperature=0)]
    grams = [dead, live, None, None]

    def rows(seed):
        return [SampleRow(p, [], [], torch.Generator().manual_seed(seed + i), (), g)
                for i, (p, g) in enumerate(zip(sp, grams))]

    fast = Sampler(compiler).sample(logits, rows(1)).token_ids  # all plain: one C call
    slow_rows = rows(1)
    slow_rows[3] = SampleRow(SamplingParams(temperature=0, logit_bias={0: 0.0}), [], [], None, (), None)
    slow = Sampler(compiler).sample(logits, slow_rows).token_ids  # a logit_bias row: the per-row path
    assert fast == slow
    assert fast[0] in eos and allowed[1][fast[1]] == 1
