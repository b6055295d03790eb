"""The web page of `kvinfer serve` in headless Chromium, and the /kv/state snapshot it draws."""
from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvinfer.config import EngineConfig
from kvinfer.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvinfer.engine.kv_state import CACHED_FREE, FREE, OWNED, SHARED, kv_state
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.sampling_params import SamplingParams
from kvinfer.server.page import PageState
from server_helpers import assert_error_shape, engine_config, start_server

CHROMIUM = os.environ.get("KVINFER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run"]
# Set to a path (e.g. docs/kv_page.png) to keep the screenshot the README shows.
SCREENSHOT = os.environ.get("KVINFER_PAGE_SCREENSHOT")
WAIT_MS = 120_000  # a shared 2-core machine can be slow; every wait below ends as soon as its condition holds


# ---- the snapshot itself, without HTTP or a browser ----------------------------------------------------
def _check_snapshot(s: dict) -> None:
    """What any paged snapshot must satisfy: counts agree with the map, owners agree with block tables."""
    st, owner, refs = s["blocks"]["state"], s["blocks"]["owner"], s["blocks"]["refs"]
    assert len(st) == len(owner) == len(refs) == s["num_blocks"]
    assert s["blocks_used"] == sum(x in (OWNED, SHARED) for x in st)
    holders = {}
    for i, q in enumerate(s["seqs"]):
        for b in q["block_table"]:
            holders.setdefault(b, []).append(i)
    for b in range(s["num_blocks"]):
        assert refs[b] == len(holders.get(b, [])), b
        assert owner[b] == (holders[b][0] if b in holders else -1), b
        assert (st[b] == SHARED) == (refs[b] > 1) and (st[b] == OWNED) == (refs[b] == 1), b


def test_kv_state_follows_blocks_prefix_sharing_and_release(tiny_llama_dir):
    eng = LLMEngine(EngineConfig(model=tiny_llama_dir, kv_cache_memory=1 << 20, block_size=4, max_model_len=256))
    common = list(range(10, 30))  # 5 full blocks the second request finds in the prefix cache
    eng.add_request("a", common + [40, 41], SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()
    eng.add_request("b", common + [50], SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()
    s = kv_state(eng)
    _check_snapshot(s)
    a, b = s["seqs"]
    assert (a["id"], b["id"]) == ("a", "b") and a["status"] == b["status"] == "running"
    assert b["cached_tokens"] == 20 and b["block_table"][:5] == a["block_table"][:5]
    assert s["blocks"]["state"][a["block_table"][0]] == SHARED and s["blocks"]["owner"][a["block_table"][0]] == 0
    assert s["blocks_shared"] == 5 and s["prefix_cache"]["hits"] == 5 and s["requests"]["running"] == 2
    assert s["tokens_logical"] == a["computed_tokens"] + b["computed_tokens"] == 23 + 21
    assert s["tokens_stored"] == 23 + 21 - 20 == sum(s["blocks"]["fill"])  # the shared 20 are held once
    assert s["blocks"]["fill"][a["block_table"][-1]] == 3 and s["tokens_allocated"] == s["blocks_used"] * 4
    assert s["bytes_per_token"] == eng.kv_bytes_per_token and s["capacity_tokens"] == s["num_blocks"] * 4
    assert "prompt" not in a  # the engine never hands out prompt text
    while eng.has_unfinished_requests():
        eng.step()
    s = kv_state(eng)
    _check_snapshot(s)
    assert s["blocks_used"] == 0 and not s["seqs"] and s["generation_tokens"] == 12
    assert s["blocks_cached_free"] > 0 and set(s["blocks"]["state"]) <= {FREE, CACHED_FREE}


def test_kv_state_contiguous_slots(tiny_llama_dir):
    eng = LLMEngine(EngineConfig(model=tiny_llama_dir, kv_cache="contiguous", kv_cache_memory=1 << 20,
                                 max_model_len=128, max_num_seqs=3))
    eng.add_request("a", list(range(10, 17)), SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    s = kv_state(eng)
    assert s["backend"] == "contiguous" and "blocks" not in s and s["num_blocks"] == 3
    used = [x for x in s["slots"] if x["owner"] >= 0]
    assert len(used) == 1 and used[0]["used_tokens"] == 7 and used[0]["reserved_tokens"] == 128
    assert s["seqs"][0]["slot"] == used[0]["slot"] and s["tokens_allocated"] == 128
    none = LLMEngine(EngineConfig(model=tiny_llama_dir, kv_cache="none", max_model_len=128))
    none.add_request("a", [10, 11, 12], SamplingParams(max_tokens=3))
    none.step()
    s = kv_state(none)
    assert (s["backend"], s["num_blocks"], s["capacity_tokens"]) == ("none", 0, 0) and s["seqs"][0]["id"] == "a"


def test_tokens_per_second_meter():
    m = PageState()
    assert m.tokens_per_s(100.0, 50) is None  # one reading says nothing about a rate
    assert m.tokens_per_s(100.5, 60) == pytest.approx(20.0)
    assert m.tokens_per_s(101.0, 80) == pytest.approx(30.0)
    for t in range(2, 10):  # readings older than the window drop out: an idle server falls back to zero
        m.tokens_per_s(100.0 + t, 80)
    assert m.tokens_per_s(110.0, 80) == 0.0


def test_engine_call_runs_on_the_engine_thread_and_fails_after_shutdown(tiny_llama_dir):
    import asyncio
    import threading

    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama_dir, kv_cache_memory=1 << 20)))

    async def run():
        name = await eng.call(lambda e: threading.current_thread().name)
        assert name == "kvinfer-engine"
        with pytest.raises(ZeroDivisionError):
            await eng.call(lambda e: 1 / 0)
        assert (await eng.call(kv_state))["blocks_used"] == 0  # a failed call leaves the engine serving
        eng.shutdown()
        with pytest.raises(EngineDeadError):
            await eng.call(kv_state)

    asyncio.run(run())


