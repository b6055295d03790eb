"""The web page of `kvinfer serve`: chat plus the paged KV cache seen live (static files and a JSON state route)."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from kvinfer.engine.async_engine import AsyncLLMEngine
from kvinfer.engine.kv_state import kv_state
from kvinfer.errors import KvinferError
from kvinfer.server.protocol import error_body, message_text

STATIC = Path(__file__).resolve().parent / "static"
STATE_PATH = "/kv/state"
PAGE_HEADER = "x-kvinfer-page"  # the page marks its own chat requests; only theirs may show prompt text
PROMPT_PREVIEW_CHARS = 160
MAX_REMEMBERED = 1024  # page requests whose preview is kept; older ones just lose their text
RATE_WINDOW_S = 3.0
STATE_TIMEOUT_S = 60.0  # a snapshot waits for the step in progress; a long prefill on CPU can take seconds

# Model output is only ever set as text by app.js; the policy also forbids inline script and foreign origins,
# so nothing that slips into the DOM could run.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
_MEDIA = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}


class PageState:
    """What the page routes keep between calls: prompt previews of the page's own requests, a tokens/s meter."""

    def __init__(self):
        self.previews: OrderedDict[str, str] = OrderedDict()  # engine request (group) id -> start of its prompt
        self.samples: deque[tuple[float, int]] = deque()  # (time, generated tokens so far) per state read

    def remember(self, request_id: str, messages) -> None:
        user = [message_text(m) for m in messages if m.role == "user"]
        text = user[-1] if user else ""
        self.previews[request_id] = text[:PROMPT_PREVIEW_CHARS]
        while len(self.previews) > MAX_REMEMBERED:
            self.previews.popitem(last=False)

    def tokens_per_s(self, now: float, generated: int) -> Optional[float]:
        """Generated tokens per second over the last few seconds of state reads (None until two reads)."""
        self.samples.append((now, generated))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW_S:
            self.samples.popleft()
        t0, g0 = self.samples[0]
        if now - t0 < 0.2:
            return None
        return max(generated - g0, 0) / (now - t0)


def note_page_request(request: Request, request_id: str, messages) -> None:
    """Called by the chat route: a request sent by the page may show its prompt on the page's KV map."""
    page: Optional[PageState] = getattr(request.app.state, "page", None)
    if page is not None and request.headers.get(PAGE_HEADER) == "1":
        page.remember(request_id, messages)


def _static(name: str) -> FileResponse:
    path = STATIC / name
    return FileResponse(path, media_type=_MEDIA[path.suffix], headers=_HEADERS)


def add_page_routes(app: FastAPI, engine: AsyncLLMEngine, model_name: str) -> None:
    """`/` (the page), `/static/*` (its files) and `/kv/state` (guarded by the API key like /v1)."""
    page = PageState()
    app.state.page = page
    files = {p.name for p in STATIC.iterdir() if p.suffix in _MEDIA}

    @app.get("/", include_in_schema=False)
    async def index():
        return _static("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in files:
            return JSONResponse(error_body(f"no static file {name!r}", "invalid_request_error", None, "not_found"),
                                status_code=404)
        return _static(name)

    @app.get(STATE_PATH, include_in_schema=False)
    async def state():
        try:
            snap = await asyncio.wait_for(engine.call(kv_state), STATE_TIMEOUT_S)
        except (KvinferError, asyncio.TimeoutError) as e:
            msg = str(e) or "the engine did not answer in time"
            return JSONResponse(error_body(msg, "server_error", None, "engine_unavailable"), status_code=503)
        snap["model"] = model_name
        snap["tokens_per_s"] = page.tokens_per_s(time.monotonic(), snap["generation_tokens"])
        for s in snap["seqs"]:
            preview = page.previews.get(s["group"])
            s["source"] = "page" if preview is not None else "api"
            if preview is not None:
                s["prompt"] = preview
        return snap
