"""OpenAI's Responses API (/v1/responses, and the stored responses' GET, DELETE and input_items) over chat."""
from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Literal, Optional, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from kvinfer.errors import KvinferError
from kvinfer.server.metrics import LatencyTracker, ServerMetrics
from kvinfer.server.protocol import (_CONFIG, APIError, ChatCompletionRequest, FunctionDefinition, MAX_TOOLS, _Body,
                                     from_engine_error)
from kvinfer.server.response_store import ResponseStore, StoredResponse  # noqa: F401 (re-exported)
from kvinfer.server.replies import ChatReply, sse, usage
from kvinfer.server.reasoning import reasoning_item
from kvinfer.sampling_params import MAX_LOGPROBS

log = logging.getLogger("kvinfer.server")

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16
# Stored responses (for previous_response_id and GET): the newest ones, up to this many and this much text.


# ---- request bodies ------------------------------------------------------------------------------------
class InputText(BaseModel):
    """A text part of an input message (`output_text`: an earlier answer sent back as input)."""

    model_config = _CONFIG
    type: Literal["input_text", "output_text"]
    text: str


_UNSUPPORTED_PARTS = {"input_image": "images are not supported (this model reads text only)",
                      "input_file": "files are not supported (send their text as input_text)",
                      "input_audio": "audio is not supported (this model reads text only)"}


