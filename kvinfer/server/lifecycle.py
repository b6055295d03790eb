"""Graceful shutdown of `kvinfer serve`: on SIGTERM or Ctrl-C stop admitting (503 + Retry-After), let running
requests finish within --shutdown-timeout, end the rest with an error (an error event and [DONE] when streamed),
stop the engine, then let uvicorn exit. A second signal exits at once."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import weakref
from typing import Optional

import uvicorn

from kvinfer.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream

log = logging.getLogger("kvinfer.server")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
RETRY_AFTER_S = 5  # what a refused client is told to wait; another replica (or this one restarted) takes it


class ServerShuttingDown(EngineDeadError):
    """The request was still running when the server's shutdown timeout ran out."""


class Lifecycle:
    """The server's admission state: open, then draining; counts HTTP requests in flight and engine streams."""

    def __init__(self, engine: AsyncLLMEngine, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT):
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.in_flight = 0  # HTTP requests being served (a stream counts until its last byte)
        self._streams: "weakref.WeakSet[RequestStream]" = weakref.WeakSet()
        self._drain_task: Optional[asyncio.Task] = None

    def track(self, stream: RequestStream) -> RequestStream:
        self._streams.add(stream)
        return stream

    def open_streams(self) -> list[RequestStream]:
        return [s for s in list(self._streams) if not s.closed]

    def begin(self, loop: asyncio.AbstractEventLoop, done=None) -> None:
        """Start draining (thread-safe, signal-safe); `done()` is called once the engine has stopped."""
        def start():
            if self._drain_task is None:
                self._drain_task = loop.create_task(self.drain(done))
        loop.call_soon_threadsafe(start)

    async def drain(self, done=None) -> None:
        self.draining = True
        running = len(self.open_streams())
        print(f"kvinfer: shutting down: {running} request(s) running, waiting up to {self.shutdown_timeout:g} s "
              "for them (Ctrl-C again to exit at once)", file=sys.stderr)
        deadline = time.monotonic() + self.shutdown_timeout
        while self.open_streams() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.open_streams()
        if left:
            print(f"kvinfer: ending {len(left)} request(s) still running after {self.shutdown_timeout:g} s",
                  file=sys.stderr)
            err = ServerShuttingDown(f"the server shut down before this request finished (it waited "
                                     f"{self.shutdown_timeout:g} s for running requests)")
            for s in left:
                s._fail(err)  # the response ends with this error; its own finally aborts the engine requests
        await _until(lambda: self.in_flight == 0, 5.0)  # the error events and bodies go out
        await asyncio.to_thread(self.engine.shutdown)
        if done is not None:
            done()


async def _until(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


class DrainMiddleware:
    """Counts requests in flight; while draining, answers every new request 503 with Retry-After."""

    def __init__(self, app, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lc = self.lifecycle
        if lc.draining:
            from kvinfer.server.protocol import APIError

            resp = APIError(503, "the server is shutting down; retry on another replica or after it restarts",
                            "server_error", None, "shutting_down").response()
            resp.headers["Retry-After"] = str(RETRY_AFTER_S)
            resp.headers["Connection"] = "close"
            return await resp(scope, receive, send)
        lc.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            lc.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn with the drain above on the first SIGTERM/SIGINT and an immediate exit on the second."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.signals = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # Unlike uvicorn's, the signal is not raised again afterwards: the shutdown it asked for has happened.
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals += 1
        if self.signals > 1 or self._loop is None:
            print("kvinfer: exiting now", file=sys.stderr)
            os._exit(128 + sig)
        self.lifecycle.begin(self._loop, done=self._stop)

    def _stop(self) -> None:
        self.should_exit = True
