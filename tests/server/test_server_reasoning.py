"""--reasoning-parser: <think>...</think> split into reasoning_content (chat, whole and streamed) and reasoning items
(responses); tool calls parsed from the answer only; enable_thinking reaches the template."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from kvinfer.engine.outputs import CompletionOutput, RequestOutput
from kvinfer.server.reasoning import ReasoningParser
from kvinfer.server.replies import ChatReply, TokenText
from kvinfer.server.tool_calls import ToolContext
from server_helpers import engine_config, start_server

TEXTS = ["<think>Let me see. 2+2 is 4.</think>\n\nThe answer is 4.", "<think>\nhmm</think>4", "The answer is 4.",
         "<think>unfinished thoughts", "2+2 is 4.</think>\n\nFour.", "", "<thi", "<think></think>x </think> y"]


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
def test_whole_split(kind):
    p = ReasoningParser(kind)
    assert p.split(TEXTS[0]) == ("Let me see. 2+2 is 4.", "The answer is 4.")
    assert p.split(TEXTS[1]) == ("\nhmm", "4")
    assert p.split(TEXTS[3]) == ("unfinished thoughts", "")
    assert p.split(TEXTS[4]) == ((None, TEXTS[4]) if kind == "qwen3" else ("2+2 is 4.", "Four."))
    # no tags at all: qwen3 thought nothing (thinking off), deepseek_r1's prompt opened <think> (cut short)
    assert p.split(TEXTS[2]) == ((None, "The answer is 4.") if kind == "qwen3" else ("The answer is 4.", ""))


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_streamed_pieces_join_to_the_whole_split(kind, text, piece):
    p = ReasoningParser(kind)
    s = p.stream()
    thought = answer = ""
    for i in range(0, len(text), piece):
        t, a = s.step(text[i:i + piece])
        thought, answer = thought + t, answer + a
    t, a = s.end()
    thought, answer = thought + t, answer + a
    whole_thought, whole_answer = p.split(text)
    assert (thought, answer) == (whole_thought or "", whole_answer) or (kind == "qwen3" and text.startswith("<thi")
                                                                        and answer == text and thought == "")


def _outputs(text: str, piece: int = 3):
    """Fake engine outputs streaming `text` a few characters at a time, then finished."""
    outs, acc = [], ""
    for i in range(0, len(text), piece):
        acc += text[i:i + piece]
        done = i + piece >= len(text)
        outs.append(RequestOutput("r", None, [1, 2], [CompletionOutput(
            0, acc, list(range(i // piece + 1)), "stop" if done else None, delta_text=text[i:i + piece])], done))
    return outs


def _reply(tools=None, kind="qwen3"):
    r = ChatReply("m", SimpleNamespace(request_ids=["r"], request_id="r"), TokenText(None), 1, None, tools)
    r.reasoning = ReasoningParser(kind)
    return r


def test_chat_reply_streams_reasoning_then_content():
    text = TEXTS[0]
    outs = _outputs(text)
    reply = _reply()
    chunks = [c for o in outs for c in reply.chunks(o)]
    thought = "".join(c["delta"].get("reasoning_content", "") for c in chunks)
    content = "".join(c["delta"].get("content", "") for c in chunks)
    assert (thought, content) == ("Let me see. 2+2 is 4.", "The answer is 4.")
    firsts = [i for i, c in enumerate(chunks) if c["delta"].get("content")]
    lasts = [i for i, c in enumerate(chunks) if c["delta"].get("reasoning_content")]
    assert max(lasts) < min(firsts)  # every reasoning delta before the answer's
    body = _reply().body({"r": outs[-1]})
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == thought and msg["content"] == content


def test_tool_calls_come_from_the_answer_only():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ctx = ToolContext(tools, None, True, "")
    inside = '<think>maybe <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call></think>No call.'
    body = _reply(ctx).body({"r": _outputs(inside)[-1]})
    msg = body["choices"][0]
    assert "tool_calls" not in msg["message"] and msg["message"]["content"] == "No call."
    after = '<think>I should call f.</think>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    body = _reply(ctx).body({"r": _outputs(after)[-1]})
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["reasoning_content"] == "I should call f."
    reply = _reply(ctx)
    chunks = [c for o in _outputs(after) for c in reply.chunks(o)]
    calls = [d for c in chunks for d in c["delta"].get("tool_calls", ())]
    assert [json.loads(d["function"]["arguments"]) for d in calls] == [{"a": 1}]
    assert "".join(c["delta"].get("reasoning_content", "") for c in chunks) == "I should call f."


# A template that opens <think> in the prompt (as DeepSeek-R1's does) unless enable_thinking is false (as Qwen3's).
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config(chat_template=TEMPLATE))
    s.server.config.app.state.reasoning_parser = "deepseek_r1"
    yield s
    s.stop()


def _chat(srv, **kw):
    body = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 12, "temperature": 0, **kw}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)


def test_server_reasoning_whole_and_streamed(srv):
    whole = _chat(srv).json()["choices"][0]["message"]
    assert whole["reasoning_content"] and whole["content"] == ""  # no </think> within 12 tokens: all reasoning
    thought = content = ""
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 12, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    thought += c["delta"].get("reasoning_content", "")
                    content += c["delta"].get("content") or ""
    assert (thought, content) == (whole["reasoning_content"], "")


def test_a_grammar_answers_without_reasoning(srv):
    msg = _chat(srv, response_format={"type": "json_object"}, max_tokens=20).json()["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"].lstrip().startswith("{")


def test_enable_thinking_reaches_the_template(srv):
    on = _chat(srv).json()["usage"]["prompt_tokens"]
    off = _chat(srv, chat_template_kwargs={"enable_thinking": False}).json()["usage"]["prompt_tokens"]
    assert off > on


def test_responses_reasoning_item(srv):
    body = {"input": "What is 2+2?", "max_output_tokens": 12, "temperature": 0}
    whole = httpx.post(srv.url + "/v1/responses", json=body, timeout=60).json()
    assert whole["output"][0]["type"] == "reasoning"
    text = whole["output"][0]["content"][0]["text"]
    assert text
    events = []
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == text
    done = next(e for e in events if e["type"] == "response.completed")
    assert done["response"]["output"][0]["type"] == "reasoning"
    assert done["response"]["output"][0]["content"][0]["text"] == text
