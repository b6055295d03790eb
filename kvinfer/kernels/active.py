"""The loaded libraries and the active one, chosen once (levels.wanted_level); the module-level calls
(kvinfer.kernels.matmul, attention, ...) and PreparedMatmul go to it. available() never raises."""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

import torch

from . import levels
from .abi import _MATMUL_ARGS, FLOAT_TYPES, QTYPES, DecodeJob, Sampling, _check, _declare, _short_rows
from .build import LEVEL_FLAGS, LEVELS, build
from .kept import KeptTiles
from .ops import Kernels

_lock = threading.Lock()
_active: Optional[Kernels] = None
_reason: Optional[str] = None
_tried = False
_loaded: dict[str, Kernels] = {}
_activation_bits = 16  # set_activation_bits: every loaded library and those loaded later


def library(level_name: str) -> Kernels:
    """The library of one level (built on first use). Raises RuntimeError when this CPU cannot run it or it
    cannot be built."""
    if level_name not in LEVELS:
        raise ValueError(f"ISA level must be one of {', '.join(LEVELS)}, not {level_name!r}")
    if LEVELS.index(level_name) > LEVELS.index(levels.best_level()):
        raise RuntimeError(f"this CPU (or its OS) cannot run the {level_name} level (best: {levels.best_level()})")
    lib = _loaded.get(level_name)
    if lib is None:
        lib = _loaded[level_name] = Kernels(level_name, build(flags=LEVEL_FLAGS[level_name]))
        # (the library's switch is process-wide, so it is set either way: a reload may find it on)
        lib.set_amx(level_name == "avx512" and levels.cpu_features()["amx_granted"] and levels.amx_wanted())
        lib.set_activation_bits(_activation_bits)
        lib.set_prompt_route(lib.amx and levels.prompt_route_wanted())
    return lib


def activation_bits() -> int:
    """The bits activations are rounded to where they meet quantised weights: 16 (default) or 8."""
    return _activation_bits


def set_activation_bits(bits: int) -> None:
    """16 or 8, for every level's library in this process (each is process-wide state of its library), so that
    every route and level keeps giving the same bits. 8: llama.cpp's precision; the K-quant byte routes then skip
    half their products (docs/KQUANTS.md)."""
    global _activation_bits
    if bits not in (8, 16):
        raise ValueError(f"activation bits must be 16 or 8, not {bits!r}")
    with _lock:
        _activation_bits = bits
        for lib in _loaded.values():
            lib.set_activation_bits(bits)
            lib.set_prompt_route(lib.amx and levels.prompt_route_wanted())


def _init() -> None:
    global _active, _reason, _tried
    with _lock:
        if _tried:
            return
        _tried = True
        try:
            _active = library(levels.wanted_level())
        except Exception as e:  # never raise at import or from available(): report instead
            _reason = f"CPU kernels unavailable: {e}"


def available() -> bool:
    """True when a kernel library is loaded (builds it on the first call)."""
    if not _tried:
        _init()
    return _active is not None


def unavailable_reason() -> Optional[str]:
    _init()
    return _reason


def active() -> Kernels:
    if not available():
        raise RuntimeError(_reason)
    return _active


def level() -> Optional[str]:
    """The ISA level in use, or None when the kernels are off."""
    return _active.level if available() else None


def library_path() -> Optional[Path]:
    return _active.path if available() else None


def describe() -> str:
    """One line for logs and `kvinfer models`: the level in use and what the CPU offers."""
    f = levels.cpu_features()
    cpu = ", ".join(k for k in ("avx2", "avx512") if f[k]) or "no AVX2"
    amx = "AMX granted" if f["amx_granted"] else "AMX listed but not granted by the OS" if f["amx_listed"] else "no AMX"
    if not available():
        return f"CPU kernels off ({unavailable_reason()}); CPU: {cpu}, {amx}"
    tiles = ""
    if _active.keeps_tiles and levels.keep_tiles_enabled():
        tiles = (", weights kept in tile layout" if _active.level == "avx512"
                 else ", K-quant weights kept in a byte layout")
    if _active.amx:
        tiles += f", AMX tiles from {_active.amx_min_rows} rows"
    if _active.prompt_route and levels.keep_tiles_enabled():
        tiles += ", prompt rows' matmuls and attention on AMX bfloat16 tiles"
    if tiles and _active.prefetch_l2:
        tiles += " (prefetched into L2)"
    return (f"CPU kernels: level {level()} (CPU: {cpu}, {amx}); matmul: int{_activation_bits}-rounded activations x "
            f"GGML blocks{tiles} (float weights: fp32 FMA), attention: in-place paged, fixed 256-position pieces")