# ---- the server side of the page --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv():
    s = start_server(engine_config())
    yield s
    s.stop()


def _wait_idle(c: httpx.Client, headers=None) -> dict:
    deadline = time.monotonic() + WAIT_MS / 1000
    while True:
        s = c.get("/kv/state", headers=headers).json()
        if s["blocks_used"] == 0 and not s["seqs"]:
            return s
        assert time.monotonic() < deadline, "KV blocks still in use"
        time.sleep(0.1)


def test_state_shows_prompt_text_only_of_page_requests(srv):
    chat = {"messages": [{"role": "user", "content": "SECRET-API prompt"}], "max_tokens": 64, "ignore_eos": True,
            "temperature": 0}
    mine = {**chat, "messages": [{"role": "user", "content": "from the page"}]}
    with httpx.Client(base_url=srv.url, timeout=120) as c, ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(c.post, "/v1/chat/completions", json=chat),
                pool.submit(c.post, "/v1/chat/completions", json=mine, headers={"X-Kvinfer-Page": "1"})]
        deadline = time.monotonic() + WAIT_MS / 1000
        while True:
            s = c.get("/kv/state").json()
            if len(s["seqs"]) == 2 and all(q["status"] == "running" for q in s["seqs"]):
                break
            assert time.monotonic() < deadline and not all(j.done() for j in jobs), s
            time.sleep(0.05)
        _check_snapshot(s)
        assert "SECRET" not in str(s)
        assert sorted(q["source"] for q in s["seqs"]) == ["api", "page"]
        assert [q["prompt"] for q in s["seqs"] if q["source"] == "page"] == ["from the page"]
        assert s["model"] == srv.model_name and s["backend"] == "paged"
        for j in jobs:
            assert j.result().status_code == 200
        _wait_idle(c)


def test_page_files_and_headers(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            r = c.get(f"/static/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert_error_shape(c.get("/static/nothing.js"), 404)
        assert_error_shape(c.get("/static/..%2Fpage.py"), 404)
        assert "/kv/state" not in c.get("/openapi.json").json()["paths"]


# ---- in a real browser ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: `make test` installs it with apt-get (Debian package 'chromium'); "
                    "install it by hand or point KVINFER_CHROMIUM at a Chromium binary")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[test]'")
    pw = sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
    yield b
    b.close()
    pw.stop()


@pytest.fixture()
def page(browser):
    ctx = browser.new_context(viewport={"width": 1440, "height": 900})
    p = ctx.new_page()
    p.set_default_timeout(WAIT_MS)
    errors = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    # Console errors include Content-Security-Policy violations; refused requests (401, 400) are expected ones.
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" and "Failed to load resource" not in m.text
         else None)
    yield p
    ctx.close()
    assert not errors, errors


class _Streams:
    """Streaming completions from threads that run until the test has looked at them, then hang up (the server
    aborts them and frees their blocks): a fast machine cannot finish them before the page is checked."""

    def __init__(self, url: str, prompts: list, max_tokens: int = 400):
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(len(prompts))

    def _one(self, prompt) -> int:
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        chunks = 0
        with httpx.Client(base_url=self.url, timeout=300) as c, c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if self.stop.is_set():
                    break
        return chunks

    def __enter__(self):
        self.jobs = [self.pool.submit(self._one, p) for p in self.prompts]
        return self

    def __exit__(self, *exc):
        self.stop.set()
        chunks = [j.result() for j in self.jobs]
        self.pool.shutdown()
        assert exc[0] is not None or all(n > 0 for n in chunks), chunks


