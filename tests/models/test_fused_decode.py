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
    # the kept copies travel in the table beside their weights (the tied embedding reads the head's)
    model = builtin_llm.engine.loaded.model
    head = model.lm_head._tiles
    for lin, got in ((model.layers[0].attn.qkv, fd.layers[0].qkv_kept), (model.layers[-1].mlp.down,
                                                                        fd.layers[-1].down_kept)):
        assert got == (lin._tiles.ptr if lin._tiles is not None else None)
    assert fd._head_kept == fd._embed_kept == (head.ptr if head is not None else None)
    assert (head is not None) == (kernels.active().keeps_tiles and kernels.active().level == "avx512"
                                  and kernels.keep_tiles_enabled())
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


@needs_kernels
def test_a_model_with_mixed_type_projections_decodes_fused_bitwise(tmp_path):
    # Q4_K_M files mix types inside q/k/v (and sometimes gate/up): each part is its own matmul in the C step, as in
    # the eager path's QuantParts, so the tokens and logprobs are the eager path's exactly.
    from kvinfer.layers.quant_linear import QuantParts
    from tests.gguf_helpers import TYPES, write_mixed

    types = dict(TYPES, **{"blk.0.ffn_gate.weight": "Q4_0", "blk.0.ffn_down.weight": "Q8_0"})  # all kernel types
    path = write_mixed(tmp_path / "mixed.gguf", types=types)
    llm = LLM(str(path), kv_cache_memory=4 << 20, max_num_seqs=8)
    eng = llm.engine
    layer0 = eng.loaded.model.layers[0]
    assert isinstance(layer0.attn.qkv, QuantParts) and isinstance(layer0.mlp.gate_up, QuantParts)
    assert unsupported_reason(eng.loaded.model, eng.kv_cache) is None
    calls = []
    one, many = FusedDecode.__call__, FusedDecode.decode_steps

    def counting(self, *a, **kw):
        calls.append(1)
        return one(self, *a, **kw)

    def counting_steps(self, *a, **kw):
        calls.append(1)
        return many(self, *a, **kw)

    prompts = [[2 + (7 * i + j) % 60 for j in range(3 + 5 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True, logprobs=3) for i in range(4)]
    FusedDecode.__call__, FusedDecode.decode_steps = counting, counting_steps
    try:
        fused = _run(llm, prompts, params, True)
    finally:
        FusedDecode.__call__, FusedDecode.decode_steps = one, many
    assert calls and eng.runner._fused is not None  # decode steps went through the C step
    eager = _run(llm, prompts, params, False)
    for a, b in zip(fused, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
    assert_engine_clean(eng)
