"""The HTTP server end to end: concurrency vs offline, abandoned clients, bad input, limits, AsyncLLMEngine."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from kvinfer import __version__
from kvinfer.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from kvinfer.errors import RequestTooLargeError, ValidationError
from kvinfer.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from server_helpers import (assert_error_shape, engine_config, kv_blocks_used, metric, start_server)

TOPICS = ["the sea", "mountains", "bread", "a cat", "winter", "music", "trains", "the moon", "coffee", "rain",
          "a library", "gardens", "bicycles", "the desert", "snow", "football", "tea", "rivers", "clocks", "bees",
          "a lighthouse", "chess", "forests", "volcanoes", "the city", "dogs", "apples", "stars", "boats", "paper",
          "the wind", "castles"]


@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def _wait_kv_free(client, timeout=15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = client.get("/metrics").text
        if kv_blocks_used(text) == 0 and metric(text, "kvinfer_num_requests_running") == 0 \
                and metric(text, "kvinfer_num_requests_waiting") == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError("KV blocks still in use:\n" + text)
        time.sleep(0.1)


def test_health_models_and_metrics(client, srv):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/version").json() == {"version": __version__}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == srv.model_name
    assert client.get(f"/v1/models/{srv.model_name}").json()["id"] == srv.model_name
    assert_error_shape(client.get("/v1/models/nope"), 404, "model")
    m = client.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in ("kvinfer_num_requests_running", "kvinfer_num_requests_waiting", "kvinfer_kv_blocks_used",
                 "kvinfer_kv_blocks_total", "kvinfer_prefix_cache_hit_rate", "kvinfer_num_preemptions_total",
                 "kvinfer_prompt_tokens_total", "kvinfer_generation_tokens_total",
                 "kvinfer_time_to_first_token_seconds_count", "kvinfer_inter_token_latency_seconds_count"):
        assert name in m.text, name
    assert metric(m.text, "kvinfer_kv_blocks_total") > 0


def test_32_concurrent_streams_equal_offline_generate(srv):
    from kvinfer.engine.llm import LLM

    prompts = [f"Write one sentence about {t}." for t in TOPICS]
    assert len(prompts) == 32

    async def one(c, prompt):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        text, finish = [], None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                ch = json.loads(line[6:])["choices"][0]
                text.append(ch["text"])
                finish = ch["finish_reason"] or finish
        return "".join(text), finish

    async def all_of_them():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])

    served = asyncio.run(all_of_them())
    llm = LLM(config=srv.engine.config)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    del llm
    assert [t for t, _ in served] == [o.outputs[0].text for o in offline]
    assert [f for _, f in served] == [o.outputs[0].finish_reason for o in offline]


def test_abandoned_requests_are_aborted_and_free_their_blocks(srv, client):
    async def give_up(c, i):
        body = {"prompt": f"Tell me a long story about {TOPICS[i % 32]}, number {i}.", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
        try:
            async with asyncio.timeout(0.5):  # the whole request, not each read
                if body["stream"]:
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
                else:
                    await c.post("/v1/completions", json=body)
        except (TimeoutError, httpx.TimeoutException):
            return "gave up"
        return "finished"

    async def hundred():
        # A client per request so that giving up closes that request's connection.
        clients = [httpx.AsyncClient(base_url=srv.url, timeout=5) for _ in range(100)]
        try:
            return await asyncio.gather(*[give_up(c, i) for i, c in enumerate(clients)])
        finally:
            await asyncio.gather(*[c.aclose() for c in clients])

    results = asyncio.run(hundred())
    assert results.count("gave up") == 100
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    text = _wait_kv_free(client, timeout=120)
    assert metric(text, "kvinfer_kv_blocks_total") > 0
    # Aborted, not run to the end in the background: far fewer tokens than 100 x 400 were generated.
    assert metric(text, "kvinfer_generation_tokens_total") < 100 * 400 / 4
    assert client.get("/health").json() == {"status": "ok"}


BAD_COMPLETIONS = [
    ("malformed json", b'{"prompt": "hi", ', 400, None),
    ("not an object", b'["hi"]', 400, None),
    ("missing prompt", b'{"max_tokens": 4}', 400, "prompt"),
    ("prompt wrong type", b'{"prompt": 5}', 400, "prompt"),
    ("max_tokens wrong type", b'{"prompt": "hi", "max_tokens": "four"}', 400, "max_tokens"),
    ("negative max_tokens", b'{"prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
    ("temperature below 0", b'{"prompt": "hi", "temperature": -0.5}', 400, "temperature"),
    ("top_p above 1", b'{"prompt": "hi", "top_p": 1.5}', 400, "top_p"),
    ("n over the limit", json.dumps({"prompt": "hi", "n": MAX_N + 1}).encode(), 400, "n"),
    ("logprobs over the limit", json.dumps({"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}).encode(), 400, "logprobs"),
    ("prompt over the context window", json.dumps({"prompt": "hello " * 1500}).encode(), 400, "prompt"),
    ("prompt + max_tokens over the window", json.dumps({"prompt": "hi", "max_tokens": 5000}).encode(), 400,
     "max_tokens"),
    ("token id outside the vocabulary", b'{"prompt": [1, 2, 99999999]}', 400, "prompt"),
    ("empty token list", b'{"prompt": []}', 400, "prompt"),
    ("empty token list among prompts", b'{"prompt": [[5, 6], []]}', 400, "prompt"),
    ("empty stop string", b'{"prompt": "hi", "stop": [""]}', 400, "stop"),
    ("NaN temperature", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("stop token id outside the vocabulary", b'{"prompt": "hi", "stop_token_ids": [99999999], "min_tokens": 1}',
     400, "stop_token_ids"),
    ("more sequences than the server holds", json.dumps({"prompt": ["hi"] * 40, "n": 16}).encode(), 400, "prompt"),
    ("unknown model", b'{"prompt": "hi", "model": "gpt-17"}', 404, "model"),
]

BAD_CHATS = [
    ("empty messages", b'{"messages": []}', 400, "messages"),
    ("unknown role", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages[0].role"),
    ("content wrong type", b'{"messages": [{"role": "user", "content": 7}]}', 400, "messages[0].content"),
    ("image part", b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}', 400,
     "messages[0].content"),
    ("top_logprobs without logprobs", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', 400,
     "top_logprobs"),
    ("chat prompt over the context window",
     json.dumps({"messages": [{"role": "user", "content": "hello " * 1500}]}).encode(), 400, "prompt"),
    ("continue_final_message with a generation prompt",
     b'{"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true}', 400,
     "continue_final_message"),
    ("chat_template_kwargs setting the messages",
     b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}', 400,
     "chat_template_kwargs"),
    ("chat_template_kwargs not an object",
     b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["x"]}', 400,
     "chat_template_kwargs"),
]


@pytest.mark.parametrize("route,name,body,status,param",
                         [("/v1/completions",) + c for c in BAD_COMPLETIONS]
                         + [("/v1/chat/completions",) + c for c in BAD_CHATS],
                         ids=[c[0] for c in BAD_COMPLETIONS] + [c[0] for c in BAD_CHATS])
def test_bad_requests_get_4xx_in_openai_shape(client, route, name, body, status, param):
    r = client.post(route, content=body, headers={"content-type": "application/json"})
    assert_error_shape(r, status, param)
    # The same mistake while streaming is refused before any event is sent.
    if body.startswith(b"{") and status == 400 and name not in ("malformed json",):
        streamed = json.loads(body.replace(b"NaN", b"0.5")) if b"NaN" not in body else None
        if streamed is not None:
            streamed["stream"] = True
            r2 = client.post(route, json=streamed)
            assert r2.status_code == 400 and r2.headers["content-type"].startswith("application/json")
    assert client.get("/health").json() == {"status": "ok"}


def test_unknown_routes_and_methods(client):
    assert_error_shape(client.get("/v1/nothing"), 404)
    assert_error_shape(client.get("/v1/completions"), 405)
    assert client.get("/health").status_code == 200


def test_unknown_fields_are_ignored(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                             "logit_bias": {"1": 5}, "frobnicate": True, "user": "me"})
    assert r.status_code == 200, r.text


def test_api_key_guards_v1_routes(srv):
    keyed = start_server(engine=srv.engine, api_key="s3cret")
    try:
        with httpx.Client(base_url=keyed.url, timeout=30) as c:
            body = {"prompt": "Hi", "max_tokens": 2}
            assert_error_shape(c.post("/v1/completions", json=body), 401)
            assert_error_shape(c.get("/v1/models"), 401)
            assert_error_shape(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
            assert_error_shape(c.post("/v1/completions", content=b"{bad", headers={"Authorization": "Bearer x"}), 401)
            assert_error_shape(c.post("/tokenize", json={"prompt": "x"}), 401)
            ok = {"Authorization": "Bearer s3cret"}
            assert c.get("/v1/models", headers=ok).status_code == 200
            assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
            assert c.get("/health").status_code == 200  # probes and scrapers need no key
            assert c.get("/metrics").status_code == 200
    finally:
        keyed.stop()


def test_body_size_limit(srv):
    small = start_server(engine=srv.engine, max_body_bytes=2000)
    try:
        with httpx.Client(base_url=small.url, timeout=30) as c:
            big = json.dumps({"prompt": "x" * 5000}).encode()
            assert_error_shape(c.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                               413)

            def chunks():  # no Content-Length: the limit must hold while the body streams in
                for i in range(0, len(big), 500):
                    yield big[i:i + 500]

            assert_error_shape(c.post("/v1/completions", content=chunks(),
                                      headers={"content-type": "application/json"}), 413)
            assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        small.stop()


def test_queue_full_gets_429(srv):
    from kvinfer.engine.llm_engine import LLMEngine

    shared = srv.engine.engine.loaded
    eng = AsyncLLMEngine(LLMEngine(srv.engine.config.replace(max_num_seqs=1, kv_cache_memory=32 << 20), shared),
                         max_queue=0)
    busy = start_server(engine=eng)
    busy.owns_engine = True
    try:
        with httpx.Client(base_url=busy.url, timeout=60) as c:
            long_body = {"prompt": "Count to one hundred.", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=long_body) as first:
                assert first.status_code == 200
                r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                err = assert_error_shape(r, 429)
                assert err["type"] == "rate_limit_error"
            # The first stream was closed early: its slot frees and new requests get in again.
            deadline = time.monotonic() + 15
            while True:
                r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert r.status_code == 200, r.text
    finally:
        busy.stop()


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 1024
    back = client.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"].strip().endswith("Hello world")
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > r["count"]
    assert_error_shape(client.post("/tokenize", json={}), 400, "prompt")
    started = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    cont = client.post("/tokenize", json={"messages": started, "add_generation_prompt": False,
                                          "continue_final_message": True}).json()
    text = client.post("/detokenize", json={"tokens": cont["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nHello, I am")
    assert_error_shape(client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error_shape(client.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_metrics_count_traffic(client):
    before = client.get("/metrics").text
    r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200
    after = client.get("/metrics").text
    assert metric(after, "kvinfer_generation_tokens_total") >= metric(before, "kvinfer_generation_tokens_total") + 5
    assert metric(after, "kvinfer_prompt_tokens_total") > metric(before, "kvinfer_prompt_tokens_total") - 1
    assert metric(after, "kvinfer_time_to_first_token_seconds_count") > \
        metric(before, "kvinfer_time_to_first_token_seconds_count")
    assert metric(after, "kvinfer_inter_token_latency_seconds_count") >= \
        metric(before, "kvinfer_inter_token_latency_seconds_count") + 4
    assert 0.0 <= metric(after, "kvinfer_prefix_cache_hit_rate") <= 1.0


def test_metrics_count_exactly_the_tokens_kept_after_stop_strings(client):
    """Stop strings are found on the event loop, after the core made more tokens: those are uncounted before
    the response goes out, so /metrics equals the usage the client saw."""
    before = metric(_wait_kv_free(client), "kvinfer_generation_tokens_total")
    r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 16, "n": 2, "seed": 7,
                                             "temperature": 0.8, "stop": ["e"], "ignore_eos": True})
    assert r.status_code == 200
    reasons, counted = [c["finish_reason"] for c in r.json()["choices"]], r.json()["usage"]["completion_tokens"]
    body = {"messages": [{"role": "user", "content": "Say hello to the sea."}], "max_tokens": 16, "temperature": 0,
            "stop": [" "], "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    reasons += [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    counted += chunks[-1]["usage"]["completion_tokens"]
    assert reasons.count("stop") >= 2, reasons
    assert metric(client.get("/metrics").text, "kvinfer_generation_tokens_total") - before == counted


async def asyncio_timeout_iter(stream, seconds):
    async with asyncio.timeout(seconds):  # a stream that never ended would hang the suite
        async for o in stream:
            yield o


def test_async_engine_api(srv, client):
    aeng = srv.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run():
        stream = await aeng.add_request(None, "The sky is", params)
        outs = [o async for o in stream]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
        assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == 6
        final = await aeng.generate("The sky is", params)
        assert final.outputs[0].token_ids == outs[-1].outputs[0].token_ids

        # Abort mid-stream: the stream ends and the engine forgets the request.
        stream = await aeng.add_request("abort-me", "Tell me a story.",
                                        SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        async for o in stream:
            if o.outputs[0].token_ids:
                stream.abort()
        assert stream.closed
        # Abort by id (as another task or thread would): the stream still ends.
        stream = await aeng.add_request("abort-by-id", "Tell me a story.",
                                        SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        n = 0
        async for o in asyncio_timeout_iter(stream, 60):
            n += 1
            aeng.abort("abort-by-id")
        assert stream.closed and stream.finished and n >= 1

        with pytest.raises(ValidationError) as e:
            await aeng.add_request(None, [1, 2, 10 ** 9], params)
        assert e.value.param == "prompt"
        with pytest.raises(RequestTooLargeError):
            await aeng.add_request(None, list(range(100, 1200)), params)
        # Several prompts on one stream, all or nothing.
        with pytest.raises(RequestTooLargeError):
            await aeng.add_requests([(None, "ok", params), (None, list(range(100, 1200)), params)])
        stream = await aeng.add_requests([(None, "A", params), (None, "B", params)])
        finals = {o.request_id for o in [o async for o in stream] if o.finished}
        assert finals == set(stream.request_ids)

    asyncio.run(run())
    _wait_kv_free(client)
    st = aeng.stats()
    assert st.kv_blocks_total > 0 and st.generation_tokens > 0 and st.steps > 0


def test_async_engine_queue_limit_and_shutdown(srv):
    from kvinfer.engine.llm_engine import LLMEngine

    eng = AsyncLLMEngine(LLMEngine(srv.engine.config.replace(max_num_seqs=1, kv_cache_memory=32 << 20),
                                   srv.engine.engine.loaded), max_queue=1)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def run():
        a = await eng.add_request(None, "one", params)
        b = await eng.add_request(None, "two", params)
        with pytest.raises(QueueFullError):
            await eng.add_request(None, "three", params)
        eng.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in a:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request(None, "four", params)
        b.abort()

    asyncio.run(run())
    assert not eng.is_running


def test_serve_cli_registers_without_torch():
    code = ("import sys, argparse; import kvinfer.server.cli as c; p = argparse.ArgumentParser(); "
            "s = p.add_subparsers(); c.register(s); a = p.parse_args(['serve', '--port', '0', '--api-key', 'k']); "
            "assert a.host == '127.0.0.1' and a.api_key == 'k' and a.max_queue >= 1; "
            "assert 'torch' not in sys.modules, 'register imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "kvinfer.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--max-body-bytes" in out.stdout and "--served-model-name" in out.stdout


def test_a_failing_step_aborts_its_requests_and_the_server_goes_on(srv, client):
    eng = srv.engine.engine
    real_step = eng.step_core

    def broken_step():
        eng.step_core = real_step  # fail once
        raise RuntimeError("injected failure")

    eng.step_core = broken_step
    try:
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        err = assert_error_shape(r, 500)
        assert err["type"] == "server_error" and "injected failure" in err["message"]
    finally:
        eng.step_core = real_step
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
    _wait_kv_free(client)


def test_kvinfer_serve_command_serves_and_stops():
    import os
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvinfer.cli", "serve", "--port", str(port), "--api-key", "k",
           "--served-model-name", "smol", "--max-model-len", "256", "--kv-cache-memory", "32MiB"]
    if os.environ.get("KVINFER_TEST_SERVER_MODEL"):
        cmd += ["--model", os.environ["KVINFER_TEST_SERVER_MODEL"]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvinfer serve did not come up"
            time.sleep(0.25)
        auth = {"Authorization": "Bearer k"}
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == "smol" and models["data"][0]["max_model_len"] == 256
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=auth, timeout=60,
                       json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stdout.read()
