"""One path for a request: input processing once, on the caller's side; the engine core takes token ids."""
from __future__ import annotations

import asyncio
import threading

import pytest

from kvinfer import SamplingParams
from kvinfer.config import EngineConfig
from kvinfer.engine.async_engine import AsyncLLMEngine
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.errors import RequestTooLargeError, ValidationError


class _ByteTokenizer:
    """Text to byte ids, recording the thread each call ran on (the tiny test model has no tokenizer)."""

    def __init__(self):
        self.threads = []

    def encode(self, text):
        self.threads.append(threading.current_thread().name)
        return [3 + b % 250 for b in text.encode()]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # 64 tokens of KV (blocks of 4) under a 1024-token window: the KV capacity bounds max_tokens, not the window.
    return LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", block_size=4, max_model_len=1024,
                                  kv_cache_memory=32 << 10))


def test_input_is_completed_and_checked_once_before_the_core(engine, monkeypatch):
    proc = engine.processor
    cap = engine.kv_manager.token_capacity
    assert cap < engine.max_model_len
    req = proc.process(None, [5, 6, 7], SamplingParams(max_tokens=None))
    assert req.params.max_tokens == cap - 3 and req.prompt_token_ids == [5, 6, 7]
    for params, err, param in ((SamplingParams(stop_token_ids=[256]), ValidationError, "stop_token_ids"),
                               (SamplingParams(logit_bias={300: 1.0}), ValidationError, "logit_bias"),
                               (SamplingParams(max_tokens=cap), RequestTooLargeError, "max_tokens")):
        with pytest.raises(err) as e:
            engine.add_request(None, [5, 6, 7], params)
        assert e.value.param == param
    with pytest.raises(ValidationError, match="no tokenizer") as e:  # text needs a tokenizer; this model has none
        engine.add_request(None, "hi", SamplingParams(max_tokens=4))
    assert e.value.param == "prompt"
    assert not engine.has_unfinished_requests() and not engine.scheduler.num_unfinished
    calls = []
    check = engine.scheduler.check_fits
    monkeypatch.setattr(engine.scheduler, "check_fits", lambda *a: (calls.append(a), check(*a)))
    monkeypatch.setattr(proc, "tokenizer", _ByteTokenizer())
    rid = engine.add_request(None, "hi", SamplingParams(n=2, max_tokens=4, temperature=0, ignore_eos=True))
    assert calls == [(2, 4)] and len(proc.tokenizer.threads) == 1  # once for the group, not per sample or layer
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.request_id == rid and final.prompt == "hi" and [len(c.token_ids) for c in final.outputs] == [4, 4]


def test_async_engine_tokenizes_on_the_callers_thread(engine, monkeypatch):
    tok = _ByteTokenizer()
    monkeypatch.setattr(engine.processor, "tokenizer", tok)
    core = []
    add = engine.add_processed
    monkeypatch.setattr(engine, "add_processed",
                        lambda req: (core.append((threading.current_thread().name, req.prompt_token_ids)),
                                     add(req))[1])
    aeng = AsyncLLMEngine(engine)
    try:
        async def go():
            out = await aeng.generate("hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            with pytest.raises(ValidationError):  # refused on the loop; nothing reaches the engine thread
                await aeng.add_request(None, "x", SamplingParams(stop_token_ids=[999]))
            return out

        out = asyncio.run(go())
    finally:
        aeng.shutdown()
    here = threading.current_thread().name
    assert tok.threads == [here, here]
    assert core == [("kvinfer-engine", [3 + b for b in b"hello"])]
    assert out.finished and len(out.outputs[0].token_ids) == 3


# ---- output processing after the core --------------------------------------------------------------------
class _CharTokenizer:
    """Decodes each id to its own CJK character, so a stop string is one known token (the tiny model has none)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + i) for i in ids)


def _offline(engine, prompt, params):
    """The final output of one request through LLMEngine.step (output processing inline)."""
    rid, final = engine.add_request(None, prompt, params), None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    return final


def _by_hand(aeng):
    """The engine thread's command handling, run here: each call is one point of the interleaving."""
    for cmd in aeng._take_commands(block=False):
        aeng._handle(cmd)


def _manual(engine, monkeypatch):
    """An AsyncLLMEngine without its thread: the test takes the engine thread's part (`_by_hand`, `_step`)."""
    aeng = AsyncLLMEngine(engine, start=False)
    monkeypatch.setattr(aeng, "tokenizer", _CharTokenizer())
    monkeypatch.setattr(AsyncLLMEngine, "is_running", property(lambda self: True))
    return aeng


async def _add_by_hand(aeng, request_id, prompt, params):
    adding = asyncio.ensure_future(aeng.add_request(request_id, prompt, params))
    await asyncio.sleep(0)  # the add command is queued
    _by_hand(aeng)
    return await adding


def test_a_stop_string_found_after_the_core_finished_by_length_is_uncounted(engine, monkeypatch):
    prompt = [5, 6, 7]
    ids = _offline(engine, prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)).outputs[0].token_ids
    k = max(j for j in range(6) if ids[j] not in ids[:j])  # token k is the first to decode to its character
    stop = chr(0x4E00 + ids[k])
    # One token past the stop: the core finishes by length while the stop string is still unseen on the loop.
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=k + 2, stop=[stop])
    aeng = _manual(engine, monkeypatch)

    async def go():
        before = engine.stats["generation_tokens"]
        stream = await _add_by_hand(aeng, "race", prompt, params)
        while engine.has_work():
            aeng._step()  # the loop sees none of these outputs yet
        made = engine.stats["generation_tokens"] - before
        assert engine.groups["race"].reqs[0].finish_reason == "length"  # finished, and still there
        await asyncio.sleep(0)  # the loop processes the outputs, finds the stop string, sends stop + retire
        assert not any(o.finished for o in stream._pending)  # the final waits for the core's correction
        _by_hand(aeng)
        outs = [o async for o in stream]
        return made, engine.stats["generation_tokens"] - before, aeng.stats().generation_tokens - before, outs

    made, counted, shown, outs = asyncio.run(go())
    final = outs[-1].outputs[0]
    assert made == k + 2 and counted == shown == k + 1
    assert final.token_ids == ids[:k + 1] and final.text == "".join(chr(0x4E00 + t) for t in ids[:k])
    assert (final.finish_reason, final.stop_reason, outs[-1].finished) == ("stop", stop, True)
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert not engine.groups and not aeng._streams
    assert engine.kv_manager.num_free_units == engine.kv_manager.num_units


