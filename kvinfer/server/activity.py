"""What `kvinfer serve` prints while it serves: one access line per finished request and, every few seconds
while there is work, one engine line (as vLLM does). `--quiet` turns both off."""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
from typing import Callable, Optional

DEFAULT_STATS_INTERVAL = 10.0  # seconds between engine lines

# Request id prefixes (ServerState.admit) to the endpoint that made them.
_ENDPOINTS = {"cmpl": "/v1/completions", "chatcmpl": "/v1/chat/completions", "resp": "/v1/responses",
              "msg": "/v1/messages", "embd": "/v1/embeddings"}


def server_logger() -> logging.Logger:
    """'kvinfer.access': its own stderr handler at INFO, so the lines show whatever --log-level says."""
    log = logging.getLogger("kvinfer.access")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s kvinfer: %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def access_line(out) -> str:
    """One finished request (a RequestOutput): id, endpoint, tokens, time to first token, speed, finish."""
    rid = out.request_id
    kind = re.match(r"[a-z]*", rid).group(0)  # the id's prefix: "chatcmpl-...", "msg_..."
    endpoint = _ENDPOINTS.get(kind, kind)
    gen = sum(len(o.token_ids) for o in out.outputs)
    reasons = ",".join(sorted({o.finish_reason or "abort" for o in out.outputs})) or "abort"
    m = out.metrics
    ttft = tps = total = None
    if m is not None:
        total = (m.last_token_time or m.first_token_time or m.arrival_time) - m.arrival_time
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            span = (m.last_token_time or m.first_token_time) - m.first_token_time
            tps = (gen - len(out.outputs)) / span if span > 0 else None
    f = lambda v, unit: "-" if v is None else f"{v:.3f}{unit}" if unit == "s" else f"{v:.1f}"  # noqa: E731
    return (f"{rid} {endpoint} prompt={len(out.prompt_token_ids)} generated={gen} ttft={f(ttft, 's')} "
            f"tok/s={f(tps, '')} total={f(total, 's')} finish={reasons}")


class EngineLine:
    """A daemon thread printing the engine's state every `interval` seconds while requests run or wait."""

    def __init__(self, stats: Callable[[], object], log: logging.Logger, interval: float = DEFAULT_STATS_INTERVAL):
        self.stats, self.log, self.interval = stats, log, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvinfer-stats", daemon=True)

    def start(self) -> "EngineLine":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        prev, t_prev = self.stats(), time.monotonic()
        while not self._stop.wait(self.interval):
            s, now = self.stats(), time.monotonic()
            line = engine_line(prev, s, now - t_prev)
            if line is not None:
                self.log.info(line)
            prev, t_prev = s, now


def engine_line(prev, s, seconds: float) -> Optional[str]:
    """The line for the interval between two EngineStats snapshots; None when the engine was idle throughout."""
    prompt = s.prompt_tokens - prev.prompt_tokens
    gen = s.generation_tokens - prev.generation_tokens
    if not (s.running or s.waiting or prompt or gen):
        return None
    used = 100.0 * s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
    seconds = max(seconds, 1e-9)
    return (f"engine: running {s.running}, waiting {s.waiting}, KV cache {used:.1f}% "
            f"({s.kv_blocks_used}/{s.kv_blocks_total} blocks), prompt {prompt / seconds:.1f} tok/s, "
            f"generation {gen / seconds:.1f} tok/s, prefix-cache hits {100 * s.prefix_cache_hit_rate:.1f}%")