class MessageItem(BaseModel):
    model_config = _CONFIG
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputText]]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _UNSUPPORTED_PARTS:
                raise PydanticCustomError("unsupported_content", _UNSUPPORTED_PARTS[kind])
            if isinstance(kind, str) and kind not in ("input_text", "output_text"):
                raise PydanticCustomError("unsupported_content", "content parts of type '{kind}' are not supported "
                                          "(only input_text and output_text)", {"kind": kind})
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier, sent back with its output."""

    model_config = _CONFIG
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str
    arguments: str
    id: Optional[str] = None


class FunctionCallOutputItem(BaseModel):
    model_config = _CONFIG
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: Union[str, list[InputText]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]
_ITEM_MODELS = {"message": MessageItem, "function_call": FunctionCallItem,
                "function_call_output": FunctionCallOutputItem}


class FunctionTool(FunctionDefinition):
    """A function tool, flat (chat completions nest the same fields under `function`)."""

    type: Literal["function"]


class NamedFunctionChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(**_CONFIG, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="the JSON Schema of the output")
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = _CONFIG
    format: Optional[TextFormat] = None


_UNSUPPORTED_FIELDS = {"background": "background responses are not supported (must be false)",
                       "reasoning": "this model does not reason (leave reasoning out)"}


class ResponsesRequest(_Body):
    """POST /v1/responses (text in, text or function calls out; vLLM-style sampling extras)."""

    model: Optional[str] = Field(None, description="must be the served model name (see GET /v1/models)")
    input: Union[str, list[InputItem]] = Field(..., description="text, or a list of messages, function calls and "
                                               "their outputs")
    instructions: Optional[str] = Field(None, description="a system message put first (not carried over by "
                                        "previous_response_id)")
    previous_response_id: Optional[str] = Field(None, description="continue a stored response's conversation")
    store: Optional[bool] = Field(True, description="keep the response for previous_response_id and GET (in "
                                  "memory, the newest within the server's --responses-store-size)")
    max_output_tokens: Optional[int] = Field(None, ge=1, description="default: the rest of the context window")
    temperature: Optional[float] = Field(1.0, ge=0.0, le=100.0, description="0 is greedy")
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        f"alternatives per token; logprobs come with include: ['{LOGPROBS_INCLUDE}']"))
    include: Optional[list[str]] = None
    stream: Optional[bool] = False
    tools: Optional[list[FunctionTool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[None, Literal["none", "auto", "required"], NamedFunctionChoice] = None
    parallel_tool_calls: Optional[bool] = True
    text: Optional[TextConfig] = Field(None, description="format: text, json_object or json_schema")
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[str] = Field("disabled", description="disabled (auto is not supported)")
    background: Optional[bool] = Field(False, description="must be false")
    reasoning: Optional[dict[str, Any]] = Field(None, description="must be null: this model does not reason")
    # vLLM-style extras
    top_k: Optional[int] = Field(None, ge=-1, description="0 or -1 disables")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=10.0)
    seed: Optional[int] = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, items):
        # Each item checked here by its own type, so an error names the item and the field instead of listing
        # the union's branches.
        if not isinstance(items, list):
            return items
        if not items:
            raise PydanticCustomError("empty", "the list of items is empty")
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise PydanticCustomError("invalid_item", "item {i} must be an object", {"i": i})
            kind = item.get("type", "message")
            model = _ITEM_MODELS.get(kind) if isinstance(kind, str) else None
            if model is None:
                raise PydanticCustomError("unsupported_item", "item {i} has type '{kind}', which is not supported "
                                          "(message, function_call, function_call_output)",
                                          {"i": i, "kind": str(kind)})
            try:
                out.append(model.model_validate({**item, "type": kind}))
            except pydantic.ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first.get("loc", ()))
                raise PydanticCustomError("invalid_item", "item {i} ({where}): {msg}",
                                          {"i": i, "where": where, "msg": first.get("msg", "invalid")}) from None
        return out

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools):
        for t in tools if isinstance(tools, list) else ():
            kind = t.get("type") if isinstance(t, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise PydanticCustomError("unsupported_tool", "tools of type '{kind}' are not supported (only "
                                          "function tools)", {"kind": kind})
        return tools

    @field_validator("include")
    @classmethod
    def _supported_include(cls, v):
        for i, item in enumerate(v or ()):
            if item != LOGPROBS_INCLUDE:
                raise PydanticCustomError("unsupported", "'{item}' (item {i}) is not something this "
                                          "server can include (only '{ok}')", {"i": i, "item": item, "ok": LOGPROBS_INCLUDE})
        return v

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, v):
        if v not in (None, "disabled"):
            raise PydanticCustomError("unsupported", "only 'disabled' is supported: the input must fit the context "
                                      "window (got '{v}')", {"v": str(v)})
        return v

    @field_validator("background", "reasoning")
    @classmethod
    def _unsupported(cls, v, info: ValidationInfo):
        if v:
            raise PydanticCustomError("unsupported", _UNSUPPORTED_FIELDS[info.field_name])
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None and len(v) > MAX_METADATA:
            raise PydanticCustomError("too_long", "at most {n} keys", {"n": MAX_METADATA})
        return v

    @property
    def want_logprobs(self) -> bool:
        return bool(self.include) and LOGPROBS_INCLUDE in self.include


# ---- the conversation as chat messages -----------------------------------------------------------------
def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's input as chat messages: function calls join the assistant message before them."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as the items GET /v1/responses/{id}/input_items lists (each with an id)."""
    raw = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    out = []
    for item in raw:
        if isinstance(item, MessageItem):
            kind = "output_text" if item.role == "assistant" else "input_text"
            part = {"type": kind, "text": item.text(), **({"annotations": []} if kind == "output_text" else {})}
            out.append({"type": "message", "id": f"msg_{_hex()}", "role": item.role, "status": "completed",
                        "content": [part]})
        elif isinstance(item, FunctionCallItem):
            out.append({"type": "function_call", "id": item.id or f"fc_{_hex()}", "call_id": item.call_id,
                        "name": item.name, "arguments": item.arguments, "status": "completed"})
        else:
            out.append({"type": "function_call_output", "id": f"fco_{_hex()}", "call_id": item.call_id,
                        "output": item.text(), "status": "completed"})
    return out