def _run_async(engine, monkeypatch, fn):
    aeng = AsyncLLMEngine(engine)
    monkeypatch.setattr(aeng, "tokenizer", _CharTokenizer())
    try:
        return asyncio.run(fn(aeng))
    finally:
        aeng.shutdown()


def test_n2_with_a_stop_string_in_one_sample_counts_what_it_keeps(engine, monkeypatch):
    prompt = [9, 10, 11]
    a, b = (c.token_ids for c in _offline(engine, prompt, SamplingParams(n=2, temperature=1.0, seed=5, ignore_eos=True,
                                                                          max_tokens=10)).outputs)
    j = next(j for j in range(1, 10) if a[j] not in b and a[j] not in a[:j])  # in sample 0 only
    params = SamplingParams(n=2, temperature=1.0, seed=5, ignore_eos=True, max_tokens=10, stop=[chr(0x4E00 + a[j])])

    async def go(aeng):
        before = aeng.stats().generation_tokens
        out = await aeng.generate(prompt, params)
        # Retired by the loop's command, not by shutdown: a command queued after it sees the engine without it.
        return out, aeng.stats().generation_tokens - before, await aeng.call(lambda eng: list(eng.groups))

    out, counted, groups = _run_async(engine, monkeypatch, go)
    s0, s1 = out.outputs
    assert (s0.token_ids, s0.finish_reason, s0.stop_reason) == (a[:j + 1], "stop", chr(0x4E00 + a[j]))
    assert (s1.token_ids, s1.finish_reason) == (b, "length")
    assert counted == len(s0.token_ids) + len(s1.token_ids)
    assert groups == [] and engine.kv_manager.num_free_units == engine.kv_manager.num_units


def test_abort_mid_stream_forgets_the_group(engine, monkeypatch):
    aeng = _manual(engine, monkeypatch)

    async def go():
        stream = await _add_by_hand(aeng, "gone", [4, 5], SamplingParams(max_tokens=40, ignore_eos=True, stop=["x"]))
        for _ in range(3):
            aeng._step()
        first = await stream.__anext__()
        stream.abort()  # the client went away mid-stream
        aeng._step()  # the core goes on until the abort arrives; the closed stream ignores these
        await asyncio.sleep(0)
        _by_hand(aeng)
        return first

    first = asyncio.run(go())
    assert not first.finished and first.outputs[0].token_ids
    assert not engine.groups and not aeng._streams and not engine.has_work()
    assert engine.kv_manager.num_free_units == engine.kv_manager.num_units


def test_a_failure_in_output_processing_ends_its_stream_and_frees_its_requests(engine, monkeypatch):
    from kvinfer.engine.async_engine import EngineStepError

    aeng = _manual(engine, monkeypatch)

    class Broken:
        def decode(self, ids, skip_special_tokens=True):
            raise RuntimeError("cannot decode")

    monkeypatch.setattr(aeng, "tokenizer", Broken())

    async def go():
        stream = await _add_by_hand(aeng, "bad", [4, 5], SamplingParams(max_tokens=20, ignore_eos=True))
        aeng._step()
        await asyncio.sleep(0)  # the loop's output processing raises; the stream sends an abort
        _by_hand(aeng)
        with pytest.raises(EngineStepError, match="cannot decode"):
            await stream.__anext__()

    asyncio.run(go())
    assert not engine.groups and not aeng._streams and not engine.has_work()
    assert engine.kv_manager.num_free_units == engine.kv_manager.num_units
