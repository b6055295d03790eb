"""Every ctypes mirror in kvinfer.kernels.abi against the C struct it mirrors: the size and each field's offset as
the compiler lays them out (kvq_abi_layout, abi.c), at every level this CPU runs."""
from __future__ import annotations

import ctypes
import inspect

import pytest

from kvinfer.kernels import abi
import kvinfer.kernels as kernels

STRUCTS = [c for _, c in inspect.getmembers(abi, inspect.isclass)
           if issubclass(c, ctypes.Structure) and c.__module__ == abi.__name__]


def levels():
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    best = kernels.LEVELS.index(kernels.best_level())
    return [kernels.library(lv) for lv in kernels.LEVELS[:best + 1]]


def mismatches(lib, cls) -> list[str]:
    """Where cls differs from the C struct it names (cls.c_struct): its size, then each field's offset."""
    layout = lib.lib.kvq_abi_layout
    name = cls.c_struct.encode()
    bad = []
    if layout(name, None) != ctypes.sizeof(cls):
        bad.append(f"{cls.__name__}: {ctypes.sizeof(cls)} bytes, struct {cls.c_struct} {layout(name, None)}")
    for field, _ in cls._fields_:
        c_off, py_off = layout(name, field.encode()), getattr(cls, field).offset
        if c_off != py_off:
            bad.append(f"{cls.__name__}.{field}: offset {py_off}, C {c_off}")
    return bad


def test_every_structure_names_its_c_struct():
    assert {c.__name__ for c in STRUCTS} >= {"AttnJob", "DecodePart", "DecodeLayer", "DecodeJob", "Sampling"}
    for cls in STRUCTS:
        assert isinstance(getattr(cls, "c_struct", None), str), f"{cls.__name__} names no C struct"


def test_mirrors_match_c_layouts_at_every_level():
    for lib in levels():
        bad = [m for cls in STRUCTS for m in mismatches(lib, cls)]
        assert not bad, f"{lib.level}: " + "; ".join(bad)
        assert lib.lib.kvq_abi_layout(b"KVQ_MAX_PARTS", None) == abi.MAX_PARTS


def test_a_reordered_or_short_mirror_is_caught():
    lib = levels()[0]
    fields = list(abi.AttnJob._fields_)
    swapped = fields[:2][::-1] + fields[2:]  # q and out trade places: same size, other offsets
    short = fields[:-1]                      # the C struct has a field more than this mirror
    for name, fs in (("Swapped", swapped), ("Short", short)):
        cls = type(name, (ctypes.Structure,), {"c_struct": "kvq_attn", "_fields_": fs})
        assert mismatches(lib, cls), name
    # A field the C table does not know, and a struct it does not know, read as -1.
    assert lib.lib.kvq_abi_layout(b"kvq_attn", b"no_such_field") == -1
    assert lib.lib.kvq_abi_layout(b"no_such_struct", None) == -1
    assert lib.lib.kvq_abi_layout(b"kvq_attn", b"") == ctypes.sizeof(abi.AttnJob)