def item_page(items: list[dict], after: Optional[str], before: Optional[str], limit: int, order: str) -> dict:
    """One page of a response's input items, OpenAI's cursor list: `after` / `before` are item ids."""
    ordered = items if order == "asc" else items[::-1]
    ids = [i["id"] for i in ordered]
    start, end = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise APIError(400, f"{name}: no item {cursor!r} in this response's input", param=name)
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    page = ordered[start:min(end, start + limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < end}


def chat_request(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat completion request that computes this response (its prompt, sampling, tools and format)."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    messages += input_messages(body)
    data: dict[str, Any] = {"messages": messages, "max_completion_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                            "top_k": body.top_k, "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
                            "parallel_tool_calls": body.parallel_tool_calls}
    if body.want_logprobs:
        data.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    if body.tools:
        data["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        data["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and (fmt.name is None or fmt.schema_ is None):
            raise APIError(400, "text.format of type json_schema needs a name and a schema", param="text.format")
        data["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else
                                   {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                                           "strict": fmt.strict}})
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise APIError(400, f"input: {where}: {first.get('msg', 'invalid')}", param="input") from None


# The chat route's parameter names for what a Responses request calls otherwise.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "prompt": "input",
           "messages": "input", "response_format": "text.format"}


def responses_error(e: Exception) -> APIError:
    """An error of the chat machinery, naming the Responses request's own parameter."""
    err = from_engine_error(e) if isinstance(e, KvinferError) else e
    param = err.param
    if param is not None:
        head = param.split("[", 1)[0].split(".", 1)[0]
        if head in _PARAMS:
            param = _PARAMS[head] + param[len(head):] if head != "messages" else "input"
    message = re.sub(r"\b(max_tokens|max_completion_tokens)\b", "max_output_tokens", err.message)
    message = message.replace("response_format.json_schema", "text.format.schema")
    if param == "text.format.json_schema":
        param = "text.format.schema"
    return APIError(err.status, message.replace("response_format", "text.format"), err.type, param, err.code)


# ---- responses from chat outputs -----------------------------------------------------------------------
def _hex() -> str:
    return uuid.uuid4().hex


class ResponseBuilder:
    """One response: its id, the settings it echoes, and output items from a chat reply's message or deltas."""

    def __init__(self, body: ResponsesRequest, model: str, history: list[dict], rid: Optional[str] = None):
        self.id = rid or f"resp_{_hex()}"  # rid: the engine request's id (ServerState.admit)
        self.created = int(time.time())
        self.body, self.model, self.history = body, model, history

    def response(self, status: str, output: list[dict], usage_: Optional[dict] = None) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else \
            {"type": "text"}
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "background": False, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
               "model": self.model, "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
               "previous_response_id": b.previous_response_id, "reasoning": None, "store": b.store is not False,
               "temperature": b.temperature, "text": {"format": fmt},
               "tool_choice": (b.tool_choice if isinstance(b.tool_choice, str) or b.tool_choice is None
                               else b.tool_choice.model_dump()) or "auto",
               "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
               "top_logprobs": b.top_logprobs, "top_p": b.top_p, "truncation": "disabled", "user": b.user,
               "usage": usage_}
        return out

    @staticmethod
    def usage(chat_usage: dict) -> dict:
        return {"input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat_usage["total_tokens"]}

    @staticmethod
    def message_item(item_id: str, text: str, logprobs: Optional[list], status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}

    @staticmethod
    def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}

    def keep(self, store: Optional[ResponseStore], response: dict) -> None:
        """Store the finished response (unless the request said store: false)."""
        if store is not None:
            store.put(response, self.conversation(response["output"]), input_items(self.body))

    def conversation(self, output: list[dict]) -> list[dict]:
        """The stored conversation: earlier turns, this input (instructions are not carried over), the answer."""
        answer: dict[str, Any] = {"role": "assistant", "content": None}
        for item in output:
            if item["type"] == "message":
                answer["content"] = item["content"][0]["text"]
            elif item["type"] == "function_call":  # reasoning is not carried into the next turn
                answer.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        if answer["content"] is None and "tool_calls" not in answer:
            answer["content"] = ""
        return self.history + input_messages(self.body) + [answer]

    def from_chat(self, chat: dict) -> dict:
        """The whole response from a chat completion body."""
        choice = chat["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        status = "incomplete" if finish == "length" else "completed"
        output = []
        lps = choice["logprobs"]["content"] if choice.get("logprobs") else None
        if message.get("reasoning_content") is not None:
            output.append(reasoning_item(f"rs_{_hex()}", message["reasoning_content"], "completed"))
        if message.get("content") or not message.get("tool_calls"):
            output.append(self.message_item(f"msg_{_hex()}", message.get("content") or "",
                                            _response_logprobs(lps) if self.body.want_logprobs else None, status))
        for call in message.get("tool_calls") or ():
            output.append(self.call_item(f"fc_{_hex()}", call["id"], call["function"]["name"],
                                         call["function"]["arguments"], "completed"))
        return self.response(status, output, self.usage(chat["usage"]))


def _response_logprobs(chat_content: Optional[list]) -> list:
    return [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"] or [],
             "top_logprobs": [{"token": a["token"], "logprob": a["logprob"], "bytes": a["bytes"] or []}
                              for a in t["top_logprobs"]]}
            for t in chat_content or ()]