def load(flags: Optional[list[str]] = None, cc: Optional[str] = None) -> ctypes.CDLL:
    """Build (if needed) and load a variant of the kernel library with other flags (tests)."""
    lib = ctypes.CDLL(str(build(cc, flags)))
    _declare(lib)
    return lib


def _reset() -> None:
    """Forget the loaded state so the next call builds and probes again (tests)."""
    global _active, _reason, _tried, _activation_bits
    with _lock:
        _active = _reason = None
        _tried = False
        _activation_bits = 16
        levels._forget()
        _loaded.clear()



# ---- module-level calls go to the active level ---------------------------------------------------------------
def matmul(x, w, qtype="F32", bias=None, out=None, num_threads=None, kept=None):
    return active().matmul(x, w, qtype, bias, out, num_threads, kept)


def attention(*args, **kwargs):
    return active().attention(*args, **kwargs)


def embed_rows(w, qtype, ids, dim, kept=None):
    return active().embed_rows(w, qtype, ids, dim, kept)


def rms_norm(x, weight, eps):
    return active().rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    return active().layer_norm(x, weight, bias, eps)


def moe_route(logits, top_k, renormalise):
    return active().moe_route(logits, top_k, renormalise)


def silu_mul(gu, inter):
    return active().silu_mul(gu, inter) if available() else None


def gelu(x, approximate="none"):
    return active().gelu(x, approximate)


def rope_pair_(q, k, cos, sin) -> bool:
    return available() and active().rope_pair_(q, k, cos, sin)


def decode_step(job: DecodeJob) -> None:
    active().decode_step(job)


def decode_steps(job: DecodeJob, nsteps: int, stop_ids: torch.Tensor, logits_all: torch.Tensor, tokens: torch.Tensor,
                 sampling: Optional[Sampling] = None) -> int:
    return active().decode_steps(job, nsteps, stop_ids, logits_all, tokens, sampling)


def sample_row(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    return active().sample_row(row, temperature, top_k, top_p, min_p, u)


class PreparedMatmul:
    """kvq_matmul for one weight with the constant arguments packed once (the per-call hot path of linears).

    run() takes raw pointers and trusts them: x float32 [m, k] and y float32 [m, n] contiguous. Each calling
    thread gets its own argument block. Create it only when available() is True. kept: w's copy from the active
    library's keep_tiles, passed in every call (this object holds the copy's tensor while it lives).
    """

    __slots__ = ("_fn", "_template", "_blocks", "_args", "_kept")

    def __init__(self, n: int, k: int, w: torch.Tensor, qtype: str = "F32", bias: Optional[torch.Tensor] = None,
                 kept: Optional[KeptTiles] = None):
        lib = active()
        if w.dtype == torch.uint8:
            qt = QTYPES[qtype]
            if _short_rows(qtype, k, w.shape[1]):
                raise ValueError(f"K={k} must be a multiple of 32 and fit in {w.shape[1]}-byte {qtype} rows")
            ldw = w.stride(0)
        else:
            qt = FLOAT_TYPES[w.dtype]
            ldw = w.stride(0) * w.element_size()
        kp = None if kept is None else kept.ptr_for(lib, w, n, k, qtype)
        self._args = (n, k, w, qtype, bias)  # (a copy unpickled has no kept copy: its caller makes one again)
        self._kept = None if kp is None else kept.tiles
        self._fn = lib.lib.kvq_matmul_packed
        self._template = (0, 0, k, k, w.data_ptr(), n, ldw, qt, bias.data_ptr() if bias is not None else 0, 0, n, 1,
                          kp or 0)
        self._blocks: dict[int, tuple] = {}

    def __reduce__(self):
        return PreparedMatmul, self._args

    def run(self, x_ptr: int, m: int, y_ptr: int, num_threads: int) -> None:
        blk = self._blocks.get(threading.get_ident())
        if blk is None:
            buf = _MATMUL_ARGS(*self._template)
            blk = self._blocks[threading.get_ident()] = (buf, ctypes.addressof(buf))
        buf, addr = blk
        buf[0] = x_ptr
        buf[1] = m
        buf[9] = y_ptr
        buf[11] = num_threads
        _check(self._fn(addr), "matmul")
