"""A Q5_1 GGUF file stays quantized: its blocks are what the loaded layers hold (not float32), nothing is said to be
widened, and it decodes through the kernels (the fused C step included) to the tokens of the float reference."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import gguf
import pytest
import torch

from kvinfer import LLM, SamplingParams, kernels
from kvinfer.config import EngineConfig
from kvinfer.layers.quant_linear import QuantEmbedding, QuantLinear
from kvinfer.loaders.model_loader import load_model
from kvinfer.models.fused_decode import FusedDecode, unsupported_reason
from tests.conftest import assert_engine_clean
from tests.kernel_helpers import fused_calls, run_fused as _run
from tests.reference_helpers import step_logits

_spec = importlib.util.spec_from_file_location("make_gguf",
                                               Path(__file__).resolve().parents[2] / "scripts/make_gguf.py")
make_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf)

needs_kernels = pytest.mark.skipif(not kernels.available() or not kernels.batch_invariant(),
                                   reason="the GGUF kernels are unavailable here")




@pytest.fixture(scope="module")
def q51_path(tmp_path_factory) -> Path:
    return make_gguf.make(tmp_path_factory.mktemp("q51") / "tiny-q51.gguf", "tiny", "Q5_1", seed=3)


@needs_kernels
def test_q5_1_file_keeps_its_blocks_not_float32(q51_path, caplog):
    with caplog.at_level(logging.INFO, logger="kvinfer"):
        loaded = load_model(EngineConfig(model=str(q51_path), dtype="float32", device="cpu"))
    msgs = [r.getMessage() for r in caplog.records]
    assert not [m for m in msgs if "widened" in m or "Q5_1" in m], msgs  # not widened, not rewritten either
    reader = gguf.GGUFReader(str(q51_path))
    q51 = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q5_1]
    file_bytes, elems = sum(int(t.n_bytes) for t in q51), sum(int(t.n_elements) for t in q51)
    assert q51 and file_bytes * 32 == elems * 24
    # Every matrix is a Q5_1 layer over the file's bytes (the tied head shares the embedding's): kept = file.
    layers = [m for m in loaded.model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert layers and {m.qtype for m in layers} == {"Q5_1"}
    raws = {m.raw.data_ptr(): m.raw for m in layers}
    kept = sum(r.numel() * r.element_size() for r in raws.values())
    assert kept == file_bytes, (kept, file_bytes)
    # What else the model holds in float is the norms: far below the 4 bytes per weight of a widened file.
    floats = {id(t): t for t in list(loaded.model.parameters()) + list(loaded.model.buffers())
              if t.is_floating_point() and not t.is_meta}
    float_bytes = sum(t.numel() * t.element_size() for t in floats.values())
    assert kept + float_bytes < elems, (kept, float_bytes, elems * 4)  # under a quarter of float32's bytes
    # A prefill through the kernels makes no float32 copy of any weight.
    logits = step_logits(loaded, list(range(3, 40)), [7, 8], "paged")
    assert torch.isfinite(logits).all()
    assert all(m._weight is None for m in layers if isinstance(m, QuantLinear))


@needs_kernels
def test_q5_1_model_decodes_the_float_references_tokens_fused_and_eager_alike(q51_path):
    llm = LLM(str(q51_path), dtype="float32", kv_cache_memory=8 << 20, max_num_seqs=8)
    ref = LLM(str(q51_path), dtype="float32", quantization="none", kv_cache_memory=8 << 20, max_num_seqs=8)
    eng = llm.engine
    assert eng.loaded.quantized_modules > 0 and ref.engine.loaded.quantized_modules == 0
    assert unsupported_reason(eng.loaded.model, eng.kv_cache) is None
    fd = FusedDecode(eng.loaded.model, eng.kv_cache)
    assert fd.embed is not None and fd.fuses_head  # the Q5_1 embedding and tied head inside the C step too
    prompts = [[5 + (97 * i + 13 * j) % 40000 for j in range(4 + 6 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2) for _ in prompts]
    with fused_calls() as calls:
        fused = _run(llm, prompts, params, True)
    assert calls  # decode steps went through the C step
    eager = _run(llm, prompts, params, False)
    floats = ref.generate(prompts, params, use_tqdm=False)
    for a, b, f in zip(fused, eager, floats):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == f.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
    assert_engine_clean(eng)
