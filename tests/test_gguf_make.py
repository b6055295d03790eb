"""scripts/make_gguf.py: random-weight GGUF files at a model's shape that load with the built-in tokenizer."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvinfer.config import EngineConfig
from kvinfer.loaders.gguf_loader import read_gguf, read_metadata
from kvinfer.loaders.model_loader import load_model
from kvinfer.utils import builtin_model_path
from tests.reference_helpers import step_logits

_spec = importlib.util.spec_from_file_location("make_gguf",
                                               Path(__file__).resolve().parents[1] / "scripts/make_gguf.py")
make_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf)


@pytest.mark.parametrize("shape,qtype", [("tiny", "Q4_0"), ("tiny", "F16"), ("tiny-qwen3", "Q8_0")])
def test_tiny_file_loads_and_runs(tmp_path, shape, qtype):
    path = make_gguf.make(tmp_path / "m.gguf", shape, qtype)
    arch, h, n, heads, kv, hd, ffn, tied, _, _ = make_gguf.SHAPES[shape]
    meta = read_metadata(path)
    built_in = read_metadata(builtin_model_path())
    assert meta["tokenizer.ggml.tokens"] == built_in["tokenizer.ggml.tokens"]
    assert meta["tokenizer.chat_template"] == built_in["tokenizer.chat_template"]
    ck = read_gguf(path)
    assert (ck.config.architecture, ck.config.hidden_size, ck.config.num_layers, ck.config.head_dim) == (arch, h, n, hd)
    assert ck.config.tie_word_embeddings == tied
    kinds = {t for name, t in ck.tensor_types.items() if name.endswith("proj.weight")}
    assert kinds == {qtype}
    w = ck.tensors["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < w.std().item() < 0.025  # normal * 0.02, through the quantizer
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    ids = loaded.tokenizer.encode("Hello there")
    logits = step_logits(loaded, ids, [5, 6], "paged")
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_seed_changes_weights_and_repeats(tmp_path):
    a = make_gguf.make(tmp_path / "a.gguf", "tiny", "Q8_0", seed=1).read_bytes()
    b = make_gguf.make(tmp_path / "b.gguf", "tiny", "Q8_0", seed=1).read_bytes()
    c = make_gguf.make(tmp_path / "c.gguf", "tiny", "Q8_0", seed=2).read_bytes()
    assert a == b and a != c


def test_missing_llama_quantize_is_named(tmp_path, capsys):
    rc = make_gguf.main(["--shape", "tiny", "--type", "Q4_K_M", "--out", str(tmp_path / "k.gguf"),
                         "--llama-quantize", str(tmp_path / "no-such-llama-quantize")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "no-such-llama-quantize" in err and "does not exist" in err


@pytest.mark.skipif(not Path(make_gguf.DEFAULT_QUANTIZE).is_file(), reason=f"{make_gguf.DEFAULT_QUANTIZE} is not built")
def test_k_quant_mix_through_llama_quantize(tmp_path):
    path = make_gguf.make(tmp_path / "k.gguf", "tiny-256", "Q4_K_M")
    ck = read_gguf(path)
    assert {"Q4_K", "Q6_K"} <= set(ck.tensor_types.values())
    loaded = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    assert torch.isfinite(step_logits(loaded, [1, 2, 3], [4], "paged")).all()
