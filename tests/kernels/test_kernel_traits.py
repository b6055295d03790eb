"""The C side's table of weight types (kernels/types.h, read through kvq_type_traits) against what the Python side
and the gguf package say: type ids, elements and bytes per block, and at which levels a weight is kept in a
copy laid out for the level's route."""
from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import gguf  # a hard dependency: if missing, these tests must fail, not skip
import pytest
import torch

import kvinfer.kernels as kernels
from kvinfer.kernels import abi

FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
EBADTYPE = -1


def _levels() -> list[str]:
    if not kernels.available():
        pytest.fail(kernels.unavailable_reason() or "kernels unavailable")
    best = kernels.LEVELS.index(kernels.best_level())
    return list(kernels.LEVELS[:best + 1])


def _traits(level: str, qt: int) -> tuple[int, int, int]:
    lib = kernels.library(level).lib
    fn = lib.kvq_type_traits
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    n, b = ctypes.c_int64(-7), ctypes.c_int64(-7)
    rc = fn(qt, ctypes.byref(n), ctypes.byref(b))
    return rc, n.value, b.value


def _tiles_bytes(level: str, n: int, k: int, qt: int) -> int:
    fn = kernels.library(level).lib.kvq_amx_tiles_bytes
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return fn(n, k, qt)


@pytest.mark.parametrize("qtype", sorted(kernels.QTYPES))
def test_quantised_types_match_python_and_gguf(qtype):
    qt = kernels.QTYPES[qtype]
    want = abi._BLOCKS[qtype]
    assert gguf.GGMLQuantizationType[qtype].value == qt
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]] == want
    for level in _levels():
        rc, n, b = _traits(level, qt)
        assert rc in (0, 1), (level, qtype, rc)
        assert (n, b) == want, (level, qtype)


@pytest.mark.parametrize("name", sorted(FLOATS))
def test_float_types_are_blocks_of_one_element(name):
    qt = kernels.FLOAT_TYPES[FLOATS[name]]
    assert gguf.GGMLQuantizationType[name].value == qt
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (1, FLOATS[name].itemsize)
    for level in _levels():
        assert _traits(level, qt) == (0, 1, FLOATS[name].itemsize), (level, name)


def test_every_type_the_python_side_names_is_in_the_table_and_nothing_else():
    known = set(kernels.QTYPES.values()) | set(kernels.FLOAT_TYPES.values())
    for level in _levels():
        for qt in range(-2, 64):
            rc, n, b = _traits(level, qt)
            if qt in known:
                assert rc >= 0, (level, qt)
            else:
                assert rc == EBADTYPE and (n, b) == (-7, -7), (level, qt)  # outputs untouched


def test_kept_support_matches_what_the_level_packs():
    """A type the table keeps at a level gets a copy of nonzero size there; every other type none (shape: 48 rows
    of 512 elements, a whole number of every family's blocks)."""
    for level in _levels():
        kept = set()
        for name, qt in {**kernels.QTYPES, **{f: kernels.FLOAT_TYPES[t] for f, t in FLOATS.items()}}.items():
            rc, _, _ = _traits(level, qt)
            assert (_tiles_bytes(level, 48, 512, qt) > 0) == (rc == 1), (level, name)
            if rc == 1:
                kept.add(name)
        if level == "generic":
            assert kept == set()
        elif level == "avx2":
            assert kept == {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
        else:
            assert kept == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                            "IQ4_XS"}


def _amd_family_19h() -> bool:
    info = Path("/proc/cpuinfo").read_text() if sys.platform == "linux" else ""
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", info, re.M)
    family = re.search(r"^cpu family\s*:\s*(\d+)", info, re.M)
    return bool(vendor and family and vendor.group(1) == "AuthenticAMD" and int(family.group(1)) == 0x19)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/cpuinfo")
def test_kept_copies_are_prefetched_into_l2_on_amd_family_19h_only():
    """Every level asks for the kept copies ahead into L2 on AMD's family 19h (Zen 3, Zen 4), where bursts of
    prefetcht0 stalled decode (docs/BENCHMARKS.md), and into L1 on every other CPU; describe() says which."""
    want = _amd_family_19h()
    for level in _levels():
        assert kernels.library(level).prefetch_l2 is want, level
    line = kernels.describe()
    assert ("prefetched into L2" in line) is (want and "kept in" in line), line