def _wait(page, predicate: str, arg=None) -> None:
    """Poll a JS function until it returns true. Playwright's wait_for_function evaluates strings with eval(),
    which the page's Content-Security-Policy forbids; evaluate() goes through the debugger protocol instead."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while not page.evaluate(predicate, arg):
        assert time.monotonic() < deadline, f"timed out waiting for {predicate}"
        time.sleep(0.05)


def _ask(page, text: str) -> str:
    """Send one message from the page; the finished answer's text."""
    before = page.locator(".msg.assistant").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    answer = page.locator(".msg.assistant").nth(before)
    answer.wait_for()
    _wait(page, "n => document.querySelectorAll('.msg.assistant')[n].matches(':not(.streaming)')", before)
    return answer.locator(".text").inner_text()


def test_page_chat_and_live_kv_map(srv, page, tmp_path):
    page.goto(srv.url)
    page.wait_for_selector("#conn.on")
    assert page.inner_text("#model") == srv.model_name
    assert page.locator("#tiers-box").is_hidden()  # no tiers below this server's pool
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    assert "Paris" in _ask(page, "What is the capital of France?")
    assert page.locator(".msg.user .text").inner_text() == "What is the capital of France?"
    assert "tokens" in page.locator(".msg.assistant .meta").inner_text()  # usage arrived with the stream

    # 8 requests through the API: their blocks appear in the map, each request in its own colour.
    # A common opening of two full blocks: the prefix cache shares them between the 8.
    common = ("You are a careful storyteller. Write vivid, well structured stories with a clear beginning, a middle "
              "and an end, and give every character a name and a voice of their own.")
    prompts = [f"{common} Now write a long story about {t}." for t in ("the sea", "bread", "a cat", "winter", "music",
                                                                     "trains", "the moon", "coffee")]
    with _Streams(srv.url, prompts):
        _wait(page, "() => document.querySelectorAll('#seqs .seq.running').length === 8")
        seen = page.evaluate("""() => {
            const cells = [...document.querySelectorAll('#map .cell')];
            const used = cells.filter(c => c.classList.contains('s2') || c.classList.contains('s3'));
            return {cells: cells.length, used: used.length, owners: new Set(used.map(c => c.dataset.owner)).size,
                    shared: cells.filter(c => c.classList.contains('s3')).length,
                    stat: Number(document.getElementById('st-blocks').dataset.used),
                    reqs: document.getElementById('st-reqs').textContent,
                    colours: new Set(used.map(c => c.style.backgroundColor)).size}; }""")
        assert seen["cells"] == srv.engine.engine.kv_manager.num_total_blocks
        assert seen["used"] == seen["stat"] > 0 and seen["owners"] == 8 and seen["colours"] >= 6, seen
        assert seen["reqs"].startswith("8 /") and seen["shared"] >= 2, seen

        # Hovering a request shows its block table and lights up exactly its blocks.
        row = page.locator("#seqs .seq.running").first
        rid = row.get_attribute("data-id")
        row.hover()
        page.wait_for_selector("#detail dl")
        assert "block table" in page.inner_text("#detail")
        lit = page.evaluate("[...document.querySelectorAll('#map .cell.hl')].map(c => c.dataset.owner)")
        assert lit and set(lit) == {rid}
        shot = tmp_path / "kv_page.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        if SCREENSHOT:
            shutil.copyfile(shot, SCREENSHOT)
    # ...and the map empties once they end (their blocks stay findable as cached prefixes).
    _wait(page, "() => document.getElementById('st-blocks').dataset.used === '0'")
    assert page.locator("#map .cell.s2, #map .cell.s3").count() == 0
    assert page.locator("#map .cell.s1").count() > 0
    assert page.inner_text("#seqs") == "none"

    # Stop: the answer ends where it is and the server frees the request's blocks.
    page.fill("#max-tokens", "400")
    page.fill("#input", "Tell me everything about the history of Rome.")
    page.press("#input", "Enter")
    _wait(page, "() => document.getElementById('seqs').textContent.includes('(this page)')")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant:nth-child(4):not(.streaming)")
    assert page.locator(".msg.assistant .meta").last.inner_text() == "stopped"
    _wait(page, "() => document.getElementById('st-blocks').dataset.used === '0'")
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0

    # A request the server refuses shows its one-line error in place of an answer.
    page.fill("#max-tokens", "999999")
    assert _ask(page, "Hello") == ""
    assert "error:" in page.locator(".msg.assistant .meta").inner_text() and "max_tokens" in \
        page.locator(".msg.assistant .meta").inner_text()


