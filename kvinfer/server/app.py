"""The OpenAI-compatible FastAPI app over an AsyncLLMEngine, and a helper that serves it from a thread."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvinfer.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineStepError, QueueFullError,
                                         RequestStream)
from kvinfer.errors import KvinferError, RequestTooLargeError, ValidationError
from kvinfer.sampling_params import SamplingParams
from kvinfer.server.metrics import CONTENT_TYPE, LatencyTracker, ServerMetrics
from kvinfer.server.page import add_page_routes, note_page_request
from kvinfer.server.protocol import (MAX_STOP, ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, ErrorResponse, TokenizeRequest, error_body,
                                     messages_for_template)
from kvinfer.server.tools import ToolContext, response_format_spec, template_messages

log = logging.getLogger("kvinfer.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/kv/")
SAMPLING_EPS = 1e-5  # temperature or top_p below this samples greedily

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def _from_engine_error(e: KvinferError) -> APIError:
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", None, "server_busy")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", None, "engine_unavailable")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), "server_error", None, "internal_error")
    if isinstance(e, RequestTooLargeError):
        return APIError(400, str(e), "invalid_request_error", e.param, "context_length_exceeded")
    if isinstance(e, ValidationError):
        return APIError(400, str(e), "invalid_request_error", e.param, "invalid_value")
    return APIError(400, str(e), "invalid_request_error", getattr(e, "param", None), None)


def default_model_name(config) -> str:
    if config.model is None:
        return BUILTIN_MODEL_NAME
    p = Path(config.model)
    return p.stem if p.suffix == ".gguf" else (p.name or str(config.model))


# ---- ASGI middleware: API key and body size, checked before anything parses the body -----------------
class _GuardMiddleware:
    def __init__(self, app, api_key: Optional[str], max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith(PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                msg = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "invalid API key"
                resp = APIError(401, msg, "invalid_request_error", None, "invalid_api_key").response()
                resp.headers["WWW-Authenticate"] = "Bearer"
                return await resp(scope, receive, send)
        limit = self.max_body_bytes
        too_large = APIError(413, f"the request body is larger than the limit of {limit} bytes",
                             "invalid_request_error", None, "request_too_large")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n > limit:
                return await too_large.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(too_large)
            return msg

        await self.app(scope, limited_receive, send)


class _BodyTooLarge(HTTPException):
    # FastAPI re-raises HTTPException from body reading; any other exception there becomes a generic 400.
    def __init__(self, err: APIError):
        super().__init__(413, err.message)
        self.err = err


# ---- token strings for logprobs ----------------------------------------------------------------------
def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes map to themselves, the rest to U+0100 onwards."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_DECODER = _byte_decoder()


class _TokenText:
    """Display string and raw bytes of single tokens, cached (logprob responses repeat the same few ids)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.get = lru_cache(maxsize=1 << 16)(self._compute)

    def _compute(self, token_id: int) -> tuple[str, Optional[list[int]]]:
        if self.tok is None:
            return f"<{token_id}>", None
        text = self.tok.decode([token_id])
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        # Part of a multi-byte character: the display string is lossy, but the byte-level piece is exact.
        piece = self.tok.convert_ids_to_tokens(token_id) or ""
        if piece and all(c in _BYTE_DECODER for c in piece):
            return text, [_BYTE_DECODER[c] for c in piece]
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            try:
                return text, [int(piece[3:5], 16)]
            except ValueError:
                pass
        return text, list(text.encode("utf-8"))


def _lp(v: float) -> float:
    # JSON has no -inf/NaN; OpenAI documents -9999.0 for "very unlikely".
    return v if v == v and v > -9999.0 else -9999.0


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


