"""Shared fixtures: tiny random-weight models written with transformers, the built-in model, integrity checks."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny test models run fastest on one thread: no OpenMP hand-offs, and the suite stays steady on a busy box.
torch.set_num_threads(1)


# The tests `pytest -m "not slow"` leaves out (the fast tier): tests/slow.txt, written by scripts/slow_tests.py from
# a full run's durations. `make test` runs everything.
_SLOW = frozenset(line.strip() for line in (Path(__file__).parent / "slow.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in _SLOW:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def save_tiny_llama(path, seed=0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="session")
def builtin_model_path():
    from kvinfer.utils import builtin_model_path as find

    return str(find())


@pytest.fixture(scope="session")
def builtin_llm():
    """The built-in model, float32, shared by the tests that need real text."""
    from kvinfer import LLM

    return LLM(None, dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)


def assert_engine_clean(engine):
    """After all requests finish: every block free again and the bookkeeping consistent."""
    engine.check_integrity()
    m = engine.kv_manager
    assert not engine.has_unfinished_requests()
    assert m.num_free_units == m.num_units, f"{m.num_units - m.num_free_units} {m.unit_name}s still in use"


def generate_checked(model_dir, prompts, params, **kw):
    """(outputs, llm) of a tiny model (float32, 4 MiB of KV, blocks of 4 unless kw says otherwise), after checking
    that the engine gave every block back."""
    from kvinfer import LLM

    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory", 4 << 20)
    kw.setdefault("block_size", 4)
    llm = LLM(model_dir, **kw)
    outs = llm.generate(prompts, params)
    assert_engine_clean(llm.engine)
    return outs, llm
