"""GGUF files mixing tensor types within a layer (as Q4_K_M files do): they load, widen only what the kernels
cannot take, and say so in one line."""
from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import gguf
import pytest
import torch

from kvinfer import kernels
from kvinfer.config import EngineConfig
from kvinfer.layers.quant_linear import QuantLinear, QuantParts
from kvinfer.loaders.model_loader import load_model
from kvinfer.utils import builtin_model_path
from tests.gguf_helpers import TYPES, write_mixed
from tests.reference_helpers import step_logits

LLAMA_QUANTIZE = Path("/work/llama/build/bin/llama-quantize")
def load(path: Path, quantization: str = "auto"):
    return load_model(EngineConfig(model=str(path), dtype="float32", device="cpu", quantization=quantization))


needs_kernels = pytest.mark.skipif(not kernels.available() or not kernels.batch_invariant(),
                                   reason="the GGUF kernels are unavailable here")


@needs_kernels
def test_mixed_fused_projection_loads_and_matches_float(tmp_path, caplog):
    # A file's F16 matrices are widened to float32 (F16 is not among the types kept as blocks).
    types = dict(TYPES, **{"blk.0.ffn_gate.weight": "F16", "blk.0.ffn_down.weight": "F16"})
    path = write_mixed(tmp_path / "mixed.gguf", types=types)
    with caplog.at_level(logging.WARNING, logger="kvinfer"):
        q = load(path)
    notes = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert len(notes) == 1, notes
    # Layer 0's gate/up (F16 with Q8_0) and its F16 down are widened; its q/k/v (Q4_0, Q4_0, Q8_0: kernel types,
    # mixed) stays quantized, one QuantLinear per part.
    assert "F16 x2, Q8_0 x1" in notes[0] and str(path) in notes[0] and "MiB" in notes[0]
    assert "attn_" not in notes[0]
    l0, l1 = q.model.layers
    assert isinstance(l0.attn.qkv, QuantParts) and [p.qtype for p in l0.attn.qkv.parts] == ["Q4_0", "Q4_0", "Q8_0"]
    assert not isinstance(l0.mlp.gate_up, (QuantLinear, QuantParts))
    assert isinstance(l0.attn.o, QuantLinear) and isinstance(l1.attn.qkv, QuantLinear)
    assert isinstance(l1.mlp.gate_up, QuantLinear)
    assert not any(t.is_meta for t in list(q.model.parameters()) + list(q.model.buffers()))
    f = load(path, quantization="none")
    prompt, feed = [3, 9, 17, 40, 5], [11, 2, 33]
    got = step_logits(q, prompt, feed, "paged")
    want = step_logits(f, prompt, feed, "paged")
    assert torch.isfinite(got).all()
    # The kernels quantise activations, the float path does not: close, not equal.
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())


