"""The server under big bodies and shutdown (issue 46): request preparation off the event loop, 413 before
parsing, and SIGTERM / Ctrl-C ending every open stream with an error event and [DONE]."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_helpers import assert_error_shape, engine_config, metric, start_server


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config(), max_body_bytes=8 << 20)
    yield s
    s.stop()


def _big_chat(n_bytes: int) -> dict:
    return {"messages": [{"role": "user", "content": "word " * (n_bytes // 5)}], "max_tokens": 1}


def test_big_body_is_tokenized_off_the_event_loop(srv):
    """The tokenizer call waits until /health has answered: on the loop it could never answer (deadlock, 400)."""
    tok = srv.engine.tokenizer
    real = tok.encode
    health_ok = threading.Event()
    seen = {}

    def encode(text, *a, **kw):
        if len(text) > 1 << 20:
            seen["thread"] = threading.current_thread().name
            seen["health_answered_meanwhile"] = health_ok.wait(20)
        return real(text, *a, **kw)

    def poll_health():
        deadline = time.monotonic() + 30
        while "thread" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            if httpx.get(srv.url + "/health", timeout=10).status_code == 200:
                health_ok.set()
        except httpx.TransportError:
            pass

    poller = threading.Thread(target=poll_health)
    tok.encode = encode
    try:
        poller.start()
        r = httpx.post(srv.url + "/v1/chat/completions", json=_big_chat(4_000_000), timeout=120)
    finally:
        tok.encode = real
        poller.join()
    assert seen.get("thread") not in (None, "kvinfer-http"), seen
    assert seen["health_answered_meanwhile"], "the event loop was blocked while the big body was tokenized"
    # The prompt is far over the context, so the request is refused, but only after it was prepared off the loop.
    assert_error_shape(r, 400)


def test_body_over_the_limit_gets_413_before_it_is_parsed():
    s = start_server(engine_config(), max_body_bytes=1 << 20)
    tok = s.engine.tokenizer
    real, calls = tok.encode, []
    tok.encode = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json=_big_chat(2_000_000), timeout=60)
        err = assert_error_shape(r, 413)
        assert "1048576" in err["message"] and err["code"] == "request_too_large"
        assert not calls
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        tok.encode = real
        s.stop()


def test_max_request_bytes_flag():
    out = subprocess.run([sys.executable, "-m", "kvinfer.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert "--max-request-bytes" in out.stdout and "--shutdown-timeout" in out.stdout


# ---- kvinfer serve under SIGTERM / SIGINT ---------------------------------------------------------------
def _serve(*extra: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvinfer.cli", "serve", "--port", str(port), "--max-model-len", "1024",
           "--kv-cache-memory", "64MiB", *extra]
    if os.environ.get("KVINFER_TEST_SERVER_MODEL"):
        cmd += ["--model", os.environ["KVINFER_TEST_SERVER_MODEL"]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "kvinfer serve did not come up"
        time.sleep(0.25)


_LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _stream(url: str, out: dict, key: int, started: threading.Barrier) -> None:
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**_LONG, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        started.wait(60)
    except httpx.HTTPError as e:
        events.append(f"transport error: {e!r}")
    out[key] = events


def _wait_admitted(url: str, n: int, timeout: float = 60) -> None:
    """Until /metrics counts n requests running or waiting in the engine."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        admitted = metric(text, "kvinfer_num_requests_running") + metric(text, "kvinfer_num_requests_waiting")
        if admitted >= n:
            return
        assert time.monotonic() < deadline, f"only {admitted:g} of {n} requests reached the engine"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.stdout.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_open_streams_with_an_error_and_done_then_exits_0(sig):
    proc, url = _serve("--shutdown-timeout", "1")
    results: dict = {}
    started = threading.Barrier(4)
    streams = [threading.Thread(target=_stream, args=(url, results, i, started)) for i in range(3)]
    whole: dict = {}

    def unstreamed():
        try:
            whole["r"] = httpx.post(url + "/v1/completions", json=_LONG, timeout=120)
        except httpx.HTTPError as e:
            whole["r"] = e

    plain = threading.Thread(target=unstreamed)
    try:
        for t in streams:
            t.start()
        plain.start()
        started.wait(60)  # every stream has its first chunk: they are running
        _wait_admitted(url, 4)  # and the unstreamed one is in too (sent after the signal, it would be refused instead)
        proc.send_signal(sig)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
        assert refused.json()["error"]["code"] == "shutting_down"
        for t in streams + [plain]:
            t.join(60)
    finally:
        output = _finish(proc)
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
    for i in range(3):
        events = results[i]
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])
        assert "error" in err and "shut down" in err["error"]["message"], events[-2]
    r = whole["r"]
    assert isinstance(r, httpx.Response), r
    assert_error_shape(r, 503)
    assert "shut down" in r.json()["error"]["message"]


def test_second_ctrl_c_exits_at_once():
    proc, url = _serve("--shutdown-timeout", "120")
    results: dict = {}
    started = threading.Barrier(2)
    t = threading.Thread(target=_stream, args=(url, results, 0, started))
    try:
        t.start()
        started.wait(60)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # draining: waits for the stream
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        proc.wait(20)
        assert time.monotonic() - t0 < 10
    finally:
        output = _finish(proc)
        t.join(60)
    assert "Traceback" not in output, output
    assert "exiting now" in output
