"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat endpoint's machinery.

A Messages request is translated into a chat completion request (system prompt, text, `tool_use` and
`tool_result` blocks become chat messages and tool calls), so the template, sampling checks and tool-call parser
are the chat endpoint's own; the reply is built back into Anthropic's content blocks and SSE events. Errors, the
body's validation included, come in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvinfer.errors import KvinferError
from kvinfer.server.app import _chat_input, _off_loop, _server, _validation_error
from kvinfer.server.metrics import LatencyTracker, ServerMetrics
from kvinfer.server.protocol import MAX_STOP, MAX_TOOLS, APIError, ChatCompletionRequest, _Body, from_engine_error
from kvinfer.server.replies import SSEResponse, collect, sse
from kvinfer.server.tool_calls import ToolContext

log = logging.getLogger("kvinfer.server")

_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

# Anthropic's error type for each status this server answers with.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_response(status: int, message: str) -> JSONResponse:
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status)


def _from_api_error(e: APIError) -> JSONResponse:
    return error_response(e.status, f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message)


# ---- request bodies -----------------------------------------------------------------------------------
class TextBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[None, str, list[TextBlock]] = None
    is_error: Optional[bool] = None


class ThinkingBlock(BaseModel):
    """A previous turn's thinking, sent back by clients; it is not part of the prompt."""
    model_config = _CONFIG
    type: Literal["thinking", "redacted_thinking"]


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class Message(BaseModel):
    model_config = _CONFIG
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content):
        # Checked before the union is tried, so the answer names the unsupported block instead of the branches.
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                raise PydanticCustomError("unsupported_content", "content blocks of type '{kind}' are not supported "
                                          "(text, tool_use, tool_result and thinking are; this model reads text "
                                          "only)", {"kind": kind})
        return content


class Tool(BaseModel):
    model_config = _CONFIG
    type: Optional[Literal["custom"]] = None
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(..., description="a JSON Schema of the tool's input object")


class ToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(None, description="the tool to call, with type tool")
    disable_parallel_tool_use: Optional[bool] = None


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens."""

    model_config = _CONFIG
    model: str = Field(..., description="any name is accepted (the served model answers)")
    messages: list[Message] = Field(..., min_length=1)
    system: Union[None, str, list[TextBlock]] = None
    tools: Optional[list[Tool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[ToolChoice] = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(..., ge=1)
    stop_sequences: Optional[list[str]] = Field(None, max_length=MAX_STOP)
    stream: Optional[bool] = False
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0, description="0 disables")
    metadata: Optional[dict[str, Any]] = None


# ---- Anthropic request -> chat request --------------------------------------------------------------------
def _text(content: Union[None, str, list[TextBlock]]) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """The conversation as OpenAI chat messages: tool_use blocks become an assistant's tool_calls, tool_result
    blocks the tool messages that answer them."""
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system)})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for b in m.content:
            if isinstance(b, TextBlock):
                texts.append(b.text)
            elif isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise APIError(400, "tool_use blocks belong in assistant messages", param="messages")
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            elif isinstance(b, ToolResultBlock):
                if m.role != "user":
                    raise APIError(400, "tool_result blocks belong in user messages", param="messages")
                result = _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {result}" if b.is_error else result})
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(body: CountTokensRequest) -> dict:
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type not in ("auto", "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return {}
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                "parameters": t.input_schema}} for t in body.tools]
    out: dict[str, Any] = {"tools": tools}
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice.name")
            if choice.name not in {t.name for t in body.tools}:
                raise APIError(400, f"tool_choice names {choice.name!r}, which is not in tools",
                               param="tool_choice.name")
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    d: dict[str, Any] = {"messages": chat_messages(body), **_tools(body)}
    if isinstance(body, MessagesRequest):
        d.update(max_tokens=body.max_tokens, stop=body.stop_sequences)
        if body.temperature is not None:
            d["temperature"] = body.temperature
        if body.top_p is not None:
            d["top_p"] = body.top_p
        if body.top_k:
            d["top_k"] = body.top_k
    try:
        return ChatCompletionRequest.model_validate(d)
    except PydanticValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg', 'invalid')}") from None


# ---- replies -----------------------------------------------------------------------------------------------
def _usage(out) -> dict:
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached, "output_tokens": sum(len(o.token_ids) for o in
                                                                                      out.outputs),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(o, made_calls: bool) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished output."""
    if made_calls:
        return "tool_use", None
    if o.finish_reason == "length":
        return "max_tokens", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def _tool_use(call) -> dict:
    try:
        args = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": args if isinstance(args, dict) else {}}


def message_body(msg_id: str, model: str, out, tools: Optional[ToolContext]) -> dict:
    o = out.outputs[0]
    text, calls = tools.calls(o.text) if tools is not None else (o.text, [])
    content = [{"type": "text", "text": text}] if text else []
    content += [_tool_use(c) for c in calls]
    reason, seq = _stop(o, bool(calls))
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(out)}


class _Blocks:
    """Streamed content blocks: text deltas and OpenAI-style tool-call deltas become block events."""

    def __init__(self):
        self.index = -1
        self.kind: Optional[str] = None

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        ev = self.close()
        self.index += 1
        self.kind = block["type"]
        return ev + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                              "content_block": block})]

    def close(self) -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def text(self, s: str) -> list[tuple[str, dict]]:
        if not s:
            return []
        ev = self._open({"type": "text", "text": ""}) if self.kind != "text" else []
        return ev + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                              "delta": {"type": "text_delta", "text": s}})]

    def calls(self, deltas: list[dict]) -> list[tuple[str, dict]]:
        ev = []
        for d in deltas:
            fn = d.get("function", {})
            if "id" in d:
                ev += self._open({"type": "tool_use", "id": d["id"], "name": fn.get("name", ""), "input": {}})
            args = fn.get("arguments") or ""
            if args:
                ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "input_json_delta", "partial_json": args}}))
        return ev


