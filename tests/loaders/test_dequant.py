"""Our GGML dequantisation against the gguf package's reference decoder."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from kvinfer.errors import ModelLoadError, UnsupportedError
from kvinfer.loaders.dequant import (
    SUPPORTED_GGUF_TYPES,
    block_info,
    dequantize,
    q4_1_to_int4_groups,
    q8_0_to_int8,
)

ALL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# Byte offsets of the f16 scale fields inside one block; random bytes there could be inf/nan.
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}
SHAPES = [(256,), (1, 256), (5, 512), (2, 3, 768), (64, 1024)]


def random_blocks(name: str, n_elems: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes (every bit pattern decodes) with finite f16 scales."""
    elems, nbytes = block_info(name)
    blocks = rng.integers(0, 256, size=(n_elems // elems, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scales = rng.standard_normal(blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks


def check_equal(ours: torch.Tensor, ref: np.ndarray, shape) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == tuple(shape)
    np.testing.assert_array_equal(ours.numpy(), ref.reshape(shape).astype(np.float32))


def test_supported_list():
    assert SUPPORTED_GGUF_TYPES == ALL_TYPES


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ALL_TYPES)
def test_matches_reference(name, shape):
    rng = np.random.default_rng(zlib.crc32(repr((name, shape)).encode()))
    qtype = T[name]
    data = (rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32)
    try:
        raw = ref_quantize(data, qtype)
    except NotImplementedError:  # the gguf package decodes K-quants but cannot encode them
        raw = random_blocks(name, data.size, rng)
    ours = dequantize(raw, qtype, shape)
    check_equal(ours, ref_dequantize(raw, qtype), shape)
    if name in ("F32", "F16", "BF16"):
        rel = (ours - torch.from_numpy(data)).abs().max() / np.abs(data).max()
        assert rel < 1e-2


@pytest.mark.parametrize("name", list(F16_FIELDS))
def test_random_bits_match_reference(name):
    # Every bit pattern of the quant fields, not only what the reference quantiser produces.
    rng = np.random.default_rng(7)
    shape = (6, 512)
    raw = random_blocks(name, 6 * 512, rng)
    check_equal(dequantize(raw, T[name], shape), ref_dequantize(raw, T[name]), shape)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(list(F16_FIELDS)), rows=st.integers(1, 4), blocks_per_row=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_random_blocks_property(name, rows, blocks_per_row, seed):
    elems, _ = block_info(name)
    shape = (rows, elems * blocks_per_row)
    raw = random_blocks(name, rows * shape[1], np.random.default_rng(seed))
    check_equal(dequantize(raw, name, shape), ref_dequantize(raw, T[name]), shape)


def test_accepts_type_as_id_enum_name_and_any_array_dtype():
    rng = np.random.default_rng(1)
    data = rng.standard_normal((4, 64)).astype(np.float32)
    raw = ref_quantize(data, T.Q8_0)
    want = dequantize(raw, T.Q8_0, (4, 64))
    for qtype in (8, T.Q8_0, "Q8_0", "q8_0", np.int32(8)):
        assert torch.equal(dequantize(raw, qtype, (4, 64)), want)
    assert torch.equal(dequantize(raw.reshape(-1), 8, (4, 64)), want)
    assert torch.equal(dequantize(torch.from_numpy(raw), 8, (4, 64)), want)
    ro = raw.copy()
    ro.flags.writeable = False
    assert torch.equal(dequantize(ro, 8, (4, 64)), want)
    # float arrays as gguf hands them out for F16 / F32 tensors
    f16 = data.astype(np.float16)
    assert torch.equal(dequantize(f16, T.F16, (4, 64)), torch.from_numpy(f16.astype(np.float32)))
    out = dequantize(data, T.F32, (4, 64))
    assert torch.equal(out, torch.from_numpy(data))
    out += 1  # the result owns its memory
    assert not np.array_equal(out.numpy(), data)


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, int(T.Q8_1), "Q8_K", 99])
def test_unsupported_type(qtype):
    with pytest.raises(UnsupportedError) as e:
        dequantize(np.zeros(66, np.uint8), qtype, (256,))
    msg = str(e.value)
    assert "is not supported" in msg and "Q4_K" in msg and "Q8_0" in msg
    name = qtype if isinstance(qtype, str) else ("99" if qtype == 99 else T(int(qtype)).name)
    assert f"GGUF tensor type {name} " in msg


def test_wrong_sizes():
    with pytest.raises(ModelLoadError, match="needs 68 bytes"):
        dequantize(np.zeros(67, np.uint8), "Q8_0", (2, 32))
    with pytest.raises(ModelLoadError, match="multiple of 256"):
        dequantize(np.zeros(210, np.uint8), "Q6_K", (2, 128))


def test_q4_1_groups():
    rng = np.random.default_rng(3)
    shape = (12, 96)
    raw = ref_quantize(rng.standard_normal(shape).astype(np.float32), T.Q4_1)
    q, scale, mn = q4_1_to_int4_groups(raw, shape)
    assert q.dtype == torch.uint8 and tuple(q.shape) == shape
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    assert tuple(scale.shape) == tuple(mn.shape) == (12, 3) and scale.dtype == mn.dtype == torch.float32
    rebuilt = q.float().view(12, 3, 32) * scale.unsqueeze(-1) + mn.unsqueeze(-1)
    assert torch.equal(rebuilt.view(shape), dequantize(raw, "Q4_1", shape))


def test_q8_0_int8():
    rng = np.random.default_rng(4)
    shape = (5, 128)
    raw = ref_quantize(rng.standard_normal(shape).astype(np.float32), T.Q8_0)
    q, scale = q8_0_to_int8(raw, shape)
    assert q.dtype == torch.int8 and tuple(q.shape) == shape
    assert tuple(scale.shape) == (5, 4) and scale.dtype == torch.float32
    rebuilt = q.float().view(5, 4, 32) * scale.unsqueeze(-1)
    assert torch.equal(rebuilt.view(shape), dequantize(raw, "Q8_0", shape))


def test_group_exports_need_a_matrix():
    with pytest.raises(ValueError, match="2-D"):
        q8_0_to_int8(np.zeros(34, np.uint8), (32,))
