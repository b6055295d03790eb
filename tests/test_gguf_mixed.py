"""GGUF files mixing tensor types within a layer (as Q4_K_M files do): they load, widen only what the kernels
cannot take, and say so in one line."""
from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as ref_quantize

from kvinfer import kernels
from kvinfer.config import EngineConfig
from kvinfer.layers.quant_linear import QuantLinear, QuantParts
from kvinfer.loaders.model_loader import load_model
from kvinfer.utils import builtin_model_path
from tests.reference_helpers import step_logits

LLAMA_QUANTIZE = Path("/work/llama/build/bin/llama-quantize")
H, FFN, HEADS, KV, LAYERS, VOCAB = 64, 128, 4, 2, 2, 64
# Layer 0 mixes types inside both fused projections; layer 1 is uniform.
TYPES = {
    "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "Q5_1", "blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_down.weight": "Q5_1",
    "blk.0.attn_output.weight": "Q8_0", "token_embd.weight": "Q8_0", "output.weight": "Q4_0",
}


def write_mixed(path: Path, seed: int = 0, types: dict | None = None) -> Path:
    rng = np.random.default_rng(seed)
    types = TYPES if types is None else types
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(H // HEADS)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>"] + [f"t{i}" for i in range(2, VOCAB)])
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges([])
    w.add_eos_token_id(1)
    shapes = {"token_embd.weight": (VOCAB, H), "output.weight": (VOCAB, H), "output_norm.weight": (H,)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (KV * H // HEADS, H),
                       f"blk.{i}.attn_v.weight": (KV * H // HEADS, H), f"blk.{i}.attn_output.weight": (H, H),
                       f"blk.{i}.ffn_gate.weight": (FFN, H), f"blk.{i}.ffn_up.weight": (FFN, H),
                       f"blk.{i}.ffn_down.weight": (H, FFN)})
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        a = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        t = T[types.get(name, "Q8_0")]
        if t == T.IQ4_NL:  # the gguf package cannot quantise it: random table indices, small fp16 scales
            blocks = rng.integers(0, 256, (shape[0], shape[1] // 32, 18), dtype=np.uint8)
            d = rng.uniform(0.001, 0.003, blocks.shape[:2]).astype(np.float16)
            blocks[:, :, :2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
            w.add_tensor(name, blocks.reshape(shape[0], -1), raw_dtype=t)
            continue
        w.add_tensor(name, ref_quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path: Path, quantization: str = "auto"):
    return load_model(EngineConfig(model=str(path), dtype="float32", device="cpu", quantization=quantization))


needs_kernels = pytest.mark.skipif(not kernels.available() or not kernels.batch_invariant(),
                                   reason="the GGUF kernels are unavailable here")


@needs_kernels
def test_mixed_fused_projection_loads_and_matches_float(tmp_path, caplog):
    path = write_mixed(tmp_path / "mixed.gguf")
    with caplog.at_level(logging.WARNING, logger="kvinfer"):
        q = load(path)
    notes = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert len(notes) == 1, notes
    # Layer 0's gate/up (Q5_1 with Q8_0) and its Q5_1 down are widened (Q5_1 is not a kernel type); its q/k/v
    # (Q4_0, Q4_0, Q8_0: kernel types, mixed) stays quantized, one QuantLinear per part.
    widened = {t for t in ("Q5_1", "Q4_0", "Q8_0") if t in notes[0]}
    assert "Q5_1" in widened and str(path) in notes[0] and "MiB" in notes[0] and "attn_" not in notes[0]
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
def test_q5_0_and_iq4_nl_are_kept_as_q8_0_with_the_same_weights(tmp_path, caplog):
    # Every Q5_0 / IQ4_NL weight is d times a small integer, so the loader rewrites the blocks as Q8_0 (the same
    # d, the same integer) and the Q8_0 kernels take them: nothing widened, the gguf package's floats exactly.
    types = dict(TYPES, **{"blk.0.ffn_gate.weight": "Q5_0", "blk.0.ffn_up.weight": "IQ4_NL",
                           "blk.0.ffn_down.weight": "Q5_0", "blk.1.attn_v.weight": "IQ4_NL"})
    path = write_mixed(tmp_path / "q50.gguf", types=types)
    with caplog.at_level(logging.INFO, logger="kvinfer"):
        q = load(path)
    msgs = [r.getMessage() for r in caplog.records]
    assert not [m for m in msgs if "widened" in m]
    assert [m for m in msgs if "IQ4_NL x2, Q5_0 x2 kept as Q8_0" in m], msgs
    l0, l1 = q.model.layers
    assert isinstance(l0.mlp.gate_up, QuantLinear) and l0.mlp.gate_up.qtype == "Q8_0"
    assert isinstance(l0.mlp.down, QuantLinear) and l0.mlp.down.qtype == "Q8_0"
    assert isinstance(l1.attn.qkv, QuantLinear) and l1.attn.qkv.qtype == "Q8_0"  # Q8_0 q/k with an IQ4_NL v
    reader = gguf.GGUFReader(str(path))
    file_w = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    want = torch.cat([file_w["blk.0.ffn_gate.weight"], file_w["blk.0.ffn_up.weight"]])
    assert torch.equal(l0.mlp.gate_up.dequantized_weight(), want)
    assert torch.equal(l0.mlp.down.dequantized_weight(), file_w["blk.0.ffn_down.weight"])
    f = load(path, quantization="none")  # the file's weights widened: the kernels differ only by rounding x
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
