"""The C side's interface as Python sees it: type ids and error codes, ctypes mirrors of kernels.h's structs, and
every exported function's prototype. tests/kernels/test_kernel_abi.py checks each mirror's size and field offsets against
the compiled library (abi.c)."""
from __future__ import annotations

import ctypes

import torch

from kvinfer.config import KV_8BIT

# GGML type ids, as the C side takes them: quantised (32-element blocks; K-quants, 256-element super-blocks, in
# kquants.c) and float rows.
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
          "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}
FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
# KV cache element types: float32, 8-bit values with a float32 scale per group of 32 values of a row (KV_SCALED),
# or bfloat16.
KV_DTYPES = {"float32": 0, "int8": 1, "fp8": 2, "bfloat16": 3}
KV_STORAGE = {"int8": torch.int8, "fp8": torch.uint8, "bfloat16": torch.bfloat16}  # fp8 = e4m3 bit patterns
KV_SCALED = KV_8BIT
# (elements, bytes) per block, as ggml_blocks.h and qmatmul.c have them.
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
           "IQ4_NL": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_XS": (256, 136),
           "Q3_K": (256, 110), "Q2_K": (256, 84)}


def _short_rows(qtype: str, k: int, row_bytes: int) -> bool:
    """Whether k is not a whole number of qtype's blocks, or rows of row_bytes cannot hold them."""
    n, b = _BLOCKS[qtype]
    return k % n != 0 or row_bytes < k // n * b


_EBADSHAPE = -2
_EBADTYPE = -1  # KVQ_EBADTYPE: also "not a job this route takes" (kvq_attention_prompt)
_ERRORS = {-1: "unsupported weight type", -2: "bad shape or position", -4: "out of memory",
           -5: "weight rows too short for K", -6: "block id or slot outside the pool"}



def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} failed: {_ERRORS.get(rc, rc)}")


_i64, _f32, _i32, _vp = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


class AttnJob(ctypes.Structure):
    c_struct = "kvq_attn"
    _fields_ = [(n, _vp) for n in ("q", "out", "k", "v", "k_scale", "v_scale", "tables", "tok_seq", "tok_pos",
                                   "slopes")] + \
               [(n, _i64) for n in ("T", "H", "KVH", "D", "BS", "NB", "table_stride", "q_stride", "out_stride",
                                    "block_stride", "tok_stride", "head_stride", "window")] + \
               [("scale", _f32), ("nthreads", _i32), ("kv_dtype", _i32)]


class DecodePart(ctypes.Structure):
    """struct kvq_part: one part of a fused projection whose parts differ in type (kept: its weight's kept copy; bias:
    its slice of the projection's bias, or None)."""
    c_struct = "kvq_part"
    _fields_ = [("w", _vp), ("rows", _i64), ("ldw", _i64), ("qt", _i32), ("kept", _vp), ("bias", _vp)]


MAX_PARTS = 3  # KVQ_MAX_PARTS (checked by tests/kernels/test_kernel_abi.py)


class DecodeExpert(ctypes.Structure):
    """struct kvq_expert: one expert of a mixture-of-experts layer (gate-up, or its parts, and down)."""
    c_struct = "kvq_expert"
    _fields_ = [("gate_up", _vp), ("down", _vp), ("gate_up_ldw", _i64), ("down_ldw", _i64), ("gate_up_qt", _i32),
                ("down_qt", _i32), ("gate_up_parts", DecodePart * MAX_PARTS), ("gate_up_nparts", _i32),
                ("gate_up_kept", _vp), ("down_kept", _vp)]


