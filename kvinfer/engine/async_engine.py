"""AsyncLLMEngine: one thread owns and steps an LLMEngine; asyncio callers get per-request output streams."""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from kvinfer.config import EngineConfig
from kvinfer.engine.commands import Abort, AddRequests, Call, Command, Retire, Shutdown, StopSample
from kvinfer.engine.outputs import RequestOutput
from kvinfer.engine.processing import CoreOutput, OutputProcessor
from kvinfer.errors import KvinferError
from kvinfer.sampling_params import SamplingParams

log = logging.getLogger("kvinfer")

Prompt = Union[str, Sequence[int]]

DEFAULT_MAX_QUEUE = 256
_INLINE_TEXT_CHARS = 16384  # prompt text up to this many characters is tokenized inline (a thread hop costs more)


class QueueFullError(KvinferError):
    """Too many requests are already waiting for a batch slot; the caller should retry later."""

    def __init__(self, message: str):
        self.param = None
        super().__init__(message)


class EngineStepError(KvinferError):
    """A step failed (a bug, not the caller's input); the requests in flight were aborted and the engine goes on."""

    def __init__(self, message: str):
        self.param = None
        super().__init__(message)


class EngineDeadError(KvinferError):
    """The engine thread has stopped (shut down or crashed); no request can be served."""

    def __init__(self, message: str = "the engine is not running"):
        self.param = None
        super().__init__(message)


