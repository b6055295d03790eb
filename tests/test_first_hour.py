"""The first hour (issue 46): defaults that answer well, a CLI llama.cpp users already know."""
import io
import json
import sys

import pytest

from kvinfer.cli import build_parser, main
from kvinfer.engine.generation_defaults import generation_defaults


@pytest.fixture(scope="module")
def llm():
    from kvinfer import LLM

    return LLM(kv_cache_memory="64MiB", max_model_len=1024)


def test_chat_defaults_answer_to_the_end(llm):
    # Before: SamplingParams() (max_tokens 16, temperature 1.0) cut the README's example off by length.
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    c = out.outputs[0]
    assert c.finish_reason == "stop", c.text
    assert "Paris" in c.text
    assert len(c.token_ids) > 0


def test_generation_config_supplies_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                  "do_sample": True, "eos_token_id": 2}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(str(tmp_path / "model.gguf")) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert generation_defaults(str(tmp_path)) == {}
    assert generation_defaults(None) == {"temperature": 0.0}  # the built-in model's


def test_server_chat_body_defaults_come_from_the_model():
    from kvinfer.server.app import _sampling_params
    from kvinfer.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = _sampling_params(body, None, None, {"temperature": 0.6, "top_k": 20})
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 1.0, None)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.9, top_k=5)
    p = _sampling_params(body, None, None, {"temperature": 0.6, "top_k": 20})
    assert (p.temperature, p.top_k) == (0.9, 5)