@needs_kernels
def test_q5_0_and_iq4_nl_stay_as_stored_with_the_files_weights(tmp_path, caplog):
    # The kernels read Q5_0 (22 bytes per 32 weights) and IQ4_NL (18) as stored: nothing widened or rewritten, the
    # gguf package's floats exactly, and a fused projection may mix them with other types.
    types = dict(TYPES, **{"blk.0.ffn_gate.weight": "Q5_0", "blk.0.ffn_up.weight": "IQ4_NL",
                           "blk.0.ffn_down.weight": "Q5_0", "blk.1.attn_v.weight": "IQ4_NL"})
    path = write_mixed(tmp_path / "q50.gguf", types=types)
    with caplog.at_level(logging.INFO, logger="kvinfer"):
        q = load(path)
    msgs = [r.getMessage() for r in caplog.records]
    assert not [m for m in msgs if "widened" in m or "Q8_0" in m], msgs
    l0, l1 = q.model.layers
    assert isinstance(l0.mlp.gate_up, QuantParts) and [p.qtype for p in l0.mlp.gate_up.parts] == ["Q5_0", "IQ4_NL"]
    assert isinstance(l0.mlp.down, QuantLinear) and l0.mlp.down.qtype == "Q5_0"
    assert l0.mlp.down.raw.numel() == l0.mlp.down.out_features * l0.mlp.down.in_features // 32 * 22
    up = l0.mlp.gate_up.parts[1]
    assert up.raw.numel() == up.out_features * up.in_features // 32 * 18  # not the rewrite's 34
    assert isinstance(l1.attn.qkv, QuantParts) and [p.qtype for p in l1.attn.qkv.parts] == ["Q8_0", "Q8_0", "IQ4_NL"]
    reader = gguf.GGUFReader(str(path))
    file_w = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    assert torch.equal(l0.mlp.gate_up.parts[0].dequantized_weight(), file_w["blk.0.ffn_gate.weight"])
    assert torch.equal(l0.mlp.gate_up.parts[1].dequantized_weight(), file_w["blk.0.ffn_up.weight"])
    assert torch.equal(l0.mlp.down.dequantized_weight(), file_w["blk.0.ffn_down.weight"])
    f = load(path, quantization="none")  # the file's weights widened: the kernels differ only by rounding x
    prompt, feed = [3, 9, 17, 40, 5], [11, 2, 33]
    got, ref = step_logits(q, prompt, feed, "paged"), step_logits(f, prompt, feed, "paged")
    assert torch.isfinite(got).all() and torch.allclose(got, ref, atol=0.05 * ref.abs().max().item())


@needs_kernels
def test_q5_1_stays_quantized_beside_other_types(tmp_path, caplog):
    # Q5_1 is a kernel type: layer 0's gate/up (Q5_1 with Q8_0) is kept in parts, its down as Q5_1 blocks, nothing
    # widened; the layers' weights are the gguf package's floats exactly.
    path = write_mixed(tmp_path / "q51.gguf")
    with caplog.at_level(logging.INFO, logger="kvinfer"):
        q = load(path)
    assert not [r for r in caplog.records if "widened" in r.getMessage()]
    l0 = q.model.layers[0]
    assert isinstance(l0.mlp.gate_up, QuantParts) and [p.qtype for p in l0.mlp.gate_up.parts] == ["Q5_1", "Q8_0"]
    assert isinstance(l0.mlp.down, QuantLinear) and l0.mlp.down.qtype == "Q5_1"
    reader = gguf.GGUFReader(str(path))
    file_w = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    assert torch.equal(l0.mlp.gate_up.parts[0].dequantized_weight(), file_w["blk.0.ffn_gate.weight"])
    assert torch.equal(l0.mlp.down.dequantized_weight(), file_w["blk.0.ffn_down.weight"])
    f = load(path, quantization="none")
    prompt, feed = [3, 9, 17, 40, 5], [11, 2, 33]
    got, ref = step_logits(q, prompt, feed, "paged"), step_logits(f, prompt, feed, "paged")
    assert torch.isfinite(got).all() and torch.allclose(got, ref, atol=0.05 * ref.abs().max().item())


def test_uniform_file_prints_no_widening_line(tmp_path, caplog):
    # The built-in Q4_1 model: every matrix is a kernel type, so nothing is widened and nothing is said.
    with caplog.at_level(logging.WARNING, logger="kvinfer"):
        load(builtin_model_path())
    assert not [r for r in caplog.records if "widened" in r.getMessage()]


@needs_kernels
@pytest.mark.skipif(not LLAMA_QUANTIZE.is_file(), reason=f"{LLAMA_QUANTIZE} is not built")
def test_builtin_requantized_q4_k_m(tmp_path):
    """The issue's crash: the built-in model through llama-quantize --allow-requantize to Q4_K_M."""
    out = tmp_path / "smol-q4km.gguf"
    subprocess.run([str(LLAMA_QUANTIZE), "--allow-requantize", str(builtin_model_path()), str(out), "Q4_K_M", "2"],
                   check=True, capture_output=True)
    q = load(out)
    assert not any(t.is_meta for t in list(q.model.parameters()) + list(q.model.buffers()))
    ids = q.tokenizer.encode("The capital of France is")
    logits = step_logits(q, ids, [], "paged")
    assert torch.isfinite(logits).all()
