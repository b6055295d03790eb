"""Tools in a chat prompt: the model's own template given them the Hugging Face way when it has a place for
them, or a Hermes-style system prompt and tool-call text when it does not (the server's chat endpoint and
LLM.chat render them alike)."""
from __future__ import annotations

import json
from typing import Any, Optional

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"

# Written into the system prompt when the model's own template has no place for tools; the format is Hermes',
# which the parser of such models then reads back.
HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "The functions are given in JSON within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


def template_knows_tools(template: str) -> bool:
    return "tools" in template


def _field(obj: Any, name: str) -> Any:
    """A field of a message or tool call given as a dict or as an object (the server's request models)."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def template_messages(messages: list[dict], raw_messages: list, tools: Optional[list[dict]],
                      template: str) -> tuple[list[dict], dict]:
    """Messages and extra template variables with tool definitions, assistant tool calls and tool results.

    `messages` are the plain {role, content} dicts; `raw_messages` the messages as given (with tool_calls and
    tool_call_id): the server's request models or OpenAI-style dicts. A template that mentions tools gets them the
    Hugging Face way (the `tools` variable, `tool_calls` with arguments as objects); any other template gets them
    written into the text as Hermes does.
    """
    native = template_knows_tools(template)
    out = []
    for m, raw in zip(messages, raw_messages):
        m = dict(m)
        calls = _field(raw, "tool_calls")
        if calls:
            parsed = [{"id": _field(c, "id"), "type": "function",
                       "function": {"name": _field(_field(c, "function"), "name"),
                                    "arguments": as_object(_field(_field(c, "function"), "arguments"))}}
                      for c in calls]
            if native:
                m["tool_calls"] = parsed
            else:
                text = "\n".join(HERMES_OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                                 "arguments": c["function"]["arguments"]})
                                 + "\n" + HERMES_CLOSE for c in parsed)
                m["content"] = (m["content"] + "\n" if m["content"] else "") + text
        if _field(raw, "role") == "tool":
            if _field(raw, "tool_call_id") is not None:
                m["tool_call_id"] = _field(raw, "tool_call_id")
            if not native:
                m["content"] = "<tool_response>\n" + m["content"] + "\n</tool_response>"
        out.append(m)
    if not tools:
        return out, {}
    if native:
        return out, {"tools": tools}
    system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def as_object(arguments: str) -> Any:
    # Templates write arguments with tojson; a string that holds JSON is passed as the object it holds.
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments
