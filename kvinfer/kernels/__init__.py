"""CPU kernels compiled with gcc on first use: quantised matmul (GGML Q4_0/Q4_1/Q8_0 weights, float32
activations) and decode attention read in place from the paged KV cache."""
from __future__ import annotations

# The library is cached in $KVINFER_CACHE/kernels/<hash>/ ($KVINFER_CACHE defaults to ~/.cache/kvinfer, or
# $XDG_CACHE_HOME/kvinfer), keyed by the source, compiler and flags, so an edit of qgemv.c rebuilds it.
# $CC picks the compiler (default gcc); KVINFER_KERNELS=0 turns the kernels off.

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

# Imported before the library is loaded: torch brings its own libgomp.so.1, and our -fopenmp library then
# binds to that same runtime (same soname) instead of loading a second one, so both share one thread pool
# rather than two pools competing for the cores.
import torch

__all__ = ["QTYPES", "INT16_MAX_ROWS", "set_int16_max_rows", "available", "unavailable_reason", "qgemv", "PreparedMatmul", "paged_decode_attention", "decode_step",
           "silu_mul", "rope_pair_",
           "library_path", "build", "load"]

SOURCE = Path(__file__).with_name("qgemv.c")
SOURCES = [SOURCE, Path(__file__).with_name("paged_attn.c"), Path(__file__).with_name("decode_step.c")]  # one library
HEADERS = [Path(__file__).with_name("kernels.h")]
_LIBNAME = "libkvqgemv.so"
# Module attributes rather than constants so tests (and odd systems) can point them elsewhere.
CC = os.environ.get("CC") or "gcc"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]

# GGML type ids, as the C side takes them.
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
IMPLS = {"auto": 0, "scalar": 1, "avx2": 2, "avx2_i16": 3}
# "auto" takes the int16-activation route for up to this many rows of x (decode steps) and the float32 route
# for more (prefill). KVINFER_INT16=0 makes it 0: float32 activations everywhere, for A/B runs.
INT16_MAX_ROWS = 0 if os.environ.get("KVINFER_INT16", "1").strip().lower() in ("0", "false", "no", "off") else 7
_ERRORS = {-1: "unsupported quant type", -2: "bad shape", -3: "implementation not available on this CPU/build",
           -4: "out of memory", -5: "weight rows too short for K"}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_fn = None  # the prepared kvq_matmul
_path: Optional[Path] = None
_reason: Optional[str] = None
_tried = False


def _cache_root() -> Path:
    root = os.environ.get("KVINFER_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvinfer"


def _digest(cc: str, flags: list[str]) -> str:
    h = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS))
    h.update("\0".join([cc, *flags, platform.machine()]).encode())
    return h.hexdigest()[:16]


def _cpu_has_avx2() -> tuple[bool, str]:
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False, f"CPU architecture {platform.machine()} is not x86"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    missing = [x for x in ("avx2", "fma", "f16c") if x not in have]
                    if missing:
                        return False, f"CPU lacks {', '.join(missing)}"
                    return True, ""
    except OSError:
        pass
    # No /proc: trust torch's own dispatch probe.
    cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    return ("AVX2" in cap or "AVX512" in cap), f"torch reports CPU capability {cap}"


def build(cc: Optional[str] = None, flags: Optional[list[str]] = None, cache_dir: Optional[Path] = None) -> Path:
    """Compile the kernel library (unless already cached) and return its path; raises RuntimeError on failure.

    The .so goes to cache_dir, by default <cache>/kernels/<hash of source, compiler and flags>/ (under the
    system temp dir when the cache cannot be created). It is compiled to a temporary name in that directory
    and renamed into place, so concurrent processes never load a half-written file; a finished file is
    reused without needing a compiler.
    """
    cc = cc or CC
    flags = list(CFLAGS if flags is None else flags)
    if cache_dir is not None:
        out_dir = Path(cache_dir)
    else:
        out_dir = _cache_root() / "kernels" / _digest(cc, flags)
        user = os.getuid() if hasattr(os, "getuid") else "user"
        spare = Path(tempfile.gettempdir()) / f"kvinfer-{user}" / "kernels" / out_dir.name
        if not (out_dir / _LIBNAME).exists() and (spare / _LIBNAME).exists():
            out_dir = spare
    target = out_dir / _LIBNAME
    if target.exists():  # a cached build needs no compiler
        return target
    argv = shlex.split(cc)  # CC may carry a wrapper or options ("ccache gcc")
    exe = shutil.which(argv[0]) if argv else None
    if exe is None:
        raise RuntimeError(f"C compiler {cc!r} not found on PATH")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        if cache_dir is not None:
            raise
        out_dir = spare  # an unwritable home should not cost us the kernels
        target = out_dir / _LIBNAME
        out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libkvqgemv.", suffix=".so.tmp", dir=out_dir)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([exe, *argv[1:], *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{cc} could not run: {e}") from e
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_ARGS = ctypes.c_int64 * 12  # kvq_matmul_packed's argument block


def _declare(lib: ctypes.CDLL):
    fn = lib.kvq_matmul_packed
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    i64, c_int, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    # x, M, K, ldx, w, N, ldw, qtype, y, ldy, nthreads, impl
    lib.kvq_matmul.argtypes = [vp, i64, i64, i64, vp, i64, i64, c_int, vp, i64, c_int, c_int]
    lib.kvq_matmul.restype = c_int
    for name in ("kvq_paged_decode_packed", "kvq_decode_step_packed"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_int
    lib.kvq_set_i16_max_rows.argtypes = [i64]
    lib.kvq_set_i16_max_rows.restype = i64
    lib.kvq_silu_mul_rows.argtypes = [vp, i64, i64, i64, vp, c_int]
    lib.kvq_silu_mul_rows.restype = None
    lib.kvq_rope_rows.argtypes = [vp, i64, i64, i64, i64, vp, vp, c_int]
    lib.kvq_rope_rows.restype = None
    for name in ("kvq_built_with_avx2", "kvq_cpu_has_avx2", "kvq_max_threads"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = c_int
    return fn


def load(cc: Optional[str] = None, flags: Optional[list[str]] = None) -> ctypes.CDLL:
    """Build (if needed) and load a variant of the library; for tests of other flag sets. Raises on failure."""
    lib = ctypes.CDLL(str(build(cc, flags)))
    _declare(lib)
    return lib


def _init() -> None:
    global _lib, _fn, _path, _reason, _tried
    with _lock:
        if _tried:
            return
        _tried = True
        try:
            if os.environ.get("KVINFER_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
                raise RuntimeError("disabled by KVINFER_KERNELS")  # for A/B runs against the float32 path
            ok, why = _cpu_has_avx2()
            if not ok:
                # The library's scalar route would be slower than torch's float32 GEMM: not worth offering.
                raise RuntimeError(why)
            path = build()
            lib = ctypes.CDLL(str(path))
            fn = _declare(lib)
            if not lib.kvq_built_with_avx2() or not lib.kvq_cpu_has_avx2():
                raise RuntimeError("library built without AVX2, or the CPU cannot run it")
            lib.kvq_set_i16_max_rows(INT16_MAX_ROWS)
            _lib, _fn, _path = lib, fn, path
        except Exception as e:  # never raise at import or from available(): report instead
            _reason = f"quantised kernels unavailable: {e}"


def set_int16_max_rows(rows: int) -> int:
    """Make "auto" take the int16 route for up to `rows` rows of x (0: never); returns the previous setting.
    Process-wide; not to be called while kernels run on other threads."""
    global INT16_MAX_ROWS
    if not available():
        raise RuntimeError(unavailable_reason())
    old, INT16_MAX_ROWS = INT16_MAX_ROWS, max(0, int(rows))
    _lib.kvq_set_i16_max_rows(INT16_MAX_ROWS)
    return old


def available() -> bool:
    """True when the compiled kernels can be used (compiles them on the first call)."""
    if not _tried:
        _init()
    return _fn is not None


def unavailable_reason() -> Optional[str]:
    """Why available() is False (None when it is True)."""
    _init()
    return _reason


def library_path() -> Optional[Path]:
    """The loaded .so (None when unavailable)."""
    _init()
    return _path


def _reset() -> None:
    """Forget the loaded library so the next call builds again (tests use it after changing CC)."""
    global _lib, _fn, _path, _reason, _tried
    with _lock:
        _lib = _fn = _path = _reason = None
        _tried = False


_tls = threading.local()


def _args() -> tuple:
    """This thread's argument block and its address (one per thread, so concurrent callers never share)."""
    a = getattr(_tls, "a", None)
    if a is None:
        buf = _ARGS()
        a = _tls.a = (buf, ctypes.addressof(buf))
    return a


class PreparedMatmul:
    """kvq_matmul for one weight shape with the constant arguments packed once (QuantLinear's fast path).

    run() takes raw pointers and trusts them: x float32 [m, k] and y float32 [m, n] contiguous, w the uint8
    [n, row_bytes] rows. Each calling thread gets its own argument block, so concurrent calls are safe.
    Create it only when available() is True.
    """

    __slots__ = ("_args", "_template", "_blocks")

    def __init__(self, n: int, k: int, row_bytes: int, qtype: str):
        if _fn is None:
            raise RuntimeError(unavailable_reason())
        self._args = (n, k, row_bytes, qtype)
        qt = QTYPES[qtype]
        if k % 32 or row_bytes < k // 32 * _BLOCK_BYTES[qtype]:
            raise ValueError(f"K={k} must be a multiple of 32 and fit in {row_bytes}-byte {qtype} rows")
        self._template = (0, 0, k, k, 0, n, row_bytes, qt, 0, n, 1, IMPLS["auto"])
        self._blocks: dict[int, tuple] = {}

    def __reduce__(self):
        # Copies and pickles start with no argument blocks: a copied block address would point into the
        # original's memory.
        return PreparedMatmul, self._args

    def run(self, x_ptr: int, m: int, w_ptr: int, y_ptr: int, num_threads: int) -> None:
        blk = self._blocks.get(threading.get_ident())
        if blk is None:
            buf = _ARGS(*self._template)
            blk = self._blocks[threading.get_ident()] = (buf, ctypes.addressof(buf))
        buf, addr = blk
        buf[0] = x_ptr
        buf[1] = m
        buf[4] = w_ptr
        buf[8] = y_ptr
        buf[10] = num_threads
        rc = _fn(addr)
        if rc:
            raise RuntimeError(f"kvq_matmul failed: {_ERRORS.get(rc, rc)}")


def qgemv(x: torch.Tensor, w_raw: torch.Tensor, qtype: str, out: Optional[torch.Tensor] = None,
          num_threads: Optional[int] = None, impl: str = "auto") -> torch.Tensor:
    """y[M, N] = x[M, K] @ W^T for W given as raw GGML rows w_raw (uint8 [N, row_bytes]) of type qtype.

    x: float32 [M, K] with unit stride along K (rows may be strided); out, if given: float32 [M, N] with unit
    column stride. num_threads defaults to torch.get_num_threads(), so torch.set_num_threads governs both.
    impl: "auto" ("avx2_i16" for up to INT16_MAX_ROWS rows, else "avx2"), "scalar", "avx2" (float32 x: equal to
    x @ dequantize(W)^T up to summation order) or "avx2_i16" (x rounded per 32-block to 16 bits, integer dot
    products: 1.6-1.8x faster at one row, error ~5e-5 of max|y|).
    Raises RuntimeError when the kernels are unavailable (check available() first), ValueError on bad input.
    """
    if _fn is None:
        _init()
        if _fn is None:
            raise RuntimeError(_reason)
    qt = QTYPES.get(qtype)
    if qt is None:
        raise ValueError(f"qgemv supports {', '.join(QTYPES)}, not {qtype}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, not {impl!r}")
    if x.dtype != torch.float32 or x.dim() != 2 or (x.stride(1) != 1 and x.shape[1] > 1):
        raise ValueError(f"x must be a float32 [M, K] tensor with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    if w_raw.dtype != torch.uint8 or w_raw.dim() != 2 or w_raw.stride(1) != 1:
        raise ValueError("w_raw must be a uint8 [N, row_bytes] tensor with contiguous rows")
    if x.device.type != "cpu" or w_raw.device.type != "cpu":
        raise ValueError("qgemv runs on CPU tensors only")
    M, K = x.shape
    N, row_bytes = w_raw.shape
    if K % 32 or row_bytes < K // 32 * _BLOCK_BYTES[qtype]:
        raise ValueError(f"K={K} must be a multiple of 32 and fit in {row_bytes}-byte {qtype} rows")
    if out is None:
        out = torch.empty((M, N), dtype=torch.float32)
    elif (out.dtype != torch.float32 or tuple(out.shape) != (M, N) or (out.stride(1) != 1 and N > 1)
          or out.device.type != "cpu"):
        raise ValueError(f"out must be a float32 CPU tensor of shape {(M, N)} with unit column stride")
    buf, addr = _args()
    # A size-1 dim's stride is arbitrary; the C side checks ld >= row length, so give it the row length.
    buf[:] = (x.data_ptr(), M, K, x.stride(0) if M > 1 else K, w_raw.data_ptr(), N,
              w_raw.stride(0) if N > 1 else row_bytes, qt, out.data_ptr(), out.stride(0) if M > 1 else N,
              torch.get_num_threads() if num_threads is None else num_threads, IMPLS[impl])
    rc = _fn(addr)
    if rc:
        raise RuntimeError(f"kvq_matmul failed: {_ERRORS.get(rc, rc)}")
    return out


_PA_ERRORS = {-2: "bad shape or sequence length", -4: "out of memory", -6: "block id outside the pool"}
_DS_ERRORS = {**_ERRORS, -6: "block id or slot outside the pool", -2: "bad shape or sequence length"}
_PA_ARGS = ctypes.c_int64 * 17


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None,
                           alibi_slopes: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                           num_threads: Optional[int] = None) -> torch.Tensor:
    """One query token per sequence attending to its whole paged cache, read in place (no gather).

    q float32 [B, H, D]; k_pool / v_pool float32 [num_blocks, block_size, kv_heads, D]; tables int64 [B, T]
    block ids; lens int64 [B] cached tokens per sequence (this step's included, >= 1); alibi_slopes float32
    [H] or None; sliding_window: attend only to the last that many positions. Returns float32 [B, H, D].
    All tensors must be contiguous CPU tensors; raises ValueError on bad input, RuntimeError when the kernels
    are unavailable.
    """
    if _fn is None:
        _init()
        if _fn is None:
            raise RuntimeError(_reason)
    B, H, D = q.shape
    NB, BS, KVH, D2 = k_pool.shape
    for name, t, dt in (("q", q, torch.float32), ("k_pool", k_pool, torch.float32), ("v_pool", v_pool, torch.float32),
                        ("tables", tables, torch.int64), ("lens", lens, torch.int64)):
        if t.dtype != dt or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous {dt} CPU tensor, got {t.dtype} {tuple(t.shape)}")
    if v_pool.shape != k_pool.shape or D2 != D or H % KVH or tables.dim() != 2 or tables.shape[0] != B \
            or tuple(lens.shape) != (B,):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, pools {tuple(k_pool.shape)}, "
                         f"tables {tuple(tables.shape)}, lens {tuple(lens.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(q.shape)}")
    slopes = 0
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
        if tuple(alibi_slopes.shape) != (H,):
            raise ValueError(f"alibi_slopes must have shape ({H},)")
        slopes = alibi_slopes.data_ptr()
    args = _PA_ARGS(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                    out.data_ptr(), slopes, B, H, KVH, D, BS, tables.shape[1], NB, sliding_window or 0,
                    _f32_bits(scale), torch.get_num_threads() if num_threads is None else num_threads)
    rc = _lib.kvq_paged_decode_packed(ctypes.addressof(args))
    if rc:
        raise RuntimeError(f"paged decode attention failed: {_PA_ERRORS.get(rc, rc)}")
    return out


def silu_mul(gu: torch.Tensor, inter: int) -> Optional[torch.Tensor]:
    """silu(gu[:, :inter]) * gu[:, inter:] in one pass, for a float32 CPU [tokens, 2 * inter] tensor with
    contiguous rows; None when the kernels are unavailable or the tensor does not fit (the caller falls back)."""
    if (gu.dtype != torch.float32 or gu.device.type != "cpu" or gu.dim() != 2 or gu.shape[1] != 2 * inter
            or gu.stride(1) != 1 or not available()):
        return None
    out = torch.empty((gu.shape[0], inter), dtype=torch.float32)
    _lib.kvq_silu_mul_rows(gu.data_ptr(), gu.shape[0], inter, gu.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def _rope_fits(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0 and tuple(cos.shape) == (x.shape[0], x.shape[2] // 2))


def rope_pair_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate-half RoPE applied in place to q [tokens, heads, dim] and k [tokens, kv_heads, dim] (float32 CPU,
    heads contiguous within a row) with cos/sin float32 contiguous [tokens, dim / 2]. Returns False, touching
    neither, when the kernels are unavailable or a layout does not fit (the caller falls back)."""
    if (not available() or cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_contiguous()
            or not sin.is_contiguous() or sin.shape != cos.shape or not _rope_fits(q, cos) or not _rope_fits(k, cos)):
        return False
    nt = torch.get_num_threads()
    for x in (q, k):
        _lib.kvq_rope_rows(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2], cos.data_ptr(),
                           sin.data_ptr(), nt)
    return True


DECODE_LAYER_FIELDS = 16  # int64 columns of decode_step's layer table (see decode_step.c)


def decode_step(args: "ctypes.Array") -> None:
    """Run kvq_decode_step_packed on a prepared int64 argument block (kvinfer.models.fused_decode builds it)."""
    rc = _lib.kvq_decode_step_packed(ctypes.addressof(args))
    if rc:
        raise RuntimeError(f"fused decode step failed: {_DS_ERRORS.get(rc, rc)}")