def test_model_output_is_shown_as_text(srv, page):
    page.goto(srv.url)
    page.wait_for_selector("#conn.on")
    page.click("#system-box summary")
    page.fill("#system", "Repeat the user's message exactly, with no other words.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "16")
    attack = "<script>document.title='pwned'</script>"
    answer = _ask(page, attack)
    assert answer.startswith(attack)  # the model echoed the tag (greedy), and it reads as text
    assert page.title() == "kvinfer"
    assert page.locator("#messages script").count() == 0
    assert page.locator(".msg.user .text").inner_text() == attack


def test_page_asks_for_the_api_key_and_shows_no_data_without_it(srv, page):
    keyed = start_server(engine=srv.engine, api_key="s3cret")
    try:
        states = []
        page.on("response", lambda r: states.append(r.status) if "/kv/state" in r.url else None)
        page.goto(keyed.url)
        page.wait_for_selector("#auth-form", state="visible")
        assert page.locator("#app").is_hidden() and page.locator("#map .cell").count() == 0
        assert page.inner_text("#st-blocks") == "–" and 200 not in states
        with httpx.Client(base_url=keyed.url, timeout=30) as c:
            assert_error_shape(c.get("/kv/state"), 401)
            assert c.get("/").status_code == 200  # the page itself holds no data
        assert page.locator("#app").is_hidden()
        page.fill("#auth-key", "wrong")
        page.press("#auth-key", "Enter")
        _wait(page, "() => document.getElementById('auth-error').textContent.includes('invalid API key')")
        assert page.locator("#app").is_hidden()
        page.fill("#auth-key", "s3cret")
        page.press("#auth-key", "Enter")
        page.wait_for_selector("#conn.on")
        assert page.locator("#map .cell").count() == srv.engine.engine.kv_manager.num_total_blocks
        assert 200 in states
    finally:
        keyed.stop()


def test_contiguous_page_shows_reserved_slots(page):
    s = start_server(engine_config(kv_cache="contiguous", max_model_len=256, max_num_seqs=4, kv_cache_memory=64 << 20))
    try:
        page.goto(s.url)
        page.wait_for_selector("#conn.on")
        assert page.locator("#map-box").is_hidden() and page.locator("#slots .slot").count() == 4
        with _Streams(s.url, ["Once upon a time"], max_tokens=200):
            page.wait_for_selector("#slots .slot[data-owner]")
            text = page.inner_text("#slots .slot[data-owner] .slot-text")
            assert "of 256 tokens used" in text and "reserved unused" in text
        _wait(page, "() => document.querySelectorAll('#slots .slot[data-owner]').length === 0")
    finally:
        s.stop()


def _tier_metric(text: str, name: str, tier: str) -> int:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'tier="{tier}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"{name} for tier {tier} missing from /metrics")


def test_page_shows_the_kv_tiers(page, tmp_path):
    """Each tier below the pool gets a row with what /metrics says of it: blocks held, hits, misses, errors."""
    # A pool of about 11 blocks: the second prompt evicts the first one's tail into the RAM tier, and the first
    # prompt asked again takes it back from there. Every full block is also written to the disk tier.
    s = start_server(engine_config(max_model_len=128, kv_cache_memory=4 << 20, kv_offload_memory="64MiB",
                                   kv_cache_dir=str(tmp_path / "kv")))
    try:
        with httpx.Client(base_url=s.url, timeout=300) as c:
            a, b = list(range(1000, 1100)), list(range(2000, 2100))
            for ids in (a, b, a):
                r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
            s.engine.engine.kv_tiers.flush()  # the disk writes done: nothing changes the counters from here on
            metrics = c.get("/metrics").text
        page.goto(s.url)
        page.wait_for_selector("#conn.on")
        page.wait_for_selector("#tiers-box", state="visible")
        rows = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#tiers tbody tr')].map(
            tr => [tr.dataset.tier, Object.fromEntries([...tr.cells].map(td => [td.classList[0], td.textContent]))]))""")
        assert list(rows) == ["ram", "disk"]
        for tier, row in rows.items():
            for field in ("hits", "misses", "errors", "evictions"):
                assert row[field] == f"{_tier_metric(metrics, f'kvinfer_kv_tier_{field}_total', tier):,}", (tier, row)
            assert row["blocks"] == f"{_tier_metric(metrics, 'kvinfer_kv_tier_blocks', tier):,}", (tier, row)
        assert _tier_metric(metrics, "kvinfer_kv_tier_hits_total", "ram") > 0  # the first prompt's tail came back
        assert _tier_metric(metrics, "kvinfer_kv_tier_blocks", "disk") >= 12 and rows["ram"]["blocks"] != "0"
        assert rows["ram"]["bytes"].endswith("MiB") or rows["ram"]["bytes"].endswith("KiB")
    finally:
        s.stop()