class DecodeLayer(ctypes.Structure):
    c_struct = "kvq_decode_layer"
    _fields_ = [(n, _vp) for n in ("attn_norm", "ffn_norm", "qkv", "o", "gate_up", "down")] + \
               [(n, _i64) for n in ("qkv_ldw", "o_ldw", "gate_up_ldw", "down_ldw")] + \
               [(n, _i32) for n in ("qkv_qt", "o_qt", "gate_up_qt", "down_qt")] + \
               [(n, _vp) for n in ("kpool", "vpool", "kscale", "vscale")] + \
               [("qkv_parts", DecodePart * MAX_PARTS), ("gate_up_parts", DecodePart * MAX_PARTS),
                ("qkv_nparts", _i32), ("gate_up_nparts", _i32), ("q_norm", _vp), ("k_norm", _vp)] + \
               [("experts", _vp), ("router", _vp)] + \
               [(n, _i64) for n in ("router_ldw", "n_experts", "top_k", "expert_inter")] + \
               [("router_qt", _i32), ("renorm", _i32)] + \
               [(n, _vp) for n in ("qkv_kept", "o_kept", "gate_up_kept", "down_kept")] + \
               [("shared", DecodeExpert), ("shared_gate", _vp), ("shared_gate_ldw", _i64), ("shared_inter", _i64),
                ("shared_gate_qt", _i32)] + \
               [(n, _vp) for n in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")]


class DecodeJob(ctypes.Structure):
    c_struct = "kvq_decode"
    _fields_ = [(n, _vp) for n in ("x", "layers", "cos", "sin", "slots", "tables", "lens")] + \
               [(n, _i64) for n in ("B", "hidden", "H", "KVH", "D", "inter", "L", "T", "BS", "NB", "window",
                                    "rope_rows")] + \
               [("eps", _f32), ("scale", _f32), ("nthreads", _i32), ("kv_dtype", _i32)] + \
               [("ids", _vp), ("embed", _vp), ("embed_ldw", _i64), ("vocab", _i64), ("embed_qt", _i32),
                ("final_eps", _f32), ("final_norm", _vp), ("out", _vp), ("head", _vp), ("head_ldw", _i64),
                ("head_rows", _i64), ("head_qt", _i32), ("logits", _vp), ("embed_kept", _vp), ("head_kept", _vp)]


class Sampling(ctypes.Structure):
    """struct kvq_sampling: per sequence of a multi-step call, how its next token is chosen (pointers to arrays)."""
    c_struct = "kvq_sampling"
    _fields_ = [(n, _vp) for n in ("temperature", "top_k", "top_p", "min_p", "u")]


_MATMUL_ARGS = ctypes.c_int64 * 13  # kvq_matmul_packed: kvq_matmul's arguments without kept, then kept


def _declare(lib: ctypes.CDLL) -> None:
    i64, c_int, vp, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    sig = {
        "kvq_matmul": ([vp, i64, i64, i64, vp, i64, i64, c_int, vp, vp, vp, i64, c_int], c_int),
        "kvq_matmul_packed": ([vp], c_int),
        "kvq_attention": ([vp], c_int),
        "kvq_attention_prompt": ([vp], c_int),
        "kvq_decode_step": ([vp], c_int),
        "kvq_decode_steps": ([vp, i64, vp, i64, vp, vp, vp], c_int),
        "kvq_sample_row": ([vp, i64, f32, i64, f32, f32, ctypes.c_double, vp], i64),
        "kvq_sample_work_bytes": ([i64], i64),
        "kvq_sample_probs": ([vp, i64, f32, i64, f32, f32, vp, vp], c_int),
        "kvq_sample_rows": ([vp, i64, i64, vp, vp, vp, vp, vp, vp, i64, vp, c_int], c_int),
        "kvq_argmax_rows": ([vp, i64, i64, vp], None),
        "kvq_embed_rows": ([vp, i64, c_int, vp, vp, i64, i64, i64, vp], c_int),
        "kvq_rms_norm": ([vp, i64, i64, vp, vp, i64, i64, f32, c_int], None),
        "kvq_moe_route": ([vp, i64, i64, i64, c_int, vp, vp], c_int),
        "kvq_layer_norm": ([vp, i64, i64, vp, vp, vp, i64, i64, f32, c_int], None),
        "kvq_silu_mul_rows": ([vp, i64, i64, i64, vp, c_int], None),
        "kvq_gelu": ([vp, vp, i64, c_int, c_int], None),
        "kvq_rope_rows": ([vp, i64, i64, i64, i64, vp, vp, c_int], None),
        "kvq_kv_store": ([vp, i64, i64, i64, i64, vp, i64, vp, vp, c_int], None),
        "kvq_fp8_value": ([ctypes.c_uint8], ctypes.c_float),
        "kvq_level": ([], c_int),
        "kvq_amx_enable": ([c_int], c_int),
        "kvq_activation_bits": ([c_int], c_int),
        "kvq_prefetch_l2": ([], c_int),
        "kvq_amx_min_rows": ([], c_int),
        "kvq_amx_tiles_bytes": ([i64, i64, c_int], i64),
        "kvq_amx_tiles_pack": ([vp, i64, i64, i64, c_int, vp, c_int], c_int),
        "kvq_kept_rows": ([vp, i64, i64, c_int, vp, i64, vp, i64], c_int),
        "kvq_amx_bf16_enable": ([c_int], c_int),
        "kvq_matmul_prompt": ([vp, i64, i64, i64, vp, i64, i64, c_int, vp, vp, vp, i64, c_int], c_int),
        "kvq_max_threads": ([], c_int),
        "kvq_abi_layout": ([ctypes.c_char_p, ctypes.c_char_p], i64),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res

