"""The OpenAI-compatible FastAPI app: a server state, its routes as plain functions, errors, a serving thread."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvinfer.engine.async_engine import AsyncLLMEngine, RequestStream
from kvinfer.engine.generation_defaults import generation_defaults
from kvinfer.errors import KvinferError
from kvinfer.loaders.chat_tools import template_messages
from kvinfer.sampling_params import SamplingParams
from kvinfer.server.activity import server_logger
from kvinfer.server.hosts import HostCheckMiddleware
from kvinfer.server.limits import BodyTooLarge, GuardMiddleware, body_parse_error
from kvinfer.server.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT, DrainMiddleware, Lifecycle
from kvinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from kvinfer.server.openai_responses import (ResponseBuilder, ResponsesRequest, ResponseStore,
                                             StoredResponse, chat_request, item_page, response_events,
                                             responses_error)
from kvinfer.server.page import add_page_routes, note_page_request
from kvinfer.server.reasoning import reasoning_parser
from kvinfer.server.protocol import (MAX_STOP, APIError, ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, ErrorResponse, TokenizeRequest, error_body,
                                     from_engine_error, messages_for_template)
from kvinfer.server.replies import ChatReply, CompletionReply, SSEResponse, TokenText, collect, respond
from kvinfer.server.tier_metrics import register_tier_metrics
from kvinfer.server.tool_calls import ToolContext, response_format_spec

log = logging.getLogger("kvinfer.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
SAMPLING_EPS = 1e-5  # temperature or top_p below this samples greedily

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


def default_model_name(config) -> str:
    if config.model is None:
        return BUILTIN_MODEL_NAME
    p = Path(config.model)
    return p.stem if p.suffix == ".gguf" else (p.name or str(config.model))


# ---- the server state --------------------------------------------------------------------------------
class ServerState:
    """What the routes share: engine, model name, tokenizer, metrics, token text cache (`app.state.server`)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, lifecycle: Optional[Lifecycle] = None,
                 responses_store_bytes: Optional[int] = None):
        self.engine = engine
        self.lifecycle = lifecycle or Lifecycle(engine)
        self.config = engine.config
        self.model_name = model_name
        self.sampling_defaults = generation_defaults(engine.config.model)
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(engine.stats, model_name)
        register_tier_metrics(self.metrics.registry, engine.engine, model_name)  # the KV tiers' counters
        self.token_text = TokenText(self.tokenizer)
        self.created = int(time.time())
        self.vocab_size = engine.engine.model_config.vocab_size
        # stored /v1/responses results, for previous_response_id and GET
        self.responses = ResponseStore(responses_store_bytes)
        self.metrics.watch_store(self.responses)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def need_tokenizer(self):
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (start the server with --tokenizer DIR)",
                           param="model")
        return self.tokenizer

    async def admit(self, prompts: list, params: SamplingParams, prefix: str) -> RequestStream:
        """The generation routes' one call into the engine: one engine request per prompt, one stream. The id the
        client gets (stream.api_id) is the engine's, so the server's log line for a request names it (one prompt;
        several: the id, a dash and the prompt's index)."""
        h = uuid.uuid4().hex
        base = {"msg": f"msg_{h[:24]}", "resp": f"resp_{h}"}.get(prefix, f"{prefix}-{h}")  # each API's id shape
        reqs = [(base if len(prompts) == 1 else f"{base}-{i}", p, params) for i, p in enumerate(prompts)]
        stream = self.lifecycle.track(await self.engine.add_requests(reqs))
        stream.api_id = base
        return stream


def _server(request: Request) -> ServerState:
    return request.app.state.server


async def _off_loop(fn, *args):
    """Run request preparation (templating, tokenizing, schema compilation) on a worker thread, so that a big
    body does not pause every other stream and /health while it is processed."""
    return await asyncio.to_thread(fn, *args)


