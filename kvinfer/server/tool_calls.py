"""Tool calling for the chat API: grammars for forced calls, and the model's text parsed back into OpenAI
`tool_calls` (Hermes/Qwen `<tool_call>` JSON, Llama 3 JSON), whole or streamed. Tools reach the prompt through
kvinfer.loaders.chat_tools."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from kvinfer.errors import ValidationError
from kvinfer.loaders.chat_tools import HERMES_CLOSE as _HERMES_CLOSE
from kvinfer.loaders.chat_tools import HERMES_OPEN as _HERMES_OPEN
from kvinfer.loaders.chat_tools import as_object as _as_object
from kvinfer.sampling_params import StructuredOutput

HERMES = "hermes"
LLAMA3 = "llama3"

_PYTHON_TAG = "<|python_tag|>"


def parser_for_template(template: str) -> str:
    """The tool-call format a chat template teaches its model (Hermes unless it is Llama 3's)."""
    if _PYTHON_TAG in template or "ipython" in template:
        return LLAMA3
    return HERMES


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---- forced calls ----------------------------------------------------------------------------------------
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties and says nothing
    about others (what OpenAI's strict mode requires): a small model otherwise invents keys until max_tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed_objects(sub) for name, sub in out[k].items()}
    for k in _SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = closed_objects(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(sub) for sub in out[k]]
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return closed_objects(params) if params else {"type": "object", "properties": {}, "additionalProperties": False}


def _rebased(schema: Any, base: str, where: str) -> Any:
    """The schema with each local `$ref` ('#', '#/$defs/X', ...) pointing below `base`, where it is placed inside
    a larger schema: a ref resolves against the schema it appears in, not against the wrapper around it."""
    if isinstance(schema, list):
        return [_rebased(x, base, where) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, base, where) for k, v in schema.items()}
    ref = schema.get("$ref")
    if ref is not None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValidationError(where, ref, "$ref must point inside the schema ('#' or '#/...'); references to "
                                              "other documents are not supported")
        out["$ref"] = "#" + base + ref[1:]
    return out


def forced_call_spec(tools: list[dict], choice: Any, parallel: bool) -> tuple[StructuredOutput, Optional[str]]:
    """The grammar of a forced call, and the function name when it is a named one.

    A named function: the output is its arguments object. `required`: a JSON array of {"name", "arguments"}
    calls to listed functions (one item when parallel_tool_calls is false), the way vLLM forces calls.
    """
    if isinstance(choice, str):
        # Each function's parameters sit under $defs, so that their refs ('#' included) resolve within them.
        defs = {f"tool{i}": _rebased(_parameters(t), f"/$defs/tool{i}", f"tools[{i}].function.parameters")
                for i, t in enumerate(tools)}
        items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": {"$ref": f"#/$defs/tool{i}"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items},
                  "$defs": defs}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutput(json=schema, param="tools"), None
    name = choice["function"]["name"]
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise ValidationError("tool_choice", name, "names no function listed in tools")
    where = f"tools[{tools.index(tool)}].function.parameters"
    return StructuredOutput(json=_rebased(_parameters(tool), "", where), param=where), name


def parse_forced(text: str, name: Optional[str]) -> list[ToolCall]:
    """Calls out of a forced (grammar-constrained) output; empty if it was cut short before the JSON closed.
    Arguments are the text as generated, so a streamed call's deltas join to the same string."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if name is not None:
        return [ToolCall(name, text)] if isinstance(value, dict) else []
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        return []
    raw = partial_calls(text)  # the same objects in the same order, with each one's arguments text
    args = ([a for _, a in raw] if len(raw) == len(value) else
            [json.dumps(c.get("arguments"), ensure_ascii=False) for c in value])
    return [ToolCall(c["name"], a) for c, a in zip(value, args)
            if isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)]


# ---- free-form (auto) output ------------------------------------------------------------------------------
_HERMES_RE = re.compile(re.escape(_HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(_HERMES_CLOSE) + r"|$)", re.S)


def _call_from_json(obj: Any, names: set[str]) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _as_object(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, fmt: str, names: set[str]) -> tuple[Optional[str], list[ToolCall]]:
    """(content, calls) from a model's free output. Text that does not parse as a call to a listed function
    stays content, so a model that only talks is passed through unchanged."""
    if fmt == HERMES:
        if _HERMES_OPEN not in text:
            return text, []
        calls = []
        for m in _HERMES_RE.finditer(text):
            try:
                call = _call_from_json(json.loads(m.group(1)), names)
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:text.index(_HERMES_OPEN)].strip()
        return (content or None), calls
    # Llama 3: optionally <|python_tag|>, then one JSON object, or several separated by ';'.
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_from_json(obj, names)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """Index just past the JSON string opening at text[i], or -1 if the text ends inside it."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return -1


