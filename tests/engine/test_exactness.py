"""The exactness contract, as a property: a request's tokens and logprobs are bitwise the same however it is served
(batch composition, arrival order and time, chunked-prefill budget, prefix-cache hits, preemption and recompute,
KV backend, block size), for the built-in model and a tiny model of every family."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from kvinfer import kernels
from kvinfer.config import EngineConfig
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.loaders.model_loader import load_model
from tests.conftest import save_tiny_llama
from tests.exactness_helpers import (HYPOTHESIS_SETTINGS, MAX_LEN, check_served, sample_requests, serve,
                                     serve_alone, ways)
from tests.family_helpers import FAMS
from tests.reference_helpers import save_tiny

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the exact path needs the CPU kernels")


def _family_model(name, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"exact_{name}")
    if name == "llama":
        save_tiny_llama(path, max_position_embeddings=MAX_LEN)
    else:
        fam = FAMS[name]
        save_tiny(fam.config_cls, fam.model_cls, path, seed=1, **fam.init, **fam.config)
    return str(path), load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gpt2", "bloom"])
def test_every_family_is_exact_however_served(name, tmp_path_factory):
    path, loaded = _family_model(name, tmp_path_factory)
    reqs = sample_requests(loaded.config.vocab_size, 3)
    alone = serve_alone(loaded, path, reqs)

    @settings(max_examples=6, **HYPOTHESIS_SETTINGS)
    @given(way=ways)
    def prop(way):
        check_served(loaded, path, reqs, alone, way)

    prop()


def test_builtin_model_is_exact_however_served(builtin_llm):
    loaded = builtin_llm.engine.loaded
    reqs = sample_requests(49152, 1000)
    alone = serve_alone(loaded, None, reqs)

    @settings(max_examples=5, **HYPOTHESIS_SETTINGS)
    @given(way=ways)
    def prop(way):
        check_served(loaded, None, reqs, alone, way)

    prop()


def test_the_property_really_preempts_and_chunks(builtin_llm):
    # Guard against a vacuous pass: the small budget does preempt, and the results still match alone.
    loaded = builtin_llm.engine.loaded
    reqs = sample_requests(49152, 1000)
    alone = serve_alone(loaded, None, reqs)
    got, preemptions = serve(loaded, None, reqs, kv_tokens=72, block_size=4, budget=16)
    assert preemptions > 0
    assert all(got[i] == alone[i] for i in alone)
    # and the prompt logprobs are really there: none for the first prompt token, one per later token
    for i, (prompt, p) in enumerate(reqs):
        pl = alone[i][3]
        assert (pl is None) == (p.prompt_logprobs is None)
        if pl is not None:
            assert pl[0] is None and len(pl) == len(prompt)
            assert [t for t, _, _ in pl[1:]] == prompt[1:] and all(len(top) == p.prompt_logprobs for *_, top in pl[1:])


def test_thread_count_does_not_change_a_bit(builtin_llm):
    loaded = builtin_llm.engine.loaded
    reqs = sample_requests(49152, 1000)[:3]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = serve(loaded, None, reqs)
        torch.set_num_threads(2)
        two, _ = serve(loaded, None, reqs)
    finally:
        torch.set_num_threads(n)
    assert one == two


def test_every_isa_level_gives_the_same_bits_end_to_end(tiny_llama_dir):
    # The portable level and the vector levels perform the same IEEE operations lane for lane: a whole
    # generation (prefill, decode, sampling with a seed) matches bit for bit.
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from kvinfer import LLM, SamplingParams, kernels\n"
        f"llm = LLM({tiny_llama_dir!r}, dtype='float32', kv_cache_memory=1 << 20, block_size=4)\n"
        "ps = [[5, 9, 13, 2, 77, 31, 8], [100, 101, 102]]\n"
        "sp = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),\n"
        "      SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)]\n"
        "outs = llm.generate(ps, sp, use_tqdm=False)\n"
        "print(json.dumps([kernels.level(), [[list(o.outputs[0].token_ids),\n"
        "      [lp.logprob.hex() for lp in o.outputs[0].logprobs]] for o in outs]]))\n")
    runs = {}
    levels = [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]
    for lv in levels:
        env = dict(os.environ, KVINFER_ISA=lv)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        level, result = json.loads(out.stdout.strip().splitlines()[-1])
        assert level == lv
        runs[lv] = result
    assert len(runs) >= 2
    first = runs[levels[0]]
    for lv in levels[1:]:
        assert runs[lv] == first, lv


def test_a_cpu_dtype_without_the_guarantee_says_so(tiny_llama_dir, caplog):
    # bfloat16 on the CPU runs eager PyTorch (oneDNN's blocking follows the batch shape): the engine warns at start-up
    # that outputs may depend on batching; float32, the CPU default, does not warn.
    import logging

    with caplog.at_level(logging.WARNING, logger="kvinfer"):
        LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="bfloat16", device="cpu"))
    assert any("bfloat16 on the CPU" in r.getMessage() and "batched" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvinfer"):
        LLMEngine(EngineConfig(model=tiny_llama_dir, device="cpu"))
    assert not [r for r in caplog.records if "eager PyTorch path" in r.getMessage()]
