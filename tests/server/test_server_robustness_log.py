"""`kvinfer serve` prints one access line per finished request and a periodic engine line; --quiet turns both
off (issue 46, item 5)."""
from __future__ import annotations

import logging
import re

import httpx

from kvinfer.engine.async_engine import EngineStats
from kvinfer.server.activity import engine_line
from server_helpers import engine_config, start_server


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_one_access_line_per_finished_request():
    s = start_server(engine_config(), access_log=True)
    handler = _Lines()
    log = logging.getLogger("kvinfer.access")
    log.addHandler(handler)
    try:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True}) as st:
            assert "[DONE]" in st.read().decode()
        msg = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        m = httpx.post(s.url + "/v1/messages", timeout=60, json=msg)
        with httpx.stream("POST", s.url + "/v1/messages", timeout=60, json={**msg, "stream": True}) as st:
            streamed = st.read().decode()
        resp = httpx.post(s.url + "/v1/responses", timeout=60, json={"input": "hi", "max_output_tokens": 4})
    finally:
        log.removeHandler(handler)
        s.stop()
    assert len(handler.lines) == 5, handler.lines
    chat, cmpl, msg_line, msg_streamed, resp_line = handler.lines
    gen = r.json()["usage"]["completion_tokens"]
    assert chat.startswith("chatcmpl-") and " /v1/chat/completions " in chat and f"generated={gen}" in chat
    # the id a client gets is the one its line names, whatever the API's id shape
    assert chat.split()[0] == r.json()["id"], (chat, r.json()["id"])
    assert msg_line.split()[0] == m.json()["id"] and re.fullmatch(r"msg_[0-9a-f]{24}", m.json()["id"]), msg_line
    assert " /v1/messages " in msg_line and " /v1/messages " in msg_streamed, (msg_line, msg_streamed)
    assert f'"id": "{msg_streamed.split()[0]}"' in streamed or f'"id":"{msg_streamed.split()[0]}"' in streamed
    assert resp_line.split()[0] == resp.json()["id"] and " /v1/responses " in resp_line, resp_line
    assert re.search(r"prompt=\d+ generated=\d+ ttft=\d+\.\d+s tok/s=[\d.]+ total=[\d.]+s finish=(stop|length)$",
                     chat), chat
    assert " /v1/completions prompt=1 generated=3 " in cmpl and cmpl.endswith("finish=length"), cmpl


def test_no_access_lines_unless_asked():
    s = start_server(engine_config())
    handler = _Lines()
    logging.getLogger("kvinfer.access").addHandler(handler)
    try:
        httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    finally:
        logging.getLogger("kvinfer.access").removeHandler(handler)
        s.stop()
    assert handler.lines == []


def test_engine_line_reports_load_and_is_silent_when_idle():
    idle = EngineStats(kv_blocks_total=100)
    assert engine_line(idle, idle, 10.0) is None
    busy = EngineStats(running=3, waiting=1, kv_blocks_used=25, kv_blocks_total=100, prompt_tokens=200,
                       generation_tokens=500)
    line = engine_line(idle, busy, 10.0)
    assert line == ("engine: running 3, waiting 1, KV cache 25.0% (25/100 blocks), prompt 20.0 tok/s, "
                    "generation 50.0 tok/s, prefix-cache hits 0.0%"), line


def test_serve_has_quiet():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvinfer.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "--quiet" in out and "--responses-store-size" in out and "--allowed-hosts" in out
