"""The completion and chat endpoints' replies from engine outputs: token strings and logprobs, usage, and the one
SSE streaming loop (the Responses API builds on them in openai_responses.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from functools import lru_cache
from typing import Any, AsyncIterator, Iterable, Iterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvinfer.engine.async_engine import RequestStream
from kvinfer.engine.outputs import Logprob
from kvinfer.errors import KvinferError
from kvinfer.server.metrics import LatencyTracker, ServerMetrics
from kvinfer.server.protocol import APIError, error_body, from_engine_error
from kvinfer.server.reasoning import ReasoningParser, ReasoningStream
from kvinfer.server.tool_calls import ToolContext

log = logging.getLogger("kvinfer.server")


# ---- token strings and logprobs ----------------------------------------------------------------------
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


def _lp(v: float) -> float:
    # JSON has no -inf/NaN; OpenAI documents -9999.0 for "very unlikely".
    return v if v == v and v > -9999.0 else -9999.0


class TokenText:
    """Display string and raw bytes of single tokens, cached (logprob responses repeat the same few ids),
    and the two OpenAI logprob formats built from them."""

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

    def completion_logprobs(self, lps, offset: int) -> tuple[dict, int]:
        """The legacy completions format, and the text offset after these tokens."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            s, _ = self.get(lp.token_id)
            tokens.append(s)
            token_lps.append(_lp(lp.logprob))
            top = {s: _lp(lp.logprob)}
            for tid, v in lp.top:
                top.setdefault(self.get(tid)[0], _lp(v))
            tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}, offset

    def prompt_logprobs(self, prompt_ids, lps, k: int) -> tuple[dict, int]:
        """The legacy completions format for an echoed prompt: the first token has no logprob (null, as OpenAI
        and vLLM report it), each later one its Logprob given the tokens before it (k alternatives)."""
        first, _ = self.get(prompt_ids[0]) if prompt_ids else ("", None)
        later = [Logprob(lp.token_id, lp.logprob, lp.top[:k]) for lp in (lps or [None])[1:]]
        rest, offset = self.completion_logprobs(later, len(first))
        if not prompt_ids:
            return rest, 0
        return {"text_offset": [0] + rest["text_offset"], "token_logprobs": [None] + rest["token_logprobs"],
                "tokens": [first] + rest["tokens"], "top_logprobs": [None] + rest["top_logprobs"]}, offset

    def vllm_prompt_logprobs(self, lps) -> list:
        """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: {logprob, rank,
        decoded_token}} for the token itself and its alternatives."""
        out = [None]
        for lp in (lps or [None])[1:]:
            d = {str(tid): {"logprob": _lp(v), "rank": i + 1, "decoded_token": self.get(tid)[0]}
                 for i, (tid, v) in enumerate(lp.top)}
            d[str(lp.token_id)] = {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                   "decoded_token": self.get(lp.token_id)[0]}
            out.append(d)
        return out

    @staticmethod
    def join_logprobs(a: dict, b: dict) -> dict:
        return {key: a[key] + b[key] for key in a}

    def chat_logprobs(self, lps, k: int) -> dict:
        content = []
        for lp in lps:
            s, b = self.get(lp.token_id)
            top = []
            for tid, v in lp.top[:k]:
                ts, tb = self.get(tid)
                top.append({"token": ts, "logprob": _lp(v), "bytes": tb})
            content.append({"token": s, "logprob": _lp(lp.logprob), "bytes": b, "top_logprobs": top})
        return {"content": content}


def usage(finished: Iterable) -> dict:
    """The OpenAI usage object summed over finished RequestOutputs (one per prompt)."""
    prompt_tokens = completion_tokens = cached = 0
    for out in finished:
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        completion_tokens += sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish(reason: Optional[str]) -> str:
    return reason if reason in ("stop", "length") else "stop"


# ---- the two replies: what one request's outputs become, streamed or whole -------------------------
class Reply:
    """One API request's reply over its engine stream: its id, and how outputs become choices."""

    object = chunk_object = ""
    usage_in_chunks = False  # chat chunks carry "usage": null when the client asked for a usage chunk

    def __init__(self, prefix: str, model: str, stream: RequestStream):
        self.id = getattr(stream, "api_id", None) or f"{prefix}-{uuid.uuid4().hex}"  # the engine's id (admit)
        self.created = int(time.time())
        self.model = model
        self.stream = stream

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def opening(self) -> Iterator[dict]:
        """Choices sent before any output."""
        return iter(())

    def chunks(self, out) -> Iterator[dict]:
        """Streamed choices for one RequestOutput."""
        raise NotImplementedError

    def body(self, finals: dict) -> dict:
        """The whole response from the final RequestOutputs by request id."""
        raise NotImplementedError


