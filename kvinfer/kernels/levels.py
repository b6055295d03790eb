"""Which level runs: what the CPU and OS allow (dispatch.c's probe), the best level for them, the level asked for
(KVINFER_ISA, KVINFER_KERNELS), and the kernels' switches as kvinfer.options read them.

Levels: "generic" (portable C, any CPU), "avx2" (AVX2 + FMA + F16C), "avx512" (AVX-512 F/BW/VL/DQ + VNNI). The
best level the CPU reports AND the OS enables is used (dispatch.c, compiled without arch flags, probes cpuid and
XCR0); KVINFER_ISA=generic|avx2|avx512 asks for a lower one; at the avx512 level, quantised matmuls of 24 rows and
more run on AMX tiles where the OS grants them (KVINFER_AMX=0: not; the same bits either way), and quantised
weights are kept in a VNNI/tile layout that both routes read (KVINFER_AMX_KEEP=0: not); KVINFER_KERNELS=0 turns the
kernels off (the eager PyTorch path, which is not batch-invariant)."""
from __future__ import annotations

import ctypes
import logging
import platform
from typing import Optional

from kvinfer.options import options

from .build import DISPATCH_SOURCE, LEVELS, build

log = logging.getLogger("kvinfer.kernels")

_features: Optional[int] = None


def cpu_features() -> dict:
    """What the CPU and OS allow: {'avx2', 'avx512', 'amx_listed', 'amx_granted'} (all False off x86-64 or when
    the probe cannot be built)."""
    global _features
    if _features is None:
        bits = 0
        if platform.machine().lower() in ("x86_64", "amd64"):
            try:
                lib = ctypes.CDLL(str(build(flags=["-O2", "-shared", "-fPIC"], sources=[DISPATCH_SOURCE],
                                            name="libkvdispatch.so")))
                lib.kvq_cpu_features.restype = ctypes.c_int
                bits = lib.kvq_cpu_features()
            except (OSError, RuntimeError) as e:
                log.warning("CPU probe unavailable (%s): portable kernels only", e)
        _features = bits
    b = _features
    return {"avx2": bool(b & 1), "avx512": bool(b & 2), "amx_listed": bool(b & 4), "amx_granted": bool(b & 8)}


def best_level() -> str:
    f = cpu_features()
    return "avx512" if f["avx512"] else "avx2" if f["avx2"] else "generic"




def wanted_level() -> str:
    """The level to load: the best this CPU allows, or a lower one KVINFER_ISA asks for. RuntimeError when the
    kernels are switched off (KVINFER_KERNELS=0); OptionError when a switch holds a bad value."""
    opts = options()  # a bad KVINFER_ISA raises here, naming it
    if not opts.kernels:
        raise RuntimeError("disabled by KVINFER_KERNELS")
    want = best_level()
    forced = opts.isa
    if forced:
        if LEVELS.index(forced) > LEVELS.index(want):
            log.warning("KVINFER_ISA=%s is above what this CPU allows; using %s", forced, want)
        else:
            want = forced
    return want


def amx_wanted() -> bool:
    """Whether the avx512 level may switch the AMX tiles on (KVINFER_AMX)."""
    return options().amx


def prompt_route_wanted() -> bool:
    """Whether prompt rows may take the AMX bfloat16 route (KVINFER_PROMPT_BF16)."""
    return options().prompt_bf16


def drop_source_enabled() -> bool:
    """Whether the engine gives a kept weight's GGUF pages back once its copy is made (default; the copy holds
    every byte, so the process holds each weight once). KVINFER_DROP_SOURCE=0 keeps the GGUF rows beside the
    copy."""
    return options().drop_source


def keep_tiles_enabled() -> bool:
    """Whether quantised weights are kept in tile layout at the avx512 level (K-quants also at avx2) (default;
    KVINFER_AMX_KEEP=0 reads the GGML rows instead, unpacking them per call)."""
    return options().amx_keep


def batch_invariant() -> bool:
    """Whether every route keeps a row's result independent of how it is served (default; KVINFER_BATCH_INVARIANT=0
    lets prefill-sized steps take BLAS GEMMs and SDPA instead, which are faster on long prompts)."""
    return options().batch_invariant



def _forget() -> None:
    """Probe the CPU again on the next call (tests)."""
    global _features
    _features = None
