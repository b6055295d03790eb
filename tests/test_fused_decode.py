"""FusedDecode (all layers of a decode step in one C call) against the eager per-layer path."""
from __future__ import annotations

import pytest

from kvinfer import LLM, SamplingParams, kernels
from kvinfer.engine.model_runner import ModelRunner
from kvinfer.models.fused_decode import FusedDecode, unsupported_reason
from tests.conftest import assert_engine_clean

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable on this machine")


def _run(llm, prompts, params, fused: bool):
    old = ModelRunner.use_fused_decode
    ModelRunner.use_fused_decode = fused
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        ModelRunner.use_fused_decode = old


def _compare(builtin_llm, tol):
    eng = builtin_llm.engine
    calls = []
    orig = FusedDecode.__call__

    def counting(self, *a):
        calls.append(a[0].shape[0])
        return orig(self, *a)

    prompts = [[1000 + (37 * i + j) % 20000 for j in range(3 + 11 * i)] for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 4 * i, ignore_eos=True, logprobs=3) for i in range(7)]
    FusedDecode.__call__ = counting
    try:
        fused = _run(builtin_llm, prompts, params, True)
    finally:
        FusedDecode.__call__ = orig
    assert calls and max(calls) == 7  # decode-only steps went through the fused path, batched
    eager = _run(builtin_llm, prompts, params, False)
    for a, b in zip(fused, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=tol)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
    assert_engine_clean(eng)


@needs_kernels
def test_builtin_model_fused_matches_eager_bitwise(builtin_llm):
    # The fused step calls the eager path's own kernels in the same order: not close, identical.
    assert unsupported_reason(builtin_llm.engine.loaded.model, builtin_llm.engine.kv_cache) is None
    fd = FusedDecode(builtin_llm.engine.loaded.model, builtin_llm.engine.kv_cache)
    # the embedding lookup, the final norm and the tied Q8_0 head run inside the C step too
    assert fd.embed is not None and fd.final_norm is not None and fd.fuses_head
    _compare(builtin_llm, 0.0)


@needs_kernels
def test_fused_path_counts_kv_projections(builtin_llm):
    kv = builtin_llm.engine.kv_cache
    before = kv.kv_computed
    _run(builtin_llm, [[1000, 1001, 1002]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), True)
    layers = builtin_llm.engine.model_config.num_layers
    assert kv.kv_computed - before == (3 + 4) * layers  # prompt once, then one per generated token but the last


def test_unsupported_models_and_backends_say_why(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 20)
    eng = llm.engine
    assert "QuantLinear" in unsupported_reason(eng.loaded.model, eng.kv_cache)  # float safetensors weights
    with pytest.raises(ValueError, match="fused decode unsupported"):
        FusedDecode(eng.loaded.model, eng.kv_cache)
    c = LLM(tiny_llama_dir, dtype="float32", kv_cache="contiguous", max_num_seqs=2).engine
    assert "contiguous" in unsupported_reason(c.loaded.model, c.kv_cache)