class CompletionReply(Reply):
    object, chunk_object = "text_completion", "text_completion"

    def __init__(self, model: str, stream: RequestStream, token_text: TokenText, prompts: list, n: int,
                 echo: bool, logprobs: Optional[int], prompt_logprobs: Optional[int] = None):
        super().__init__("cmpl", model, stream)
        self.token_text, self.prompts, self.n = token_text, prompts, n
        self.echo, self.want_lp, self.k = echo, logprobs is not None, logprobs
        self.vllm_prompt = prompt_logprobs is not None  # vLLM's extra: each choice gets "prompt_logprobs"
        self.p_index = {rid: i for i, rid in enumerate(stream.request_ids)}
        self.lp_seen: dict[int, int] = {}
        self.offsets: dict[int, int] = {}
        self.echoed: set[int] = set()

    def _prompt_text(self, p_idx: int, out) -> str:
        """The echoed prompt: its text, or its tokens decoded (a prompt of ids, or one truncate_prompt_tokens cut)."""
        if out.prompt is not None:
            return out.prompt
        tok = self.token_text.tok
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def chunks(self, out) -> Iterator[dict]:
        p_idx = self.p_index[out.request_id]
        for o in out.outputs:
            ci = p_idx * self.n + o.index
            text = o.delta_text
            echo_lps = None
            if self.echo and ci not in self.echoed:
                self.echoed.add(ci)
                prompt = self._prompt_text(p_idx, out)
                text = prompt + text
                self.offsets[ci] = len(prompt)
                if self.want_lp:  # the prompt's tokens first, then the completion's
                    echo_lps = self.token_text.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.k)[0]
            lps = echo_lps
            if self.want_lp and o.logprobs:
                start = self.lp_seen.get(ci, 0)
                self.lp_seen[ci] = len(o.logprobs)
                lps, self.offsets[ci] = self.token_text.completion_logprobs(o.logprobs[start:],
                                                                           self.offsets.get(ci, 0))
                if echo_lps is not None:
                    lps = self.token_text.join_logprobs(echo_lps, lps)
            # One chunk per step that produced tokens, even when their text is held back (a partial
            # character or a possible stop string): clients time tokens by chunks.
            if text or o.finish_reason or o.delta_token_ids:
                yield {"index": ci, "text": text, "logprobs": lps,
                       "finish_reason": _finish(o.finish_reason) if o.finish_reason else None}

    def body(self, finals: dict) -> dict:
        choices = []
        for p_idx, rid in enumerate(self.stream.request_ids):
            out = finals[rid]
            prefix = self._prompt_text(p_idx, out) if self.echo else ""
            echo_lps = (self.token_text.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.k)[0]
                        if self.echo and self.want_lp else None)
            for o in out.outputs:
                lps = self.token_text.completion_logprobs(o.logprobs or [], len(prefix))[0] if self.want_lp else None
                if echo_lps is not None:
                    lps = self.token_text.join_logprobs(echo_lps, lps)
                choice = {"index": p_idx * self.n + o.index, "text": prefix + o.text, "logprobs": lps,
                          "finish_reason": _finish(o.finish_reason)}
                if self.vllm_prompt:
                    choice["prompt_logprobs"] = self.token_text.vllm_prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {**self.head(self.object), "choices": choices,
                "usage": usage(finals[r] for r in self.stream.request_ids)}