@dataclass
class EngineStats:
    """A consistent snapshot taken by the engine thread after each step; cheap to read from any thread."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hits: int = 0  # blocks served from the prefix cache
    prefix_cache_queries: int = 0  # full prompt blocks looked up
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    kv_dtype: str = ""  # element type of the KV cache (float32, int8, fp8, ...)
    kv_bytes_per_token: int = 0
    spec_drafts: int = 0  # verifications of proposed tokens
    spec_draft_tokens: int = 0  # proposed tokens verified
    spec_accepted_tokens: int = 0
    time: float = field(default_factory=time.time)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


_END = object()  # queued into a stream when it ends without a final output (abort, engine failure)


class RequestStream:
    """Async iterator over the RequestOutputs of one or more engine requests, ending when all finish.

    Several requests may share a stream (one HTTP request with several prompts); each output carries
    its `request_id` so the consumer can tell them apart. The stream owns the output processing of its
    requests, run on its loop as the core's token-level outputs arrive (whether or not anyone iterates).
    """

    def __init__(self, engine: "AsyncLLMEngine", request_ids: list[str], loop: asyncio.AbstractEventLoop,
                 outputs: OutputProcessor, num_seqs: int = 1):
        self.request_ids = request_ids
        self.outputs = outputs
        self.num_seqs = num_seqs  # sequences (requests x samples) it holds against the engine's queue limit
        self._engine = engine
        self._loop = loop
        self._pending = deque()
        self._wakeup: Optional[asyncio.Future] = None
        self._unfinished = set(request_ids)
        self._error: Optional[BaseException] = None
        self.closed = False

    @property
    def request_id(self) -> str:
        return self.request_ids[0]

    # called on the event loop (scheduled from the engine thread)
    def _put(self, item: Any) -> None:
        self._pending.append(item)
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._put(_END)

    def _request_aborted(self, request_id: str) -> None:
        # Aborted by id from elsewhere (AsyncLLMEngine.abort): no final output will come for it.
        self.outputs.abort(request_id)
        if request_id in self._unfinished:
            self._unfinished.discard(request_id)
            if not self._unfinished:
                self._put(_END)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self.closed and not self._pending:
                raise StopAsyncIteration
            if self._pending:
                item = self._pending.popleft()
                if item is _END:
                    self._close()
                    if self._error is not None:
                        raise self._error
                    raise StopAsyncIteration
                if item.finished:
                    self._unfinished.discard(item.request_id)
                    if not self._unfinished:
                        self._close()
                return item
            self._wakeup = self._loop.create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self._engine._release(self)

    # called on the event loop, with the core's outputs of one step
    def _process(self, core_outs: list[CoreOutput]) -> None:
        if self.closed:
            return  # aborted: the abort command frees its groups
        try:
            outs, stops, corrected = self.outputs.process(core_outs)
        except Exception as e:  # a bug (a tokenizer that cannot decode): end this stream, free its requests
            log.exception("output processing failed; aborting %s", sorted(self._unfinished))
            self._engine._send(Abort(tuple(self._unfinished)))
            self._unfinished.clear()
            self._fail(EngineStepError(f"internal error while processing outputs ({type(e).__name__}: {e}); "
                                       "the request was aborted"))
            return
        send = self._engine._send
        for request_id, index, kept in stops:  # at once, so the core stops spending steps on them
            send(StopSample(request_id, index, kept))
        for out in outs:
            if not out.finished:
                self._put(out)
            elif out.request_id in corrected:
                # After the stop commands, in order: the core corrects its counts, then hands the final back,
                # so a client that sees its response finds it counted as it was kept.
                send(Retire(out.request_id, self, out))
            else:
                send(Retire(out.request_id))
                self._put(out)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        """Stop the requests still running (their KV blocks are freed) and end the stream; idempotent."""
        if self._unfinished:
            self._engine._send(Abort(tuple(self._unfinished)))
            self._unfinished.clear()
        self._pending.clear()
        self._close()
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)


class AsyncLLMEngine:
    """Wraps an LLMEngine for asyncio servers.

    A dedicated thread owns the engine core: it takes commands (add, abort, stop, retire) from a thread-safe
    queue, steps while there is work, and hands each step's token-level outputs to the event loop in one batch
    with `call_soon_threadsafe`, so the loop never waits on the model and the model never waits on the loop.
    Output processing (detokenization, stop strings) runs on the loop, per stream. A stop string found there
    comes back as a StopSample command; the core keeps every request's group until a Retire command (or an Abort)
    says its outputs are done, so the tokens it made after a stop string can always be
    uncounted, even when it finished the request by length or EOS first.
    """

    def __init__(self, engine, max_queue: int = DEFAULT_MAX_QUEUE, start: bool = True):
        self.engine = engine
        self.max_queue = max_queue
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self._commands: "queue.SimpleQueue[Command]" = queue.SimpleQueue()  # engine/commands.py
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._num_active = 0  # sequences admitted and not yet released (callers may sit on several loops)
        self._active_lock = threading.Lock()
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._stopping = False
        self._dead: Optional[BaseException] = None
        self.on_dead: Optional[Callable[[], None]] = None  # called from the engine thread once it has failed
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="kvinfer-engine", daemon=True)
        if start:
            self.start()

    @classmethod
    def from_config(cls, config: EngineConfig, max_queue: int = DEFAULT_MAX_QUEUE) -> "AsyncLLMEngine":
        from kvinfer.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), max_queue=max_queue)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; streams still open end with EngineDeadError."""
        self._stopping = True
        self._commands.put(Shutdown())
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.ident is not None and not self._thread.is_alive():
            # No retire can come any more (the streams have failed): no group outlives the thread.
            for rid in list(self.engine.groups):
                self.engine.abort(rid)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

    # ---- requests (event loop side) ----------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Most sequences (requests x n) in flight at once: a full batch plus `max_queue` waiting."""
        return self.engine.config.max_num_seqs + self.max_queue

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_request(self, request_id: Optional[str], prompt: Prompt,
                          params: Optional[SamplingParams] = None) -> RequestStream:
        """Admit one request; raises ValidationError / RequestTooLargeError / QueueFullError before any output."""
        return await self.add_requests([(request_id, prompt, params)])

    async def add_requests(self, requests: Sequence[tuple[Optional[str], Prompt, Optional[SamplingParams]]]
                           ) -> RequestStream:
        """Admit several requests atomically (all or none) onto one shared output stream."""
        if not self.is_running:
            raise EngineDeadError() if self._dead is None else EngineDeadError(f"the engine failed: {self._dead!r}")
        # Input processing here, not on the engine thread (it only queues token ids already checked); long texts
        # are tokenized on a worker thread, so that one big prompt does not pause every other stream on this loop.
        def process():
            return [self.engine.processor.process(rid if rid is not None else self.new_request_id(), p, sp)
                    for rid, p, sp in requests]

        long_text = sum(len(p) for _, p, _ in requests if isinstance(p, str)) > _INLINE_TEXT_CHARS
        reqs = await asyncio.to_thread(process) if long_text else process()
        seqs = sum(r.params.n for r in reqs)
        limit = self.capacity
        with self._active_lock:
            if self._num_active + seqs > limit:
                raise QueueFullError(f"the server is busy: {self._num_active} sequences in flight, at most {limit} "
                                     f"({self.engine.config.max_num_seqs} running + {self.max_queue} queued); "
                                     "retry later")
            self._num_active += seqs
        loop = asyncio.get_running_loop()
        outputs = OutputProcessor(self.tokenizer)
        for r in reqs:
            outputs.add(r.request_id, r)
        stream = RequestStream(self, [r.request_id for r in reqs], loop, outputs, seqs)
        accepted = loop.create_future()
        self._send(AddRequests(stream, reqs, accepted))
        try:
            await accepted
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                # The engine may have admitted them already; aborting an unknown id is harmless.
                stream.abort()
            else:
                stream._close()
            raise
        return stream

    async def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None) -> RequestOutput:
        """Run one request to completion and return its final output (aborting it if cancelled)."""
        stream = await self.add_request(request_id, prompt, params)
        final = None
        try:
            async for out in stream:
                final = out
        finally:
            stream.abort()
        return final

    def abort(self, request_id: str) -> None:
        """Abort a request by id (thread-safe); its stream, if any, ends."""
        self._send(Abort((request_id,)))

    def stats(self) -> EngineStats:
        return self._stats

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` run on the engine thread between two steps (a consistent view), its result returned here.

        For quick read-only looks (the web page's KV map); `fn` must not change the engine.
        """
        if not self.is_running:
            raise EngineDeadError() if self._dead is None else EngineDeadError(f"the engine failed: {self._dead!r}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._send(Call(fn, loop, fut))
        return await fut

    def _release(self, stream: RequestStream) -> None:
        with self._active_lock:
            self._num_active -= stream.num_seqs

    def _send(self, cmd: Command) -> None:
        self._commands.put(cmd)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        leftover: list[Command] = []
        try:
            while True:
                cmds = self._take_commands(block=not eng.has_work())
                if any(isinstance(c, Shutdown) for c in cmds):
                    leftover = cmds
                    break
                for c in cmds:
                    self._handle(c)
                if eng.has_work():
                    try:
                        self._step()
                    except Exception as e:
                        if getattr(e, "fatal", False):
                            raise  # a lost tensor-parallel rank: no later step can run
                        self._recover(e)
                        self._snapshot()
                else:
                    self._snapshot()
        except BaseException as e:  # a bug in the engine: fail every open stream rather than hang them
            if getattr(e, "fatal", False):
                log.error("engine stopped: %s", e)
            else:
                log.exception("engine thread failed")
            self._dead = e
        finally:
            self._stopping = True
            err = EngineDeadError() if self._dead is None else EngineDeadError(f"the engine failed: {self._dead!r}")
            self._fail_all(err)
            # Commands that raced with the stop: resolve their futures so no caller waits forever.
            leftover += self._take_commands(block=False)
            for c in leftover:
                if isinstance(c, AddRequests):
                    self._resolve(c.stream._loop, c.accepted, err)
                elif isinstance(c, Call):
                    self._resolve(c.loop, c.future, err)
                elif isinstance(c, (StopSample, Retire, Abort)) and self._dead is None:
                    self._handle(c)  # bookkeeping only: outputs already processed must not leave groups behind
            if self._dead is not None and self.on_dead is not None:
                self.on_dead()

    def _take_commands(self, block: bool) -> list[Command]:
        """Whatever commands arrived; blocks for one only when `block` (idle: no step to take)."""
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd: Command) -> None:
        eng = self.engine
        if isinstance(cmd, AddRequests):
            stream, added = cmd.stream, []
            try:
                for req in cmd.requests:
                    added.append(eng.add_processed(req))
            except Exception as e:
                for rid in added:
                    eng.abort(rid)
                self._resolve(stream._loop, cmd.accepted, e)
                return
            for rid in added:
                self._streams[rid] = stream
            self._resolve(stream._loop, cmd.accepted, None)
        elif isinstance(cmd, Call):
            try:
                result, exc = cmd.fn(eng), None
            except Exception as e:
                result, exc = None, e
            self._resolve(cmd.loop, cmd.future, exc, result)
        elif isinstance(cmd, StopSample):
            eng.stop_sample(cmd.request_id, cmd.index, cmd.kept)
        elif isinstance(cmd, Retire):
            eng.retire(cmd.request_id)
            self._streams.pop(cmd.request_id, None)
            if cmd.stream is not None:  # a final held back until the stop commands before it corrected the counts
                self._snapshot()
                try:
                    cmd.stream._loop.call_soon_threadsafe(_put_final, cmd.stream, cmd.final)
                except RuntimeError:
                    pass
        elif isinstance(cmd, Abort):
            for rid in cmd.request_ids:
                eng.abort(rid)
                stream = self._streams.pop(rid, None)
                if stream is not None and not stream.closed:
                    try:
                        stream._loop.call_soon_threadsafe(stream._request_aborted, rid)
                    except RuntimeError:
                        pass

    @staticmethod
    def _resolve(loop, fut: asyncio.Future, exc: Optional[BaseException], result: Any = None) -> None:
        def done():
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(result)

        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _step(self) -> None:
        outs = self.engine.step_core()
        # Before the outputs go out: a client that saw its response must find it counted in the stats.
        self._snapshot()
        batches: dict[asyncio.AbstractEventLoop, dict[RequestStream, list[CoreOutput]]] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream._loop, {}).setdefault(stream, []).append(out)
        for loop, batch in batches.items():  # one wake-up per loop and step
            try:
                loop.call_soon_threadsafe(_process, batch)
            except RuntimeError:  # the loop is closed: no retire will ever come, so forget them here
                for stream_outs in batch.values():
                    for out in stream_outs:
                        self.engine.abort(out.request_id)
                        self._streams.pop(out.request_id, None)

    def _recover(self, exc: Exception) -> None:
        """After a failed step, abort everything in flight so one bad batch cannot take the server down."""
        log.exception("engine step failed; aborting the %d requests in flight", len(self.engine.groups))
        self._fail_all(EngineStepError(f"internal error while generating ({type(exc).__name__}: {exc}); "
                                       "the request was aborted"))
        for rid in list(self.engine.groups):
            self.engine.abort(rid)
        self.engine.check_integrity()  # if this fails too, the thread dies and streams get EngineDeadError

    def _fail_all(self, exc: BaseException) -> None:
        streams = {id(s): s for s in self._streams.values()}
        self._streams.clear()
        for s in streams.values():
            try:
                s._loop.call_soon_threadsafe(s._fail, exc)
            except RuntimeError:
                pass

    def _snapshot(self) -> None:
        eng = self.engine
        kv = eng.kv_manager
        hits, queries = kv.prefix_cache_stats()
        self._stats = EngineStats(
            running=len(eng.scheduler.running), waiting=len(eng.scheduler.waiting),
            kv_blocks_used=kv.num_units - kv.num_free_units, kv_blocks_total=kv.num_units,
            prefix_cache_hits=hits, prefix_cache_queries=queries,
            preemptions=eng.scheduler.num_preemptions, prompt_tokens=eng.stats["prompt_tokens"],
            generation_tokens=eng.stats["generation_tokens"], steps=eng.stats["steps"], kv_dtype=eng.kv_dtype,
            kv_bytes_per_token=eng.kv_bytes_per_token,
            spec_drafts=eng.stats["spec_drafts"], spec_draft_tokens=eng.stats["spec_draft_tokens"],
            spec_accepted_tokens=eng.stats["spec_accepted_tokens"])


def _process(batch: dict[RequestStream, list[CoreOutput]]) -> None:
    for stream, outs in batch.items():
        stream._process(outs)


def _put_final(stream: RequestStream, out: RequestOutput) -> None:
    if not stream.closed:
        stream._put(out)