# ---- streaming -----------------------------------------------------------------------------------------
class _EventStream:
    """Response events from a chat reply's streamed choices: a message item opened on the first text, each
    function call its own item, everything closed in order when the choice finishes."""

    def __init__(self, builder: ResponseBuilder):
        self.b = builder
        self.seq = 0
        self.output: list[dict] = []  # finished items, in output order
        self.msg: Optional[dict] = None  # the open message item: id, index, text, logprobs
        self.calls: dict[int, dict] = {}  # chat call index -> open call item: id, index, call_id, name, args
        self.pending_lps: list = []
        self.status = "completed"
        self.thought: Optional[dict] = None  # the open reasoning item: id, index, text

    def event(self, kind: str, **fields) -> str:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(e, kind)

    def _next_index(self) -> int:
        return len(self.output) + (self.msg is not None) + len(self.calls) + (self.thought is not None)

    def _reasoning(self, text: str) -> list[str]:
        """A reasoning delta (opening the reasoning item), or with "" the item closed if it is open."""
        t = self.thought
        if not text:
            if t is None:
                return []
            self.thought = None
            item = reasoning_item(t["id"], t["text"], "completed")
            self.output.append(item)
            return [self.event("response.reasoning_text.done", item_id=t["id"], output_index=t["index"],
                               content_index=0, text=t["text"]),
                    self.event("response.output_item.done", output_index=t["index"], item=item)]
        events = []
        if t is None:
            t = self.thought = {"id": f"rs_{_hex()}", "index": self._next_index(), "text": ""}
            events.append(self.event("response.output_item.added", output_index=t["index"],
                                     item=reasoning_item(t["id"], "", "in_progress") | {"content": []}))
        t["text"] += text
        return events + [self.event("response.reasoning_text.delta", item_id=t["id"], output_index=t["index"],
                                    content_index=0, delta=text)]

    def _open_message(self) -> list[str]:
        self.msg = {"id": f"msg_{_hex()}", "index": self._next_index(), "text": "", "lps": []}
        return [self.event("response.output_item.added", output_index=self.msg["index"],
                           item=self.b.message_item(self.msg["id"], "", None, "in_progress") | {"content": []}),
                self.event("response.content_part.added", item_id=self.msg["id"], output_index=self.msg["index"],
                           content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _close_message(self) -> list[str]:
        m, self.msg = self.msg, None
        lps = m["lps"] + self.pending_lps if self.b.body.want_logprobs else None
        self.pending_lps = []
        item = self.b.message_item(m["id"], m["text"], lps, self.status)
        part = item["content"][0]
        self.output.append(item)
        common = dict(item_id=m["id"], output_index=m["index"], content_index=0)
        return [self.event("response.output_text.done", **common, text=m["text"], logprobs=lps or []),
                self.event("response.content_part.done", **common, part=part),
                self.event("response.output_item.done", output_index=m["index"], item=item)]

    def choice(self, c: dict) -> list[str]:
        """Events for one streamed chat choice (its delta, logprobs and finish_reason)."""
        events: list[str] = []
        delta = c.get("delta") or {}
        if c.get("logprobs"):
            self.pending_lps += _response_logprobs(c["logprobs"]["content"])
        events += self._reasoning(delta.get("reasoning_content") or "")
        text = delta.get("content")
        if text or delta.get("tool_calls") or c.get("finish_reason"):
            events += self._reasoning("")
        if text:
            if self.msg is None:
                events += self._open_message()
            self.msg["text"] += text
            lps, self.pending_lps = self.pending_lps, []
            self.msg["lps"] += lps
            events.append(self.event("response.output_text.delta", item_id=self.msg["id"],
                                     output_index=self.msg["index"], content_index=0, delta=text,
                                     logprobs=lps if self.b.body.want_logprobs else []))
        for d in delta.get("tool_calls") or ():
            call = self.calls.get(d["index"])
            if call is None:
                if self.msg is not None:
                    events += self._close_message()
                call = {"id": f"fc_{_hex()}", "index": self._next_index(), "call_id": d["id"],
                        "name": d["function"]["name"], "args": ""}
                self.calls[d["index"]] = call
                events.append(self.event("response.output_item.added", output_index=call["index"],
                                         item=self.b.call_item(call["id"], call["call_id"], call["name"], "",
                                                               "in_progress")))
            args = d["function"].get("arguments") or ""
            if args:
                call["args"] += args
                events.append(self.event("response.function_call_arguments.delta", item_id=call["id"],
                                         output_index=call["index"], delta=args))
        if c.get("finish_reason"):
            self.status = "incomplete" if c["finish_reason"] == "length" else "completed"
            if self.msg is None and not self.calls and not any(i["type"] == "message" for i in self.output):
                events += self._open_message()  # an empty answer is still a message
            if self.msg is not None:
                events += self._close_message()
            for call in sorted(self.calls.values(), key=lambda x: x["index"]):
                item = self.b.call_item(call["id"], call["call_id"], call["name"], call["args"], "completed")
                self.output.append(item)
                events.append(self.event("response.function_call_arguments.done", item_id=call["id"],
                                         output_index=call["index"], name=call["name"], arguments=call["args"]))
                events.append(self.event("response.output_item.done", output_index=call["index"], item=item))
            self.calls = {}
        return events


async def response_events(builder: ResponseBuilder, reply: ChatReply, metrics: ServerMetrics,
                          store: Optional[ResponseStore]) -> AsyncIterator[str]:
    """The streamed response: created, in_progress, the items' events, then completed or incomplete (or error)."""
    es = _EventStream(builder)
    tracker = LatencyTracker(metrics)
    stream = reply.stream
    try:
        start = builder.response("in_progress", [])
        yield es.event("response.created", response=start)
        yield es.event("response.in_progress", response=start)
        final = None
        async for out in stream:
            tracker.observe(out)
            for c in reply.chunks(out):
                for e in es.choice(c):
                    yield e
            if out.finished:
                final = out
        body = builder.response(es.status, es.output, builder.usage(usage([final])))
        builder.keep(store, body)
        yield es.event("response.completed" if es.status == "completed" else "response.incomplete", response=body)
    except Exception as e:  # the engine died mid-stream: an error event, then the stream ends
        log.warning("stream %s failed: %r", builder.id, e)
        err = from_engine_error(e) if isinstance(e, KvinferError) else APIError(500, "internal error", "server_error")
        yield es.event("error", code=err.code, message=err.message, param=err.param)
    finally:
        stream.abort()