class ChatReply(Reply):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    usage_in_chunks = True
    reasoning: Optional[ReasoningParser] = None  # --reasoning-parser: <think> goes to reasoning_content

    def __init__(self, model: str, stream: RequestStream, token_text: TokenText, n: int, k: Optional[int],
                 tools: Optional[ToolContext], prompt_logprobs: bool = False):
        super().__init__("chatcmpl", model, stream)
        self.token_text, self.n, self.k, self.tools = token_text, n, k, tools
        self.vllm_prompt = prompt_logprobs  # vLLM's extra: the reply gets "prompt_logprobs"
        self.lp_seen: dict[int, int] = {}
        self.tool_streams = {i: tools.stream() for i in range(n)} if tools is not None else {}
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def _split(self, index: int, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning, answer) parts of a delta; the answer alone goes on to the tool-call parser."""
        if self.reasoning is None:
            return "", delta
        rs = self.reasoning_streams.setdefault(index, self.reasoning.stream())
        thought, answer = rs.step(delta)
        if finished:
            more_thought, more_answer = rs.end()
            thought, answer = thought + more_thought, answer + more_answer
        return thought, answer

    def opening(self) -> Iterator[dict]:
        for i in range(self.n):
            yield {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}

    def chunks(self, out) -> Iterator[dict]:
        for o in out.outputs:
            lps = None
            if self.k is not None and o.logprobs:
                start = self.lp_seen.get(o.index, 0)
                self.lp_seen[o.index] = len(o.logprobs)
                if len(o.logprobs) > start:
                    lps = self.token_text.chat_logprobs(o.logprobs[start:], self.k)
            ts = self.tool_streams.get(o.index)
            thought, answer = self._split(o.index, o.delta_text, bool(o.finish_reason))
            content, calls = (answer, []) if ts is None else ts.step(answer)
            if content or calls or lps or thought:
                yield {"index": o.index, "delta": _chat_delta(content, calls, thought), "logprobs": lps,
                       "finish_reason": None}
            if o.finish_reason:
                finish = _finish(o.finish_reason)
                if ts is not None:
                    rest, calls, is_call = ts.end()
                    finish = "tool_calls" if is_call else finish
                    if rest or calls:
                        yield {"index": o.index, "delta": _chat_delta(rest, calls), "logprobs": None,
                               "finish_reason": None}
                yield {"index": o.index, "delta": {}, "logprobs": None, "finish_reason": finish}

    def body(self, finals: dict) -> dict:
        out = finals[self.stream.request_id]
        choices = []
        for o in out.outputs:
            thought, answer = self.reasoning.split(o.text) if self.reasoning is not None else (None, o.text)
            message, finish = {"role": "assistant", "content": answer}, _finish(o.finish_reason)
            if self.tools is not None:
                message, finish = self.tools.message(answer, finish)
            if self.reasoning is not None:
                message["reasoning_content"] = thought
            lps = self.token_text.chat_logprobs(o.logprobs or [], self.k) if self.k is not None else None
            choices.append({"index": o.index, "message": message, "logprobs": lps, "finish_reason": finish})
        body = {**self.head(self.object), "choices": choices, "usage": usage([out])}
        if self.vllm_prompt:
            body["prompt_logprobs"] = self.token_text.vllm_prompt_logprobs(out.prompt_logprobs)
        return body


def _chat_delta(content: str, tool_calls: list, reasoning: str = "") -> dict:
    delta: dict[str, Any] = {"content": content} if content or not (tool_calls or reasoning) else {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return delta


# ---- sending a reply ---------------------------------------------------------------------------------
async def respond(reply: Reply, request: Request, metrics: ServerMetrics, stream: bool, include_usage: bool):
    """Server-sent events, or the whole body once every output is final (499 if the client left first)."""
    if stream:
        return SSEResponse(_events(reply, metrics, include_usage), reply.stream)
    finals = await collect(reply.stream, request, metrics)
    if finals is None:
        return Response(status_code=499)
    return reply.body(finals)


def sse(obj: dict, event: Optional[str] = None) -> str:
    """One server-sent event: its data line (JSON), after an `event:` line when it has a name."""
    head = f"event: {event}\n" if event else ""
    return head + "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


_DONE = "data: [DONE]\n\n"


async def _events(reply: Reply, metrics: ServerMetrics, include_usage: bool) -> AsyncIterator[str]:
    """The one streaming loop: a chunk per choice, latencies observed, a usage chunk, errors in-band, abort."""
    stream = reply.stream
    tracker = LatencyTracker(metrics)
    head = reply.head(reply.chunk_object)
    if include_usage and reply.usage_in_chunks:
        head["usage"] = None
    finished = []  # RequestOutputs of finished prompts, for the usage chunk
    try:
        for choice in reply.opening():
            yield sse({**head, "choices": [choice]})
        async for out in stream:
            tracker.observe(out)
            for choice in reply.chunks(out):
                yield sse({**head, "choices": [choice]})
            if out.finished:
                finished.append(out)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(finished)})
        yield _DONE
    except Exception as e:  # the engine died mid-stream: tell the client in-band, then end the stream
        log.warning("stream %s failed: %r", reply.id, e)
        err = from_engine_error(e) if isinstance(e, KvinferError) else APIError(500, "internal error",
                                                                                 "server_error")
        yield sse(error_body(err.message, err.type, err.param, err.code))
        yield _DONE
    finally:
        stream.abort()


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def collect(stream: RequestStream, request: Request, metrics: ServerMetrics) -> Optional[dict]:
    """Final outputs by request id, or None when the client went away first (its requests are aborted)."""
    tracker = LatencyTracker(metrics)

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


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
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