# ---- the app -----------------------------------------------------------------------------------------
class _Server:
    """Request handling state shared by the routes: engine, model name, metrics, token text cache."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(engine.stats, model_name)
        self.token_text = _TokenText(self.tokenizer)
        self.created = int(time.time())
        self.vocab_size = engine.engine.model_config.vocab_size

    # -- shared request plumbing
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def sampling_params(self, body, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        stop = body.stop
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise APIError(400, f"at most {MAX_STOP} stop strings are allowed", param="stop")
        temperature = body.temperature if body.temperature is not None else 1.0
        top_p = body.top_p if body.top_p is not None else 1.0
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
            skip_special_tokens=body.skip_special_tokens is not False)
        if body.top_k is not None:
            kw["top_k"] = body.top_k
        if body.min_p is not None:
            kw["min_p"] = body.min_p
        if body.repetition_penalty is not None:
            kw["repetition_penalty"] = body.repetition_penalty
        if body.min_tokens is not None:
            kw["min_tokens"] = body.min_tokens
        if body.stop_token_ids:
            bad = next((t for t in body.stop_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param="stop_token_ids")
            kw["stop_token_ids"] = body.stop_token_ids
        if body.logit_bias:
            kw["logit_bias"] = _logit_bias(body.logit_bias, self.vocab_size)
        kw["structured_output"] = response_format_spec(body.response_format)
        return SamplingParams(**kw)

    async def admit(self, prompts: list, params: SamplingParams, prefix: str) -> RequestStream:
        base = f"{prefix}-{uuid.uuid4().hex}"
        reqs = [(base if len(prompts) == 1 else f"{base}-{i}", p, params) for i, p in enumerate(prompts)]
        return await self.engine.add_requests(reqs)

    async def collect(self, stream: RequestStream, request: Request) -> Optional[dict]:
        """Final outputs by request id, or None when the client went away first (its requests are aborted)."""
        tracker = LatencyTracker(self.metrics)

        async def consume():
            finals = {}
            async for out in stream:
                tracker.observe(out)
                if out.finished:
                    finals[out.request_id] = out
            return finals

        task = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            return None
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
            stream.abort()

    def text_of_prompt(self, prompt, out) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    @staticmethod
    def usage(finished) -> dict:
        """The OpenAI usage object summed over finished RequestOutputs (one per prompt)."""
        prompt_tokens = completion_tokens = cached = 0
        for out in finished:
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            completion_tokens += sum(len(o.token_ids) for o in out.outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- logprob formats
    def completion_logprobs(self, lps, offset: int) -> tuple[dict, int]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            s, _ = self.token_text.get(lp.token_id)
            tokens.append(s)
            token_lps.append(_lp(lp.logprob))
            top = {s: _lp(lp.logprob)}
            for tid, v in lp.top:
                top.setdefault(self.token_text.get(tid)[0], _lp(v))
            tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}, offset

    def chat_logprobs(self, lps, k: int) -> dict:
        content = []
        for lp in lps:
            s, b = self.token_text.get(lp.token_id)
            top = []
            for tid, v in lp.top[:k]:
                ts, tb = self.token_text.get(tid)
                top.append({"token": ts, "logprob": _lp(v), "bytes": tb})
            content.append({"token": s, "logprob": _lp(lp.logprob), "bytes": b, "top_logprobs": top})
        return {"content": content}


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's JSON keys are token ids as strings."""
    out = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise APIError(400, f"logit_bias token id {tid} is outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        out[tid] = value
    return out


def _prompts_of(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "the prompt is empty; give text, token ids, or a non-empty list of either",
                       param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def create_app(engine: AsyncLLMEngine, model_name: Optional[str] = None, api_key: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The OpenAI-compatible app; the engine must be started (its thread steps the model)."""
    model_name = model_name or default_model_name(engine.config)
    srv = _Server(engine, model_name)
    app = FastAPI(title="kvinfer", version=_version(),
                  description="OpenAI-compatible completions and chat completions served by kvinfer.")
    app.state.server = srv

    # -- errors: always the OpenAI shape, 400 (not 422) for a body that does not validate
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(KvinferError)
    async def _engine_error(request: Request, e: KvinferError):
        return _from_engine_error(e).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [x for x in first.get("loc", ()) if x != "body"]
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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if isinstance(e, _BodyTooLarge):
            return e.err.response()
        if e.status_code == 404:
            return JSONResponse(error_body(f"no route {request.method} {request.url.path}", "invalid_request_error",
                                           None, "not_found"), status_code=404)
        if e.status_code == 405:
            return JSONResponse(error_body(f"method {request.method} is not allowed on {request.url.path}",
                                           "invalid_request_error", None, "method_not_allowed"), status_code=405)
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    # -- informational routes
    @app.get("/health")
    async def health():
        if not srv.engine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [{
            "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "kvinfer",
            "root": str(engine.config.model) if engine.config.model else BUILTIN_MODEL_NAME,
            "max_model_len": engine.max_model_len}]}

    @app.get("/v1/models/{model_id:path}", responses=_ERRORS)
    async def model(model_id: str):
        srv.check_model(model_id)
        return (await models())["data"][0]

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        srv.check_model(body.model)
        tok = _need_tokenizer(srv)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            text = tok.apply_chat_template(messages_for_template(body.messages),
                                           add_generation_prompt=body.add_generation_prompt is not False)
            ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        srv.check_model(body.model)
        tok = _need_tokenizer(srv)
        bad = next((t for t in body.tokens if not 0 <= t < srv.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {srv.vocab_size})", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    # -- completions
    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        srv.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        n = body.n if body.n is not None else 1
        if body.best_of is not None and body.best_of != n:
            raise APIError(400, "best_of must equal n (beam and best-of search are not implemented)",
                           param="best_of")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs needs prompt logprobs, which are not implemented", param="echo")
        prompts = _prompts_of(body.prompt)
        if any(isinstance(p, list) and not p for p in prompts):
            raise APIError(400, "a token-id prompt is empty", param="prompt")
        if len(prompts) * n > engine.capacity:
            raise APIError(400, f"{len(prompts)} prompts x n={n} sequences in one request; this server holds at "
                                f"most {engine.capacity}", param="prompt" if len(prompts) > 1 else "n")
        if not srv.tokenizer and any(isinstance(p, str) for p in prompts):
            raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
        params = srv.sampling_params(body, body.max_tokens if body.max_tokens is not None else 16, body.logprobs)
        stream = await srv.admit(prompts, params, "cmpl")
        ctx = _Ctx("cmpl", srv.model_name, stream, prompts, n)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _SSEResponse(_stream_completion(srv, ctx, bool(body.echo), body.logprobs is not None,
                                                   include_usage), stream)
        finals = await srv.collect(stream, request)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for p_idx, rid in enumerate(stream.request_ids):
            out = finals[rid]
            prefix = srv.text_of_prompt(prompts[p_idx], out) if body.echo else ""
            for o in out.outputs:
                lps = srv.completion_logprobs(o.logprobs or [], 0)[0] if body.logprobs is not None else None
                choices.append({"index": p_idx * n + o.index, "text": prefix + o.text, "logprobs": lps,
                                "finish_reason": _finish(o.finish_reason)})
        choices.sort(key=lambda c: c["index"])
        return {"id": ctx.id, "object": "text_completion", "created": ctx.created, "model": srv.model_name,
                "choices": choices, "usage": srv.usage(finals[r] for r in stream.request_ids)}

    # -- chat completions
    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        srv.check_model(body.model)
        tok = _need_tokenizer(srv)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = _tool_context(body, tok)
        messages, extra = template_messages(messages_for_template(body.messages), body.messages,
                                            tools.tools if tools else None, tok.chat_template)
        text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt is not False,
                                       **extra)
        ids = tok.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = srv.sampling_params(body, max_tokens, k)
        if max_tokens is None:
            # Rest of the context window, as OpenAI does; the engine would otherwise pick it per prompt anyway.
            params = SamplingParams(**{**params.__dict__, "max_tokens": max(1, engine.max_model_len - len(ids))})
        if tools is not None and tools.forced:
            params = SamplingParams(**{**params.__dict__, "structured_output": tools.spec})
        if params.n > engine.capacity:
            raise APIError(400, f"n={params.n} sequences; this server holds at most {engine.capacity}", param="n")
        stream = await srv.admit([ids], params, "chatcmpl")
        note_page_request(request, stream.request_id, body.messages)
        n = params.n
        ctx = _Ctx("chatcmpl", srv.model_name, stream, [ids], n)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _SSEResponse(_stream_chat(srv, ctx, k, include_usage, tools), stream)
        finals = await srv.collect(stream, request)
        if finals is None:
            return Response(status_code=499)
        out = finals[stream.request_id]
        choices = []
        for o in out.outputs:
            message, finish = {"role": "assistant", "content": o.text}, _finish(o.finish_reason)
            if tools is not None:
                message, finish = tools.message(o.text, finish)
            choices.append({"index": o.index, "message": message,
                            "logprobs": srv.chat_logprobs(o.logprobs or [], k) if k is not None else None,
                            "finish_reason": finish})
        return {"id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": srv.model_name,
                "choices": choices, "usage": srv.usage([out])}

    add_page_routes(app, engine, model_name)
    _document(app, model_name)
    app.add_middleware(_GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _SSEResponse(StreamingResponse):
    """Server-sent events that always abort their engine requests when the response ends, however it ends.

    A client that leaves before the first byte cancels the response before the body generator ever starts,
    so the generator's own `finally` would never run.
    """

    def __init__(self, body: AsyncIterator[str], stream: RequestStream):
        super().__init__(body, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


def _finish(reason: Optional[str]) -> str:
    return reason if reason in ("stop", "length") else "stop"


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


def _need_tokenizer(srv: _Server):
    if srv.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (start the server with --tokenizer DIR)", param="model")
    return srv.tokenizer


class _Ctx:
    __slots__ = ("id", "created", "model", "stream", "prompts", "n")

    def __init__(self, prefix: str, model: str, stream: RequestStream, prompts: list, n: int):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.stream = stream
        self.prompts = prompts
        self.n = n


def _error_event(e: BaseException) -> str:
    err = _from_engine_error(e) if isinstance(e, KvinferError) else APIError(500, "internal error", "server_error")
    return _sse(error_body(err.message, err.type, err.param, err.code))


async def _stream_completion(srv: _Server, ctx: _Ctx, echo: bool, want_lp: bool,
                             include_usage: bool) -> AsyncIterator[str]:
    stream, n = ctx.stream, ctx.n
    tracker = LatencyTracker(srv.metrics)
    p_index = {rid: i for i, rid in enumerate(stream.request_ids)}
    lp_seen: dict[int, int] = {}
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    finished = []  # RequestOutputs of finished prompts, for the usage chunk
    head = {"id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model}
    try:
        async for out in stream:
            tracker.observe(out)
            p_idx = p_index[out.request_id]
            for o in out.outputs:
                ci = p_idx * n + o.index
                text = o.delta_text
                if echo and ci not in echoed:
                    echoed.add(ci)
                    text = srv.text_of_prompt(ctx.prompts[p_idx], out) + text
                lps = None
                if want_lp and o.logprobs:
                    start = lp_seen.get(ci, 0)
                    lp_seen[ci] = len(o.logprobs)
                    lps, offsets[ci] = srv.completion_logprobs(o.logprobs[start:], offsets.get(ci, 0))
                # One chunk per step that produced tokens, even when their text is held back (a partial
                # character or a possible stop string): clients time tokens by chunks.
                if text or o.finish_reason or o.delta_token_ids:
                    choice = {"index": ci, "text": text, "logprobs": lps,
                              "finish_reason": _finish(o.finish_reason) if o.finish_reason else None}
                    yield _sse({**head, "choices": [choice]})
            if out.finished:
                finished.append(out)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": srv.usage(finished)})
        yield _DONE
    except Exception as e:  # the engine died mid-stream: tell the client in-band, then end the stream
        log.warning("stream %s failed: %r", ctx.id, e)
        yield _error_event(e)
        yield _DONE
    finally:
        stream.abort()


async def _stream_chat(srv: _Server, ctx: _Ctx, k: Optional[int], include_usage: bool,
                       tools: Optional[ToolContext] = None) -> AsyncIterator[str]:
    stream, n = ctx.stream, ctx.n
    tracker = LatencyTracker(srv.metrics)
    lp_seen: dict[int, int] = {}
    head = {"id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model}
    if include_usage:
        head["usage"] = None
    finished = []  # RequestOutputs of finished prompts, for the usage chunk
    try:
        for i in range(n):
            yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        tool_streams = {i: tools.stream() for i in range(n)} if tools is not None else {}
        async for out in stream:
            tracker.observe(out)
            for o in out.outputs:
                lps = None
                if k is not None and o.logprobs:
                    start = lp_seen.get(o.index, 0)
                    lp_seen[o.index] = len(o.logprobs)
                    if len(o.logprobs) > start:
                        lps = srv.chat_logprobs(o.logprobs[start:], k)
                ts = tool_streams.get(o.index)
                content, calls = (o.delta_text, []) if ts is None else ts.step(o.delta_text)
                if content or calls or lps:
                    yield _sse({**head, "choices": [{"index": o.index, "delta": _chat_delta(content, calls),
                                                     "logprobs": lps, "finish_reason": None}]})
                if o.finish_reason:
                    finish = _finish(o.finish_reason)
                    if ts is not None:
                        rest, calls, is_call = ts.end()
                        finish = "tool_calls" if is_call else finish
                        if rest or calls:
                            yield _sse({**head, "choices": [{"index": o.index, "delta": _chat_delta(rest, calls),
                                                             "logprobs": None, "finish_reason": None}]})
                    yield _sse({**head, "choices": [{"index": o.index, "delta": {}, "logprobs": None,
                                                     "finish_reason": finish}]})
            if out.finished:
                finished.append(out)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": srv.usage(finished)})
        yield _DONE
    except Exception as e:
        log.warning("stream %s failed: %r", ctx.id, e)
        yield _error_event(e)
        yield _DONE
    finally:
        stream.abort()


def _chat_delta(content: str, tool_calls: list) -> dict:
    delta: dict[str, Any] = {"content": content} if content or not tool_calls else {}
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return delta


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