def _value_end(text: str, i: int) -> int:
    """Index just past the JSON value starting at text[i] (any kind), or -1 if the text ends inside it."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "[{":
        j = i
        while j < len(text) and text[j] not in ",}] \t\r\n":
            j += 1
        return j if j < len(text) else -1
    depth = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _string_end(text, i)
            if i == -1:
                return -1
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def partial_calls(text: str) -> list[tuple[Optional[str], str]]:
    """(name or None while unknown, arguments text so far) of each call in a possibly unfinished forced output:
    a JSON array of {"name": ..., "arguments": {...}} objects, as the `required` grammar writes it."""
    calls: list[tuple[Optional[str], str]] = []
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return calls
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        if i >= len(text) or text[i] != "{":
            return calls
        i += 1
        name, args = None, ""
        calls.append((name, args))
        while True:
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)
            if i >= len(text):
                return calls
            if text[i] == "}":
                i += 1
                break
            key_end = _string_end(text, i) if text[i] == '"' else -1
            if key_end == -1:
                return calls
            key = json.loads(text[i:key_end])
            i = _skip_ws(text, key_end)
            if i >= len(text) or text[i] != ":":
                return calls
            i = _skip_ws(text, i + 1)
            if i >= len(text):
                return calls
            end = _value_end(text, i)
            if key == "arguments":
                args = text[i:] if end == -1 else text[i:end]
            elif key == "name" and end != -1:
                name = json.loads(text[i:end])
            calls[-1] = (name, args)
            if end == -1:
                return calls
            i = end


class ToolStream:
    """Splits a streamed output into content deltas and tool-call deltas for one choice.

    Forced calls (a named function, or `required`) stream their arguments as they are generated, the way OpenAI
    does: the grammar guarantees their shape. Free (`auto`) output is sent as content as it comes, except text
    that may be the start of a call, which is held back; once a call starts, the rest of the output is held and
    parsed when the choice finishes (those calls are sent whole, since the model may not finish them validly).
    """

    def __init__(self, fmt: str, names: set[str], forced_name: Optional[str] = None, forced: bool = False):
        self.fmt, self.names, self.forced_name, self.forced = fmt, names, forced_name, forced
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = forced  # a forced call is never content
        self.call_ids: list[str] = []  # ids of the calls whose opening delta was sent
        self.args_sent: list[int] = []  # characters of each call's arguments sent

    def argument_deltas(self, delta: str) -> list[dict]:
        """tool_calls deltas of a forced output: each call's opening one (id, type, name), then its arguments."""
        self.text += delta
        if self.forced_name is not None:  # the output is the one call's arguments object
            calls = [(self.forced_name, self.text)]
        else:
            calls = partial_calls(self.text)
        out = []
        for i, (name, args) in enumerate(calls):
            if name is None or (i == len(self.call_ids) and not args):
                break  # the name, then the first character of arguments, before the opening delta
            if i == len(self.call_ids):
                self.call_ids.append(ToolCall(name, "").id)
                self.args_sent.append(len(args))
                out.append({"index": i, "id": self.call_ids[i], "type": "function",
                            "function": {"name": name, "arguments": args}})
            elif len(args) > self.args_sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.args_sent[i]:]}})
                self.args_sent[i] = len(args)
        return out

    def feed(self, delta: str) -> str:
        """Content to send now."""
        self.text += delta
        if self.holding:
            return ""
        if self.fmt == HERMES:
            i = self.text.find(_HERMES_OPEN, self.sent)
            if i != -1:
                self.holding = True
                out, self.sent = self.text[self.sent:i], i
                return out
            safe = len(self.text)
            # Hold a tail that could still grow into the opening tag.
            for k in range(min(len(_HERMES_OPEN) - 1, len(self.text)), 0, -1):
                if _HERMES_OPEN.startswith(self.text[-k:]):
                    safe = len(self.text) - k
                    break
        else:
            safe = len(self.text)
            if self.sent == 0:
                # Llama 3 calls are the whole output: decide from its first characters.
                head = self.text.lstrip()
                if head.startswith("{") or head.startswith(_PYTHON_TAG):
                    self.holding = True
                    return ""
                if not head or _PYTHON_TAG.startswith(head):
                    return ""
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def step(self, delta: str) -> tuple[str, list[dict]]:
        """(content, tool_calls deltas) to send for the next piece of output."""
        if self.forced:
            return "", self.argument_deltas(delta)
        return self.feed(delta), []

    def end(self) -> tuple[str, list[dict], bool]:
        """(content, tool_calls deltas) still to send when the choice finishes, and whether it made calls."""
        rest, calls = self.finish()
        if self.forced:
            return "", [], bool(calls)
        return rest, tool_call_deltas(calls), bool(calls)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, calls) once the choice is done."""
        if self.forced:
            return "", parse_forced(self.text, self.forced_name)
        content, calls = parse_tool_calls(self.text, self.fmt, self.names)
        if calls:
            end = self.text.find(_HERMES_OPEN) if self.fmt == HERMES else self.sent
            return self.text[self.sent:max(end, self.sent)].rstrip(), calls
        return self.text[self.sent:], []


# ---- per request -------------------------------------------------------------------------------------------
class ToolContext:
    """What a chat request asked of tools, and how its outputs turn into OpenAI messages and deltas."""

    def __init__(self, tools: list[dict], choice: Any, parallel: bool, template: str):
        self.tools = tools
        self.names = {t["function"]["name"] for t in tools}
        self.fmt = parser_for_template(template)
        self.mode = "auto" if choice is None else (choice if isinstance(choice, str) else "named")
        self.spec: Optional[StructuredOutput] = None
        self.forced_name: Optional[str] = None
        if self.mode in ("required", "named"):
            self.spec, self.forced_name = forced_call_spec(tools, choice, parallel)
        self.parallel = parallel

    @property
    def forced(self) -> bool:
        return self.spec is not None

    def calls(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        if self.mode == "none":
            return text, []
        if self.forced:
            calls = parse_forced(text, self.forced_name)
            return (None, calls) if calls else (text, [])
        content, calls = parse_tool_calls(text, self.fmt, self.names)
        if calls and not self.parallel:
            calls = calls[:1]
        return content, calls

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The assistant message of a finished choice, and its finish_reason."""
        content, calls = self.calls(text)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}, "tool_calls"

    def stream(self) -> Optional[ToolStream]:
        if self.mode == "none":
            return None
        return ToolStream(self.fmt, self.names, self.forced_name, self.forced)


def tool_call_deltas(calls: list[ToolCall]) -> list[dict]:
    """Whole calls in OpenAI's streamed form (`index` says which call a delta extends)."""
    return [{"index": i, **c.to_openai()} for i, c in enumerate(calls)]


def response_format_spec(fmt: Any) -> Optional[StructuredOutput]:
    """The grammar spec of an OpenAI response_format (pydantic ResponseFormat); None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(json=True, param="response_format")
    if fmt.json_schema is None:
        raise ValidationError("response_format", "json_schema", "type json_schema needs a json_schema object")
    schema = fmt.json_schema.schema_
    return StructuredOutput(json=closed_objects(schema) if schema else True, param="response_format.json_schema")
