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