# ---- request bodies to prompts and SamplingParams ----------------------------------------------------
def _sampling_params(body, max_tokens: Optional[int], logprobs: Optional[int],
                     defaults: Optional[dict] = None) -> SamplingParams:
    """defaults: the model's sampling (generation_config.json), for the fields the body leaves out."""
    defaults = defaults or {}
    stop = body.stop
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop strings are allowed", param="stop")
    temperature = body.temperature if body.temperature is not None else defaults.get("temperature", 1.0)
    top_p = body.top_p if body.top_p is not None else defaults.get("top_p", 1.0)
    if temperature < SAMPLING_EPS or top_p < SAMPLING_EPS:
        # Both leave only the most likely token; dividing by (or comparing in float32 against) a near-zero
        # value would instead overflow to inf/NaN probabilities.
        temperature, top_p = 0.0, 1.0
    seed = body.seed
    if seed is not None:
        seed %= 1 << 63  # torch generators take unsigned 64-bit seeds; keep every int valid and distinct enough
    kw: dict[str, Any] = dict(
        n=body.n if body.n is not None else 1, max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, seed=seed, stop=stop,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        logprobs=logprobs, ignore_eos=bool(body.ignore_eos),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False, prompt_logprobs=body.prompt_logprobs)
    for name in ("top_k", "min_p", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None or name in defaults:
            kw[name] = value if value is not None else defaults[name]
    if body.min_tokens is not None:
        kw["min_tokens"] = body.min_tokens
    # Token ids in stop_token_ids, logit_bias and allowed_token_ids are checked against the vocabulary by the
    # input processor, which also spells bad_words in tokens and truncates the prompt (truncate_prompt_tokens).
    if body.stop_token_ids:
        kw["stop_token_ids"] = body.stop_token_ids
    if body.logit_bias:
        kw["logit_bias"] = _logit_bias(body.logit_bias)
    kw.update(allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
              truncate_prompt_tokens=body.truncate_prompt_tokens)
    kw["structured_output"] = response_format_spec(body.response_format)
    return SamplingParams(**kw)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's JSON keys are token ids as strings."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    return out


def _no_streamed_prompt_logprobs(body) -> None:
    if body.prompt_logprobs is not None and body.stream:  # as vLLM: they come with the whole reply only
        raise APIError(400, "prompt_logprobs is not available with stream (use echo with logprobs on "
                            "/v1/completions to stream a prompt's logprobs)", param="prompt_logprobs")


def _no_stream_options_unstreamed(body) -> None:
    if body.stream_options is not None and not body.stream:  # as OpenAI
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


def _prompts_of(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "the prompt is empty; give text, token ids, or a non-empty list of either",
                       param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _completion_input(srv: ServerState, body: CompletionRequest) -> tuple[list, SamplingParams]:
    """The prompts (text or token ids, engine-ready) and sampling of a completion request, checked."""
    _no_streamed_prompt_logprobs(body)
    _no_stream_options_unstreamed(body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    n = body.n if body.n is not None else 1
    if body.best_of is not None and body.best_of != n:
        raise APIError(400, "best_of must equal n (beam and best-of search are not implemented)", param="best_of")
    prompts = _prompts_of(body.prompt)
    capacity = srv.engine.capacity
    if len(prompts) * n > capacity:
        raise APIError(400, f"{len(prompts)} prompts x n={n} sequences in one request; this server holds at "
                            f"most {capacity}", param="prompt" if len(prompts) > 1 else "n")
    params = _sampling_params(body, body.max_tokens if body.max_tokens is not None else 16, body.logprobs,
                              srv.sampling_defaults)
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with their logprobs too
        params = SamplingParams(**{**params.__dict__, "prompt_logprobs": max(body.logprobs, body.prompt_logprobs or 0)})
    return prompts, params


def _render_chat(tok, body: Union[ChatCompletionRequest, TokenizeRequest], messages: list[dict], extra: dict) -> str:
    """The prompt text of a chat or tokenize request: its template variables, then the tools' (extra)."""
    return tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt is not False,
                                   continue_final_message=bool(body.continue_final_message),
                                   chat_template_kwargs=body.chat_template_kwargs, **extra)


def _chat_input(srv: ServerState, body: ChatCompletionRequest
                ) -> tuple[list[int], SamplingParams, Optional[int], Optional[ToolContext]]:
    """The templated prompt's token ids, sampling, top logprobs (None: no logprobs) and tools of a chat request."""
    tok = srv.need_tokenizer()
    _no_streamed_prompt_logprobs(body)
    _no_stream_options_unstreamed(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    tools = _tool_context(body, tok)
    messages, extra = template_messages(messages_for_template(body.messages), body.messages,
                                        tools.tools if tools else None, tok.chat_template)
    ids = tok.encode(_render_chat(tok, body, messages, extra), add_special_tokens=False)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(body, max_tokens, k, srv.sampling_defaults)  # max_tokens None: the input processor fills in the rest
    if tools is not None and tools.forced:
        params = SamplingParams(**{**params.__dict__, "structured_output": tools.spec})
    if params.n > srv.engine.capacity:
        raise APIError(400, f"n={params.n} sequences; this server holds at most {srv.engine.capacity}", param="n")
    return ids, params, k, tools


def _tool_context(body: ChatCompletionRequest, tok) -> Optional[ToolContext]:
    """The request's tool settings checked against each other; None when it offers no tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    if choice in ("required",) or isinstance(choice, dict):
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with a forced tool call (tool_choice "
                                "required or a named function)", param="response_format")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    return ToolContext(tools, None if choice == "auto" else choice, body.parallel_tool_calls is not False,
                       tok.chat_template)


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- routes ------------------------------------------------------------------------------------------
async def health(request: Request):
    if not _server(request).engine.is_running:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return {"status": "ok"}


async def version(request: Request):
    from kvinfer import __version__

    return {"version": __version__}


async def metrics(request: Request):
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(srv: ServerState) -> dict:
    return {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "kvinfer",
            "root": str(srv.config.model) if srv.config.model else BUILTIN_MODEL_NAME,
            "max_model_len": srv.engine.max_model_len}


async def models(request: Request):
    return {"object": "list", "data": [_model_card(_server(request))]}


async def model(model_id: str, request: Request):
    srv = _server(request)
    srv.check_model(model_id)
    return _model_card(srv)


async def tokenize(body: TokenizeRequest, request: Request):
    srv = _server(request)
    srv.check_model(body.model)
    return await _off_loop(_tokenize, srv, body)


def _tokenize(srv: ServerState, body: TokenizeRequest) -> dict:
    tok = srv.need_tokenizer()
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.tools and body.messages is None:
        raise APIError(400, "tools need messages (they are rendered through the chat template)", param="tools")
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        messages, extra = template_messages(messages_for_template(body.messages), body.messages, tools,
                                            tok.chat_template)
        ids = tok.encode(_render_chat(tok, body, messages, extra), add_special_tokens=bool(body.add_special_tokens))
    else:
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    out = {"count": len(ids), "max_model_len": srv.engine.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


async def detokenize(body: DetokenizeRequest, request: Request):
    srv = _server(request)
    srv.check_model(body.model)
    tok = srv.need_tokenizer()
    bad = next((t for t in body.tokens if not 0 <= t < srv.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {srv.vocab_size})", param="tokens")
    return {"prompt": tok.decode(body.tokens)}


async def completions(body: CompletionRequest, request: Request):
    srv = _server(request)
    srv.check_model(body.model)
    prompts, params = await _off_loop(_completion_input, srv, body)
    stream = await srv.admit(prompts, params, "cmpl")
    reply = CompletionReply(srv.model_name, stream, srv.token_text, prompts, params.n, bool(body.echo),
                            body.logprobs, body.prompt_logprobs)
    return await respond(reply, request, srv.metrics, bool(body.stream), _include_usage(body))


async def chat_completions(body: ChatCompletionRequest, request: Request):
    srv = _server(request)
    srv.check_model(body.model)
    ids, params, k, tools = await _off_loop(_chat_input, srv, body)
    stream = await srv.admit([ids], params, "chatcmpl")
    note_page_request(request, stream.request_id, body.messages)
    reply = ChatReply(srv.model_name, stream, srv.token_text, params.n, k, tools, body.prompt_logprobs is not None)
    reply.reasoning = reasoning_parser(request.app, params)
    return await respond(reply, request, srv.metrics, bool(body.stream), _include_usage(body))


async def create_response(body: ResponsesRequest, request: Request):
    srv = _server(request)
    srv.check_model(body.model)
    history: list[dict] = []
    if body.previous_response_id is not None:
        prev = srv.responses.get(body.previous_response_id)
        if prev is None:
            raise APIError(400, f"previous response {body.previous_response_id!r} not found ({_STORE_NOTE})",
                           param="previous_response_id", code="not_found")
        history = prev.conversation
    try:
        ids, params, k, tools = await _off_loop(lambda: _chat_input(srv, chat_request(body, history)))
        stream = await srv.admit([ids], params, "resp")
    except (APIError, KvinferError) as e:
        raise responses_error(e) from None
    builder = ResponseBuilder(body, srv.model_name, history, stream.api_id)
    reply = ChatReply(srv.model_name, stream, srv.token_text, 1, k, tools)
    reply.reasoning = reasoning_parser(request.app, params)
    store = srv.responses if body.store is not False else None
    if body.stream:
        return SSEResponse(response_events(builder, reply, srv.metrics, store), stream)
    finals = await collect(stream, request, srv.metrics)
    if finals is None:
        return Response(status_code=499)
    out = builder.from_chat(reply.body(finals))
    builder.keep(store, out)
    return out


_STORE_NOTE = "stored responses are kept in memory within --responses-store-size, the oldest dropped first"


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} not found ({_STORE_NOTE})", param="response_id", code="not_found")


def _stored(srv: ServerState, response_id: str) -> StoredResponse:
    entry = srv.responses.get(response_id)
    if entry is None:
        raise _not_stored(response_id)
    return entry


async def get_response(response_id: str, request: Request):
    return _stored(_server(request), response_id).body


async def list_input_items(response_id: str, request: Request, after: Optional[str] = None,
                           before: Optional[str] = None, limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc"):
    return item_page(_stored(_server(request), response_id).inputs, after, before, limit, order)


async def delete_response(response_id: str, request: Request):
    if not _server(request).responses.delete(response_id):
        raise _not_stored(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# (method, path, route, documents the error shape) in matching order
_ROUTES = [
    ("GET", "/health", health, False),
    ("GET", "/version", version, False),
    ("GET", "/metrics", metrics, False),
    ("GET", "/v1/models", models, True),
    ("GET", "/v1/models/{model_id:path}", model, True),
    ("POST", "/tokenize", tokenize, True),
    ("POST", "/detokenize", detokenize, True),
    ("POST", "/v1/completions", completions, True),
    ("POST", "/v1/chat/completions", chat_completions, True),
    ("POST", "/v1/responses", create_response, True),
    ("GET", "/v1/responses/{response_id}", get_response, True),
    ("GET", "/v1/responses/{response_id}/input_items", list_input_items, True),
    ("DELETE", "/v1/responses/{response_id}", delete_response, True),
]


# ---- errors: always the OpenAI shape, 400 (not 422) for a body that does not validate ------------------
async def _api_error(request: Request, e: APIError):
    return e.response()


async def _engine_error(request: Request, e: KvinferError):
    return from_engine_error(e).response()


async def _validation_error(request: Request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if loc[:1] in (["query"], ["path"]):  # a query parameter is named as the body's fields are
        loc = loc[1:]
    param = None
    if loc and isinstance(loc[0], str):
        param = loc[0]
        # messages[0].role reads better than "messages"; stop at union branch names like 'list[int]'.
        for x in loc[1:]:
            if isinstance(x, int):
                param += f"[{x}]"
            elif isinstance(x, str) and x.isidentifier() and x not in ("str", "int", "float", "bool"):
                param += f".{x}"
            else:
                break
    if first.get("type") == "unicode_surrogate":
        param, msg = first["ctx"]["param"], first["msg"]
    elif first.get("type") == "json_invalid":
        msg = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    elif not loc:
        msg = "the body must be a JSON object" if first.get("type") != "missing" else "the body is missing"
    else:
        msg = f"{param or '.'.join(map(str, loc))}: {first.get('msg', 'invalid')}"
        if len(errs) > 1 and param is not None and all(
                [y for y in x.get("loc", ()) if y != "body"][:1] == loc[:1] for x in errs):
            msg += " (no accepted type matched)"
    return JSONResponse(error_body(msg, "invalid_request_error", param, "invalid_value"), status_code=400)


async def _http_error(request: Request, e: StarletteHTTPException):
    if isinstance(e, BodyTooLarge):
        return e.err.response()
    parse = body_parse_error(e) if e.status_code == 400 else None
    if parse is not None:
        return (responses_error(parse) if request.url.path.startswith("/v1/responses") else parse).response()
    if e.status_code == 404:
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}", "invalid_request_error",
                                       None, "not_found"), status_code=404)
    if e.status_code == 405:
        return JSONResponse(error_body(f"method {request.method} is not allowed on {request.url.path}",
                                       "invalid_request_error", None, "method_not_allowed"), status_code=405)
    return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


async def _bug(request: Request, e: Exception):
    log.exception("unhandled error serving %s %s", request.method, request.url.path)
    return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


_HANDLERS = [(APIError, _api_error), (KvinferError, _engine_error), (RequestValidationError, _validation_error),
             (StarletteHTTPException, _http_error), (Exception, _bug)]


# ---- the app -----------------------------------------------------------------------------------------
def create_app(engine: AsyncLLMEngine, model_name: Optional[str] = None, api_key: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
               allowed_hosts: Optional[frozenset[str]] = None,
               responses_store_bytes: Optional[int] = None, access_log: bool = False) -> FastAPI:
    """The OpenAI-compatible app; the engine must be started (its thread steps the model). `allowed_hosts`:
    the Host header names it answers (None: any; `kvinfer serve` on loopback passes the loopback names)."""
    model_name = model_name or default_model_name(engine.config)
    app = FastAPI(title="kvinfer", version=_version(),
                  description="OpenAI-compatible completions, chat completions and responses served by kvinfer.")
    app.state.lifecycle = lifecycle = Lifecycle(engine, shutdown_timeout)
    app.state.server = ServerState(engine, model_name, lifecycle, responses_store_bytes)
    if access_log:  # one line per finished request
        app.state.server.metrics.access_log = server_logger()
    for exc, handler in _HANDLERS:
        app.add_exception_handler(exc, handler)
    for method, path, route, documented in _ROUTES:
        app.add_api_route(path, route, methods=[method], responses=_ERRORS if documented else None)
    add_page_routes(app, engine, model_name)
    _document(app, model_name)
    from kvinfer.server.anthropic_messages import add_anthropic_api  # it imports this module's request checks
    from kvinfer.server.embeddings import add_embeddings_api

    add_embeddings_api(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    add_anthropic_api(app, api_key, max_body_bytes)  # its key middleware goes outside the guard
    app.add_middleware(DrainMiddleware, lifecycle=lifecycle)  # a draining server parses nothing
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)  # outermost
    return app


def _document(app: FastAPI, model_name: str) -> None:
    """Tell OpenAPI readers (and fuzzers) which model name is valid; validation itself answers 404 for others."""

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for item in schema.get("paths", {}).values():
            for op in item.values():
                op.get("responses", {}).pop("422", None)  # invalid bodies get 400 here, in the OpenAI shape
        schemas = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        for comp in schemas.values():
            props = comp.get("properties", {})
            if "model" in props and comp.get("title") != "ModelCard":
                props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                                  "title": "Model", "description": f"the served model name ({model_name!r})"}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _version() -> str:
    try:
        from kvinfer import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "0"


# ---- serving from a thread (tests, benchmarks) -------------------------------------------------------
class ServerThread:
    """Runs uvicorn on its own event loop in a daemon thread; `port=0` picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                     timeout_keep_alive=30, timeout_graceful_shutdown=5, access_log=False)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="kvinfer-http", daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