async def _events(msg_id: str, model: str, stream, tools: Optional[ToolContext],
                  metrics: ServerMetrics) -> AsyncIterator[str]:
    blocks, ts = _Blocks(), (tools.stream() if tools is not None else None)
    tracker = LatencyTracker(metrics)  # TTFT, inter-token latency, the request's count and its log line
    started = False
    try:
        async for out in stream:
            tracker.observe(out)
            if not started:
                started = True
                usage = {**_usage(out), "output_tokens": 0}
                yield sse({"type": "message_start", "message": {
                    "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": usage}}, "message_start")
                yield sse({"type": "ping"}, "ping")
            o = out.outputs[0]
            content, calls = (o.delta_text, []) if ts is None else ts.step(o.delta_text)
            events = blocks.text(content) + blocks.calls(calls)
            made_calls = False
            if o.finish_reason:
                if ts is not None:
                    rest, calls, made_calls = ts.end()
                    events += blocks.text(rest) + blocks.calls(calls)
                events += blocks.close()
                reason, seq = _stop(o, made_calls)
                events.append(("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": reason, "stop_sequence": seq},
                                                 "usage": {"output_tokens": len(o.token_ids)}}))
                events.append(("message_stop", {"type": "message_stop"}))
            for name, data in events:
                yield sse(data, name)
    except Exception as e:  # the engine failed mid-stream: an error event ends the stream
        log.warning("stream %s failed: %r", msg_id, e)
        err = from_engine_error(e) if isinstance(e, KvinferError) else APIError(500, "internal error")
        yield sse({"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"),
                                              "message": err.message}}, "error")
    finally:
        stream.abort()


# ---- routes --------------------------------------------------------------------------------------------
async def messages(body: MessagesRequest, request: Request):
    srv = _server(request)
    chat = chat_request(body)
    ids, params, _, tools = await _off_loop(_chat_input, srv, chat)
    stream = await srv.admit([ids], params, "msg")
    msg_id = stream.request_id  # msg_ and 24 hex digits, as Anthropic's; the server's log line names it too
    if body.stream:
        return SSEResponse(_events(msg_id, body.model, stream, tools, srv.metrics), stream)
    finals = await collect(stream, request, srv.metrics)
    if finals is None:
        return Response(status_code=499)
    return message_body(msg_id, body.model, finals[stream.request_id], tools)


async def count_tokens(body: CountTokensRequest, request: Request):
    ids, _, _, _ = await _off_loop(_chat_input, _server(request), chat_request(body))
    return {"input_tokens": len(ids)}


class _AnthropicRoute(APIRoute):
    """A route whose every error, the body's validation included, is answered in Anthropic's shape."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as e:
                resp = await _validation_error(request, e)
                return error_response(400, json.loads(resp.body)["error"]["message"])
            except APIError as e:
                return _from_api_error(e)
            except KvinferError as e:
                return _from_api_error(from_engine_error(e))
            except StarletteHTTPException as e:  # the body could not be read (too large, cut off)
                err = getattr(e, "err", None)
                return _from_api_error(err) if isinstance(err, APIError) else error_response(e.status_code,
                                                                                             str(e.detail))

        return route


class _KeyMiddleware:
    """Accepts the API key as Anthropic's clients send it (`x-api-key`) as well as a Bearer token, and answers a
    missing or wrong key, or a too large body, on /v1/messages in Anthropic's shape."""

    def __init__(self, app, api_key: Optional[str], max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.api_key is None and not scope.get("path", "").startswith("/v1/messages"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if scope.get("path", "").startswith("/v1/messages"):
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_body_bytes:
                resp = error_response(413, f"the request body is larger than the limit of {self.max_body_bytes} "
                                           "bytes")
                return await resp(scope, receive, send)
            if self.api_key is not None:
                auth = headers.get(b"authorization", b"").decode("latin-1")
                scheme, _, token = auth.partition(" ")
                key = headers.get(b"x-api-key", b"").decode("latin-1") or (token if scheme.lower() == "bearer"
                                                                           else "")
                if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                    msg = "invalid API key" if key else "missing API key: send 'x-api-key: <key>'"
                    return await error_response(401, msg)(scope, receive, send)
        if self.api_key is not None and b"x-api-key" in headers and b"authorization" not in headers:
            key = headers[b"x-api-key"]
            scope = {**scope, "headers": list(scope["headers"]) + [(b"authorization", b"Bearer " + key)]}
        await self.app(scope, receive, send)


def add_anthropic_api(app: FastAPI, api_key: Optional[str], max_body_bytes: int) -> None:
    """Register the Messages routes, and the key middleware (outside the app's own guard: call it last)."""
    for path, route in (("/v1/messages", messages), ("/v1/messages/count_tokens", count_tokens)):
        app.router.add_api_route(path, route, methods=["POST"], route_class_override=_AnthropicRoute,
                                 responses={code: {"description": "an Anthropic error object"}
                                            for code in (400, 401, 404, 413, 429, 503)})
    app.add_middleware(_KeyMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
