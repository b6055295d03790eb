"""CPU kernels in C, built per ISA level with gcc on first use and chosen once at start-up: matmuls over GGML
quantised or float weights, attention over the KV cache read in place, the decoder's row operations and a fused
decode step. Every level computes the same bits (see simd.h)."""
from __future__ import annotations

# Levels: "generic" (portable C, any CPU), "avx2" (AVX2 + FMA + F16C), "avx512" (AVX-512 F/BW/VL/DQ + VNNI). The
# best level the CPU reports AND the OS enables is used (dispatch.c, compiled without arch flags, probes cpuid
# and XCR0); KVINFER_ISA=generic|avx2|avx512 asks for a lower one; at the avx512 level, quantised matmuls of 24
# rows and more run on AMX tiles where the OS grants them (KVINFER_AMX=0: not; the same bits either way), and
# quantised weights are kept in a VNNI/tile layout that both routes read (KVINFER_AMX_KEEP=0: not);
# KVINFER_KERNELS=0 turns the kernels off (the eager PyTorch path, which is not batch-invariant). Libraries are
# cached in $KVINFER_CACHE/kernels/<hash>/ ($KVINFER_CACHE defaults to ~/.cache/kvinfer, or
# $XDG_CACHE_HOME/kvinfer), keyed by level, sources, compiler and flags. $CC picks the compiler (default gcc).

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

from kvinfer.config import KV_8BIT

# Imported before a library is loaded: torch brings its own libgomp.so.1, and our -fopenmp library then binds to
# that same runtime (same soname) instead of loading a second one, so both share one thread pool.
import torch

__all__ = ["LEVELS", "QTYPES", "available", "unavailable_reason", "level", "cpu_features", "library", "Kernels",
           "batch_invariant", "matmul", "PreparedMatmul", "attention", "embed_rows", "rms_norm", "layer_norm",
           "silu_mul", "gelu", "rope_pair_", "decode_step", "decode_steps", "sample_row", "DecodeLayer", "DecodeJob",
           "Sampling", "library_path", "build", "load", "describe"]

log = logging.getLogger("kvinfer.kernels")

HERE = Path(__file__).parent
DISPATCH_SOURCE = HERE / "dispatch.c"
# Every level's library: each concern's source, the AMX routes in amx/ (empty below the avx512 level); dispatch.c is
# built on its own, without arch flags.
SOURCES = [p for p in sorted(HERE.glob("*.c")) + sorted(HERE.glob("amx/*.c")) if p != DISPATCH_SOURCE]
HEADERS = sorted(HERE.glob("*.h")) + sorted(HERE.glob("amx/*.h"))
CC = os.environ.get("CC") or "gcc"
LEVELS = ("generic", "avx2", "avx512")
_COMMON = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
LEVEL_FLAGS = {
    "generic": _COMMON + ["-DKVQ_LEVEL=0"],
    "avx2": _COMMON + _AVX2 + ["-DKVQ_LEVEL=1"],
    # 256-bit vectors on purpose: a reduction's lane count is part of its result (and wide vectors cost clock).
    "avx512": _COMMON + _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                                 "-mamx-tile", "-mamx-int8", "-mprefer-vector-width=256", "-DKVQ_LEVEL=2"],
}

# GGML type ids, as the C side takes them: quantised (32-element blocks; K-quants, 256-element super-blocks, in
# kquants.c) and float rows.
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_XS": 23}
FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
# KV cache element types: float32, 8-bit values with a float32 scale per group of 32 values of a row (KV_SCALED),
# or bfloat16.
KV_DTYPES = {"float32": 0, "int8": 1, "fp8": 2, "bfloat16": 3}
KV_STORAGE = {"int8": torch.int8, "fp8": torch.uint8, "bfloat16": torch.bfloat16}  # fp8 = e4m3 bit patterns
KV_SCALED = KV_8BIT
# (elements, bytes) per block, as ggml_blocks.h and qmatmul.c have them.
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
           "Q6_K": (256, 210), "IQ4_XS": (256, 136), "Q3_K": (256, 110),
           "Q2_K": (256, 84)}


def _short_rows(qtype: str, k: int, row_bytes: int) -> bool:
    """Whether k is not a whole number of qtype's blocks, or rows of row_bytes cannot hold them."""
    n, b = _BLOCKS[qtype]
    return k % n != 0 or row_bytes < k // n * b
_EBADSHAPE = -2
_EBADTYPE = -1  # KVQ_EBADTYPE: also "not a job this route takes" (kvq_attention_prompt)
_ERRORS = {-1: "unsupported weight type", -2: "bad shape or position", -4: "out of memory",
           -5: "weight rows too short for K", -6: "block id or slot outside the pool"}


def _cache_root() -> Path:
    root = os.environ.get("KVINFER_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvinfer"


def _off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def build(cc: Optional[str] = None, flags: Optional[list[str]] = None, cache_dir: Optional[Path] = None,
          sources: Optional[list[Path]] = None, name: str = "libkvinfer.so") -> Path:
    """Compile a library (unless already cached) and return its path; raises RuntimeError on failure.

    Defaults: the kernel sources with the avx2 level's flags. The .so goes to cache_dir, by default
    <cache>/kernels/<hash of sources, compiler and flags>/ (under the system temp dir when the cache cannot be
    created). It is compiled to a temporary name and renamed into place, so concurrent processes never load a
    half-written file; a finished file is reused without needing a compiler.
    """
    cc = cc or CC
    flags = list(LEVEL_FLAGS["avx2"] if flags is None else flags)
    sources = list(SOURCES if sources is None else sources)
    h = hashlib.sha256(b"".join(p.read_bytes() for p in sources + HEADERS))
    h.update("\0".join([cc, *flags, platform.machine()]).encode())
    digest = h.hexdigest()[:16]
    user = os.getuid() if hasattr(os, "getuid") else "user"
    spare = Path(tempfile.gettempdir()) / f"kvinfer-{user}" / "kernels" / digest
    out_dir = Path(cache_dir) if cache_dir is not None else _cache_root() / "kernels" / digest
    if cache_dir is None and not (out_dir / name).exists() and (spare / name).exists():
        out_dir = spare
    target = out_dir / name
    if target.exists():
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
        out_dir, target = spare, spare / name  # an unwritable home should not cost us the kernels
        out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([exe, *argv[1:], *flags, "-o", tmp, *map(str, sources), "-lm"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{cc} could not run: {e}") from e
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# ---- the C structs, mirrored -------------------------------------------------------------------------------
_i64, _f32, _i32, _vp = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


class AttnJob(ctypes.Structure):
    _fields_ = [(n, _vp) for n in ("q", "out", "k", "v", "k_scale", "v_scale", "tables", "tok_seq", "tok_pos",
                                   "slopes")] + \
               [(n, _i64) for n in ("T", "H", "KVH", "D", "BS", "NB", "table_stride", "q_stride", "out_stride",
                                    "block_stride", "tok_stride", "head_stride", "window")] + \
               [("scale", _f32), ("nthreads", _i32), ("kv_dtype", _i32)]


class DecodePart(ctypes.Structure):
    """struct kvq_part: one part of a fused projection whose parts differ in type."""
    _fields_ = [("w", _vp), ("rows", _i64), ("ldw", _i64), ("qt", _i32)]


MAX_PARTS = 3  # KVQ_MAX_PARTS


class DecodeLayer(ctypes.Structure):
    _fields_ = [(n, _vp) for n in ("attn_norm", "ffn_norm", "qkv", "o", "gate_up", "down")] + \
               [(n, _i64) for n in ("qkv_ldw", "o_ldw", "gate_up_ldw", "down_ldw")] + \
               [(n, _i32) for n in ("qkv_qt", "o_qt", "gate_up_qt", "down_qt")] + \
               [(n, _vp) for n in ("kpool", "vpool", "kscale", "vscale")] + \
               [("qkv_parts", DecodePart * MAX_PARTS), ("gate_up_parts", DecodePart * MAX_PARTS),
                ("qkv_nparts", _i32), ("gate_up_nparts", _i32)]


class DecodeJob(ctypes.Structure):
    _fields_ = [(n, _vp) for n in ("x", "layers", "cos", "sin", "slots", "tables", "lens")] + \
               [(n, _i64) for n in ("B", "hidden", "H", "KVH", "D", "inter", "L", "T", "BS", "NB", "window",
                                    "rope_rows")] + \
               [("eps", _f32), ("scale", _f32), ("nthreads", _i32), ("kv_dtype", _i32)] + \
               [("ids", _vp), ("embed", _vp), ("embed_ldw", _i64), ("vocab", _i64), ("embed_qt", _i32),
                ("final_eps", _f32), ("final_norm", _vp), ("out", _vp), ("head", _vp), ("head_ldw", _i64),
                ("head_rows", _i64), ("head_qt", _i32), ("logits", _vp)]


class Sampling(ctypes.Structure):
    """struct kvq_sampling: per sequence of a multi-step call, how its next token is chosen (pointers to arrays)."""
    _fields_ = [(n, _vp) for n in ("temperature", "top_k", "top_p", "min_p", "u")]


_MATMUL_ARGS = ctypes.c_int64 * 12


def _declare(lib: ctypes.CDLL) -> None:
    i64, c_int, vp, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    sig = {
        "kvq_matmul": ([vp, i64, i64, i64, vp, i64, i64, c_int, vp, vp, i64, c_int], c_int),
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
        "kvq_embed_rows": ([vp, i64, c_int, vp, i64, i64, i64, vp], c_int),
        "kvq_rms_norm": ([vp, i64, i64, vp, vp, i64, i64, f32, c_int], None),
        "kvq_layer_norm": ([vp, i64, i64, vp, vp, vp, i64, i64, f32, c_int], None),
        "kvq_silu_mul_rows": ([vp, i64, i64, i64, vp, c_int], None),
        "kvq_gelu": ([vp, vp, i64, c_int, c_int], None),
        "kvq_rope_rows": ([vp, i64, i64, i64, i64, vp, vp, c_int], None),
        "kvq_kv_store": ([vp, i64, i64, i64, i64, vp, i64, vp, vp, c_int], None),
        "kvq_fp8_value": ([ctypes.c_uint8], ctypes.c_float),
        "kvq_level": ([], c_int),
        "kvq_amx_enable": ([c_int], c_int),
        "kvq_amx_min_rows": ([], c_int),
        "kvq_amx_tiles_bytes": ([i64, i64, c_int], i64),
        "kvq_amx_tiles_pack": ([vp, i64, i64, i64, c_int, vp, c_int], c_int),
        "kvq_kept_rows": ([vp, i64, i64, c_int, vp, i64, vp, i64], c_int),
        "kvq_kept_lookup": ([vp, i64, i64, i64, c_int], vp),
        "kvq_amx_tiles_register": ([vp, i64, i64, i64, c_int, vp], c_int),
        "kvq_amx_bf16_enable": ([c_int], c_int),
        "kvq_matmul_prompt": ([vp, i64, i64, i64, vp, i64, i64, c_int, vp, vp, i64, c_int], c_int),
        "kvq_max_threads": ([], c_int),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


# Types whose kept copy holds every byte of the GGUF rows (kvq_kept_rows reads them back), so the rows themselves
# need not stay resident; and the source bytes packed at a time when they are dropped (the peak above the copy).
_DROPPABLE = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})
_DROP_CHUNK_BYTES = 32 << 20
_MADV_DONTNEED = 4


def _drop_pages(addr: int, nbytes: int) -> None:
    """Gives the whole pages of [addr, addr + nbytes) back to the OS (private memory: they read as zeros, or as the
    file's bytes for a private file mapping, until written again). The caller restores them before any read."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    a, b = -(-addr // page) * page, (addr + nbytes) // page * page
    if b > a:
        _libc().madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC.madvise.restype = ctypes.c_int
    return _LIBC


class KeptTiles:
    """A weight's copy in AMX tile layout, registered with the library under the weight's address (by
    Kernels.keep_tiles) for as long as this object lives. It holds the weight too, so that the address cannot be
    reused meanwhile; the weight's bytes must not change while it is kept.

    With dropped set, the weight's own pages were given back once packed (every kernel that reads the weight finds
    the copy: matmuls and embedding rows); restore_source() writes the GGUF bytes back from the copy for readers
    outside the kernels (dequantization, sharding), and release() does so before unregistering."""

    __slots__ = ("_lib", "weight", "tiles", "qtype", "n", "k", "dropped", "__weakref__")

    def __init__(self, lib: "Kernels", w: torch.Tensor, tiles: torch.Tensor, qtype: str = "", n: int = 0,
                 k: int = 0, dropped: bool = False):
        self._lib, self.weight, self.tiles = lib, w, tiles
        self.qtype, self.n, self.k, self.dropped = qtype, n, k, dropped

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    def restore_source(self) -> None:
        """Makes the weight's GGUF bytes resident again (if they were dropped), from the copy."""
        if self.dropped and self.tiles is not None:
            _restore(self._lib, self.tiles, self.weight, self.n, self.k, self.qtype)
            self.dropped = False

    def drop_source(self) -> bool:
        """Gives the weight's pages back now (a type whose copy holds every byte). Returns whether they are."""
        if not self.dropped and self.tiles is not None and self.qtype in _DROPPABLE and self.weight.is_contiguous():
            _drop_pages(self.weight.data_ptr(), self.weight.numel())
            self.dropped = True
        return self.dropped

    def release(self, restore: bool = True) -> None:
        """Unregisters the copy (matmuls of the weight go back to unpacking per call), first writing the weight's
        dropped GGUF bytes back from it unless restore is False (the weight is going away too)."""
        if self.tiles is not None:
            if restore:
                self.restore_source()
            self._lib.lib.kvq_amx_tiles_register(self.weight.data_ptr(), 0, 0, 0, 0, None)
            self.tiles = None

    def __del__(self):
        # Collected with its layer (which holds it as long as the weight is read): the dropped pages are not
        # written back, which at a model's teardown would bring every weight's bytes back just to free them.
        try:
            self.release(restore=False)
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


def _restore(lib: "Kernels", tiles: torch.Tensor, w: torch.Tensor, n: int, k: int, qtype: str) -> None:
    """Writes every row of w (n GGML rows of k values) back from its kept copy."""
    ids = torch.arange(n, dtype=torch.int64)
    _check(lib.lib.kvq_kept_rows(tiles.data_ptr(), n, k, QTYPES[qtype], ids.data_ptr(), n, w.data_ptr(),
                                 w.stride(0)), "restoring a weight from its kept copy")




def _nt(n: Optional[int]) -> int:
    return torch.get_num_threads() if n is None else int(n)


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} failed: {_ERRORS.get(rc, rc)}")


def role_runs(spans: Sequence[tuple[int, int]], rows: int):
    """The rows [0, rows) of a step as consecutive runs (start, end, is_prompt): the prompt spans (sorted, disjoint,
    non-empty [start, end) row ranges) and the rows between them. ValueError when spans are not such ranges."""
    done = 0
    for a, b in spans:
        if not done <= a < b <= rows:
            raise ValueError(f"prompt rows {list(spans)} are not spans of a batch of {rows} rows")
        if a > done:
            yield done, a, False
        yield a, b, True
        done = b
    if rows > done:
        yield done, rows, False


def _cpu_f32(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dim:
        raise ValueError(f"{name} must be a float32 CPU tensor with {dim} dims, got {t.dtype} {tuple(t.shape)} "
                         f"on {t.device}")


class Kernels:
    """One level's library. The module-level functions call the active one; tests load others to compare."""

    def __init__(self, level_name: str, path: Path):
        self.level = level_name
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        _declare(self.lib)
        if self.lib.kvq_level() != LEVELS.index(level_name):
            raise RuntimeError(f"{path} is not a {level_name} build")
        self.amx = False
        self.prompt_route = False
        self._want_prompt_route = False  # asked for (set_prompt_route); on only while the tiles are

    @property
    def amx_min_rows(self) -> int:
        """Rows from which a quantised matmul runs on the AMX tiles when they are on (0: this level has none)."""
        return int(self.lib.kvq_amx_min_rows())

    def set_amx(self, on: bool) -> bool:
        """Quantised matmuls of amx_min_rows rows and more on AMX tiles (the avx512 level, where the OS grants the
        tile state; the same bits as without). Returns whether they now are."""
        self.amx = bool(self.lib.kvq_amx_enable(int(bool(on))))
        self.prompt_route = bool(self.lib.kvq_amx_bf16_enable(int(self._want_prompt_route)))
        return self.amx

    def set_prompt_route(self, on: bool) -> bool:
        """Prompt rows (matmul_prompt) on AMX bfloat16 tiles: needs the tiles on (set_amx) and a CPU with AMX-BF16
        and AVX512_BF16. Returns whether the route is now on."""
        self._want_prompt_route = bool(on)
        self.prompt_route = bool(self.lib.kvq_amx_bf16_enable(int(bool(on))))
        return self.prompt_route

    @property
    def keeps_tiles(self) -> bool:
        """Whether this level reads quantised weights from a copy laid out for its vectors (keep_tiles): the avx512
        level, AMX or not (its vector route reads that layout too), every quantised type; the avx2 level, the
        K-quants."""
        return self.level in ("avx512", "avx2")

    def keep_tiles(self, w: torch.Tensor, n: int, k: int, qtype: str,
                   drop_source: bool = False) -> Optional["KeptTiles"]:
        """W (raw GGML rows, uint8 [n, row_bytes]) unpacked once into tile layout (per 16 output columns: the
        quants as VNNI instructions and AMX tiles take them, then the blocks' scales; as many bytes as the GGML
        rows) and registered, so that its matmuls read that copy: AMX tiles without per-call unpacking, and the
        vector route without its per-block transpose (docs/KQUANTS.md, docs/BENCHMARKS.md). None below the avx512
        level or where W is not quantised; the copy lives (and stays registered) as long as the result.
        drop_source (Q4_0, Q4_1, Q8_0, K-quants, IQ4_XS): W's pages are given back as they are packed, so the process holds the
        weight once; W must then be read only by the kernels or after KeptTiles.restore_source()."""
        if (not self.keeps_tiles or qtype not in QTYPES or w.dtype != torch.uint8 or not w.is_cpu
                or w.stride(1) != 1):
            return None
        qt = QTYPES[qtype]
        nbytes = self.lib.kvq_amx_tiles_bytes(n, k, qt)
        if nbytes <= 0:
            return None
        tiles = torch.empty(nbytes, dtype=torch.uint8)
        drop = drop_source and qtype in _DROPPABLE and (n <= 1 or w.is_contiguous())
        ld, nt = w.stride(0), torch.get_num_threads()
        # Dropping: packed in runs of rows (whole groups of 32 columns), each run's source pages given back once
        # packed, so the copy never sits beside the whole source.
        step = max(32, _DROP_CHUNK_BYTES // max(ld, 1) // 32 * 32) if drop else n
        group = self.lib.kvq_amx_tiles_bytes(16, k, qt)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            _check(self.lib.kvq_amx_tiles_pack(w.data_ptr() + r0 * ld, r1 - r0, k, ld, qt,
                                               tiles.data_ptr() + r0 // 16 * group, nt), "AMX tile packing")
            if drop:
                _drop_pages(w.data_ptr() + r0 * ld, (r1 - r0) * ld)
        if self.lib.kvq_amx_tiles_register(w.data_ptr(), n, k, ld, qt, tiles.data_ptr()):
            if drop:
                _restore(self, tiles, w, n, k, qtype)
            log.warning("AMX tile layout not kept for a %dx%d %s weight (registry full)", n, k, qtype)
            return None
        return KeptTiles(self, w, tiles, qtype, n, k, drop)

    # -- matmul ---------------------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, w: torch.Tensor, qtype: str = "F32", bias: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None, num_threads: Optional[int] = None) -> torch.Tensor:
        """y[M, N] = x[M, K] @ W^T (+ bias). W: raw GGML rows (uint8 [N, row_bytes], qtype Q4_0/Q4_1/Q8_0) or a
        float32/float16/bfloat16 [N, K] tensor (qtype ignored). x float32 [M, K] with contiguous rows."""
        _cpu_f32("x", x, 2)
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError("x rows must be contiguous")
        if w.dim() != 2 or w.device.type != "cpu" or (w.shape[1] > 1 and w.stride(1) != 1):
            raise ValueError("w must be a 2-D CPU tensor with contiguous rows")
        M, K = x.shape
        N = w.shape[0]
        if w.dtype == torch.uint8:
            qt = QTYPES.get(qtype)
            if qt is None:
                raise ValueError(f"quantised matmul supports {', '.join(QTYPES)}, not {qtype}")
            if _short_rows(qtype, K, w.shape[1]):
                raise ValueError(f"K={K} must be a multiple of 32 and fit in {w.shape[1]}-byte {qtype} rows")
            ldw = w.stride(0) if N > 1 else w.shape[1]
        elif w.dtype in FLOAT_TYPES:
            qt = FLOAT_TYPES[w.dtype]
            if w.shape[1] != K:
                raise ValueError(f"w has {w.shape[1]} columns, x has {K}")
            ldw = (w.stride(0) if N > 1 else K) * w.element_size()
        else:
            raise ValueError(f"w must be uint8 GGML rows or float32/float16/bfloat16, not {w.dtype}")
        if bias is not None:
            bias = bias.detach().to(torch.float32).contiguous()
            if tuple(bias.shape) != (N,):
                raise ValueError(f"bias must have shape ({N},)")
        if out is None:
            out = torch.empty((M, N), dtype=torch.float32)
        elif (out.dtype != torch.float32 or tuple(out.shape) != (M, N) or (N > 1 and out.stride(1) != 1)
              or out.device.type != "cpu"):
            raise ValueError(f"out must be a float32 CPU tensor of shape {(M, N)} with unit column stride")
        rc = self.lib.kvq_matmul(x.data_ptr(), M, K, x.stride(0) if M > 1 else K, w.data_ptr(), N, ldw, qt,
                                 bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                 out.stride(0) if M > 1 else N, _nt(num_threads))
        _check(rc, "matmul")
        return out

    def matmul_prompt(self, x: torch.Tensor, w: torch.Tensor, qtype: str, bias: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, num_threads: Optional[int] = None) -> Optional[torch.Tensor]:
        """matmul() by the prompt rows' route: W (raw GGML rows with a kept tile copy) and x widened and rounded to
        bfloat16, products summed by AMX bfloat16 tiles in K order; a row's bits depend on its own values only,
        on this CPU. None when the route is off or W has no kept copy (use matmul)."""
        if not self.prompt_route or w.dtype != torch.uint8 or qtype not in QTYPES:
            return None
        _cpu_f32("x", x, 2)
        M, K = x.shape
        N = w.shape[0]
        if x.stride(1) != 1 and K > 1:
            raise ValueError("x rows must be contiguous")
        if out is None:
            out = torch.empty((M, N), dtype=torch.float32)
        rc = self.lib.kvq_matmul_prompt(x.data_ptr(), M, K, x.stride(0) if M > 1 else K, w.data_ptr(), N,
                                        w.stride(0) if N > 1 else w.shape[1], QTYPES[qtype],
                                        bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                        out.stride(0) if M > 1 else N, _nt(num_threads))
        if rc == -1:  # KVQ_EBADTYPE: no kept copy
            return None
        _check(rc, "prompt matmul")
        return out

    # -- attention ------------------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                  tok_seq: torch.Tensor, tok_pos: torch.Tensor, *, num_kv_heads: int, block_size: int,
                  num_blocks: int, strides: tuple[int, int, int], scale: float, out: Optional[torch.Tensor] = None,
                  alibi_slopes: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                  num_threads: Optional[int] = None, kv_dtype: str = "float32",
                  k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                  prompt_spans: Optional[Sequence[tuple[int, int]]] = None) -> torch.Tensor:
        """Query tokens q [T, H, D] (rows may be strided) attend to positions [first, tok_pos[t]] of sequence
        tok_seq[t], whose keys / values sit in k / v at table[p // block_size] * strides[0] + (p % block_size) *
        strides[1] + kv_head * strides[2] (in elements). tables int64 [S, blocks]. Returns out [T, H, D].
        kv_dtype int8 / fp8: k, v hold 8-bit values (torch.int8 / torch.uint8 e4m3 bits) and k_scale / v_scale
        float32 the scale of each group of 32 values (of each row if D % 32) at the group's offset / its size;
        bfloat16: k, v torch.bfloat16, no scales. prompt_spans: sorted, disjoint [start, end) rows that are prompt
        tokens; where the prompt route is on (prompt_route) and takes the job (head size a multiple of 64 up to
        256, no sliding window, float32 or bfloat16 cache) they attend by it (AMX bfloat16 tiles), the others as
        usual."""
        T, H, D = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != D:
            raise ValueError(f"q must be float32 [T, H, D] with contiguous heads, got {q.dtype} {tuple(q.shape)}")
        kvt = KV_DTYPES.get(kv_dtype)
        if kvt is None:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
        want = torch.float32 if kvt == 0 else KV_STORAGE[kv_dtype]
        for name, t in (("k", k), ("v", v)):
            if t.dtype != want or t.device.type != "cpu":
                raise ValueError(f"{name} must be a {want} CPU tensor for a {kv_dtype} cache")
        scaled = kv_dtype in KV_SCALED
        if scaled and (k_scale is None or v_scale is None or k_scale.dtype != torch.float32
                       or v_scale.dtype != torch.float32):
            raise ValueError("an 8-bit cache needs float32 k_scale and v_scale")
        for name, t in (("tables", tables), ("tok_seq", tok_seq), ("tok_pos", tok_pos)):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int64 tensor")
        if tables.dim() != 2 or tuple(tok_seq.shape) != (T,) or tuple(tok_pos.shape) != (T,):
            raise ValueError("tables must be [S, blocks] and tok_seq / tok_pos [T]")
        if T and int(tok_seq.max()) >= tables.shape[0]:
            raise ValueError("tok_seq names a sequence outside tables")
        kvh = num_kv_heads
        if kvh <= 0 or H % kvh:
            raise ValueError(f"{H} query heads cannot share {kvh} kv heads")
        if out is None:
            out = torch.empty((T, H, D), dtype=torch.float32)
        slopes = None
        if alibi_slopes is not None:
            alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
            slopes = alibi_slopes.data_ptr()
        job = AttnJob(q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(),
                      k_scale.data_ptr() if scaled else None, v_scale.data_ptr() if scaled else None,
                      tables.data_ptr(),
                      tok_seq.data_ptr(), tok_pos.data_ptr(), slopes, T, H, kvh, D, block_size, num_blocks,
                      tables.shape[1], q.stride(0) if T > 1 else H * D, out.stride(0) if T > 1 else H * D,
                      strides[0], strides[1], strides[2], sliding_window or 0, scale, _nt(num_threads), kvt)
        if not prompt_spans or not self.prompt_route:
            _check(self.lib.kvq_attention(ctypes.byref(job)), "attention")
            return out
        for lo, hi, prompt in list(role_runs(prompt_spans, T)):  # (all checked before any call)
            part = AttnJob.from_buffer_copy(job)
            part.q = job.q + lo * job.q_stride * 4
            part.out = job.out + lo * job.out_stride * 4
            part.tok_seq, part.tok_pos = job.tok_seq + lo * 8, job.tok_pos + lo * 8
            part.T = hi - lo
            rc = self.lib.kvq_attention_prompt(ctypes.byref(part)) if prompt else _EBADTYPE
            if rc == _EBADTYPE:  # an other row, or a job the prompt route does not take
                rc = self.lib.kvq_attention(ctypes.byref(part))
            _check(rc, "attention")
        return out

    # -- embedding lookup -----------------------------------------------------------------------------------
    def embed_rows(self, w: torch.Tensor, qtype: str, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """Rows `ids` (any shape) of raw GGML rows w (uint8 [N, row_bytes], Q4_0/Q4_1/Q8_0) or a float32 /
        float16 / bfloat16 [N, dim] tensor, as float32 [*ids.shape, dim]: the floats kvinfer.loaders.dequant
        gives. An id outside [0, N) is a ValueError."""
        if w.dim() != 2 or w.device.type != "cpu" or (w.shape[1] > 1 and w.stride(1) != 1):
            raise ValueError("w must be a 2-D CPU tensor with contiguous rows")
        if w.dtype == torch.uint8:
            qt = QTYPES.get(qtype)
            if qt is None or _short_rows(qtype, dim, w.shape[1]):
                raise ValueError(f"{qtype} rows of {w.shape[1]} bytes cannot hold {dim} elements")
            ldw = w.stride(0)
        elif w.dtype in FLOAT_TYPES and w.shape[1] == dim:
            qt, ldw = FLOAT_TYPES[w.dtype], w.stride(0) * w.element_size()
        else:
            raise ValueError(f"w must be uint8 GGML rows or float [N, {dim}], not {w.dtype} {tuple(w.shape)}")
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], dim), dtype=torch.float32)
        rc = self.lib.kvq_embed_rows(w.data_ptr(), ldw, qt, flat.data_ptr(), flat.shape[0], w.shape[0], dim,
                                     out.data_ptr())
        if rc == _EBADSHAPE:
            raise ValueError(f"token ids must be in [0, {w.shape[0]})")
        _check(rc, "embedding lookup")
        return out.view(*ids.shape, dim)

    # -- row operations -------------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of a float32 [..., n] tensor (rows contiguous)."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(x2.shape, dtype=torch.float32)
        self.lib.kvq_rms_norm(x2.data_ptr(), x2.shape[0], x2.stride(0), weight.data_ptr(), y.data_ptr(),
                              x2.shape[1], x2.shape[1], eps, torch.get_num_threads())
        return y.view(x.shape)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   eps: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(x2.shape, dtype=torch.float32)
        self.lib.kvq_layer_norm(x2.data_ptr(), x2.shape[0], x2.stride(0), weight.data_ptr(),
                                bias.data_ptr() if bias is not None else None, y.data_ptr(), x2.shape[1],
                                x2.shape[1], eps, torch.get_num_threads())
        return y.view(x.shape)

    def silu_mul(self, gu: torch.Tensor, inter: int) -> Optional[torch.Tensor]:
        """silu(gu[:, :inter]) * gu[:, inter:] for float32 CPU [tokens, 2 * inter] with contiguous rows; None when
        the tensor does not fit (the caller falls back)."""
        if (gu.dtype != torch.float32 or gu.device.type != "cpu" or gu.dim() != 2 or gu.shape[1] != 2 * inter
                or gu.stride(1) != 1):
            return None
        out = torch.empty((gu.shape[0], inter), dtype=torch.float32)
        self.lib.kvq_silu_mul_rows(gu.data_ptr(), gu.shape[0], inter, gu.stride(0), out.data_ptr(),
                                   torch.get_num_threads())
        return out

    def gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        xc = x.contiguous()
        y = torch.empty_like(xc)
        self.lib.kvq_gelu(xc.data_ptr(), y.data_ptr(), xc.numel(), int(approximate == "tanh"),
                          torch.get_num_threads())
        return y

    def rope_pair_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate-half RoPE in place on q [tokens, heads, dim] and k [tokens, kv_heads, dim] (float32 CPU, heads
        contiguous within a row) with cos / sin float32 contiguous [tokens, dim / 2]; False (touching neither)
        when a layout does not fit."""
        def fits(x):
            return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1
                    and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0
                    and tuple(cos.shape) == (x.shape[0], x.shape[2] // 2))

        if (cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_contiguous()
                or not sin.is_contiguous() or sin.shape != cos.shape or not fits(q) or not fits(k)):
            return False
        nt = torch.get_num_threads()
        for x in (q, k):
            self.lib.kvq_rope_rows(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2], cos.data_ptr(),
                                   sin.data_ptr(), nt)
        return True

    def kv_store(self, x: torch.Tensor, dst: torch.Tensor, dst_scale: Optional[torch.Tensor], offsets: torch.Tensor,
                 head_stride: int, kv_dtype: str) -> None:
        """Quantise x [T, kv_heads, D] (float32, heads contiguous within a row) into an 8-bit or bfloat16 cache:
        row t, head g at element offsets[t] + g * head_stride of dst, an 8-bit cache's group scales at their
        offset / group size in dst_scale (None for bfloat16)."""
        if kv_dtype not in KV_STORAGE or dst.dtype != KV_STORAGE[kv_dtype] or \
                (kv_dtype in KV_SCALED) != (dst_scale is not None):
            raise ValueError(f"kv_store: a {kv_dtype} cache stores into {KV_STORAGE.get(kv_dtype)} with "
                             f"{'float32 scales' if kv_dtype in KV_SCALED else 'no scales'}")
        T, KVH, D = x.shape
        if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != D:
            x = x.contiguous()
        offsets = offsets.to(torch.int64).contiguous()
        self.lib.kvq_kv_store(x.data_ptr(), T, x.stride(0) if T > 1 else KVH * D, KVH, D, offsets.data_ptr(),
                              head_stride, dst.data_ptr(), None if dst_scale is None else dst_scale.data_ptr(),
                              KV_DTYPES[kv_dtype])

    def fp8_values(self) -> torch.Tensor:
        """The 256 e4m3 values, by bit pattern (NaN for 0x7f and 0xff)."""
        return torch.tensor([self.lib.kvq_fp8_value(i) for i in range(256)], dtype=torch.float32)

    def decode_step(self, job: DecodeJob) -> None:
        _check(self.lib.kvq_decode_step(ctypes.byref(job)), "fused decode step")

    def decode_steps(self, job: DecodeJob, nsteps: int, stop_ids: torch.Tensor, logits_all: torch.Tensor,
                     tokens: torch.Tensor, sampling: Optional[Sampling] = None) -> int:
        """Up to nsteps decode steps in one call (kvq_decode_steps), each row's next token its argmax or, with
        `sampling`, drawn as sample_row draws it; returns the steps done."""
        n = self.lib.kvq_decode_steps(ctypes.byref(job), nsteps, stop_ids.data_ptr(), stop_ids.numel(),
                                      None if sampling is None else ctypes.byref(sampling), logits_all.data_ptr(),
                                      tokens.data_ptr())
        _check(min(n, 0), "fused decode steps")
        return n

    def sample_row(self, row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                   u: float) -> int:
        """One token drawn from a row of logits (CPU float32, contiguous) with uniform number u in [0, 1): the
        temperature, top-k, top-p and min-p of kvq_sample_row, which the fused multi-step decode applies too."""
        n = row.numel()
        work = torch.empty((self.lib.kvq_sample_work_bytes(n) + 7) // 8, dtype=torch.float64)
        t = self.lib.kvq_sample_row(row.data_ptr(), n, temperature, top_k, top_p, min_p, u, work.data_ptr())
        _check(min(t, 0), "sampling")
        return t

    def sample_rows(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, u: torch.Tensor, allow: Optional[torch.Tensor] = None,
                    num_threads: Optional[int] = None) -> list[int]:
        """Each row of logits [rows, n] (CPU float32, contiguous) to a token: its argmax where temperature is 0,
        else sample_row's draw with u (float64 [rows]); allow (int32 [rows, ceil(n / 32)], bit i of a row: token
        i allowed) masks tokens as a -inf logit would. Per-row parameters: float32 / int64 tensors [rows]."""
        rows, n = logits.shape
        words = 0 if allow is None else allow.shape[1]
        out = torch.empty(rows, dtype=torch.int64)
        _check(self.lib.kvq_sample_rows(logits.data_ptr(), rows, n, temperature.data_ptr(), top_k.data_ptr(),
                                        top_p.data_ptr(), min_p.data_ptr(), u.data_ptr(),
                                        None if allow is None else allow.data_ptr(), words, out.data_ptr(),
                                        _nt(num_threads)), "sampling")
        return out.tolist()

    def sample_probs(self, row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> torch.Tensor:
        """The probabilities sample_row draws from (float32 [n]; exactly 0 outside the filters)."""
        n = row.numel()
        work = torch.empty((self.lib.kvq_sample_work_bytes(n) + 7) // 8, dtype=torch.float64)
        probs = torch.empty(n, dtype=torch.float32)
        _check(self.lib.kvq_sample_probs(row.data_ptr(), n, temperature, top_k, top_p, min_p, probs.data_ptr(),
                                         work.data_ptr()), "sampling")
        return probs

    def argmax_rows(self, x: torch.Tensor) -> list[int]:
        """Each row's argmax as decode_steps takes it (x: [rows, n] contiguous float32)."""
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.kvq_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out.tolist()


# ---- the active level ----------------------------------------------------------------------------------------
_lock = threading.Lock()
_active: Optional[Kernels] = None
_reason: Optional[str] = None
_tried = False
_features: Optional[int] = None
_loaded: dict[str, Kernels] = {}


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


def library(level_name: str) -> Kernels:
    """The library of one level (built on first use). Raises RuntimeError when this CPU cannot run it or it
    cannot be built."""
    if level_name not in LEVELS:
        raise ValueError(f"ISA level must be one of {', '.join(LEVELS)}, not {level_name!r}")
    if LEVELS.index(level_name) > LEVELS.index(best_level()):
        raise RuntimeError(f"this CPU (or its OS) cannot run the {level_name} level (best: {best_level()})")
    lib = _loaded.get(level_name)
    if lib is None:
        lib = _loaded[level_name] = Kernels(level_name, build(flags=LEVEL_FLAGS[level_name]))
        # (the library's switch is process-wide, so it is set either way: a reload may find it on)
        lib.set_amx(level_name == "avx512" and cpu_features()["amx_granted"] and not _off("KVINFER_AMX"))
        lib.set_prompt_route(lib.amx and not _off("KVINFER_PROMPT_BF16"))
    return lib


def _init() -> None:
    global _active, _reason, _tried
    with _lock:
        if _tried:
            return
        _tried = True
        try:
            if _off("KVINFER_KERNELS"):
                raise RuntimeError("disabled by KVINFER_KERNELS")
            want = best_level()
            forced = os.environ.get("KVINFER_ISA", "").strip().lower()
            if forced:
                if forced not in LEVELS:
                    raise RuntimeError(f"KVINFER_ISA must be one of {', '.join(LEVELS)}, not {forced!r}")
                if LEVELS.index(forced) > LEVELS.index(want):
                    log.warning("KVINFER_ISA=%s is above what this CPU allows; using %s", forced, want)
                else:
                    want = forced
            _active = library(want)
        except Exception as e:  # never raise at import or from available(): report instead
            _reason = f"CPU kernels unavailable: {e}"


def drop_source_enabled() -> bool:
    """Whether the engine gives a kept weight's GGUF pages back once its copy is made (default; the copy holds
    every byte, so the process holds each weight once). KVINFER_DROP_SOURCE=0 keeps the GGUF rows beside the
    copy."""
    return not _off("KVINFER_DROP_SOURCE")


def keep_tiles_enabled() -> bool:
    """Whether quantised weights are kept in tile layout at the avx512 level (K-quants also at avx2) (default;
    KVINFER_AMX_KEEP=0 reads the GGML rows instead, unpacking them per call)."""
    return not _off("KVINFER_AMX_KEEP")


def batch_invariant() -> bool:
    """Whether every route keeps a row's result independent of how it is served (default; KVINFER_BATCH_INVARIANT=0
    lets prefill-sized steps take BLAS GEMMs and SDPA instead, which are faster on long prompts)."""
    return not _off("KVINFER_BATCH_INVARIANT")


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
    f = cpu_features()
    cpu = ", ".join(k for k in ("avx2", "avx512") if f[k]) or "no AVX2"
    amx = "AMX granted" if f["amx_granted"] else "AMX listed but not granted by the OS" if f["amx_listed"] else "no AMX"
    if not available():
        return f"CPU kernels off ({unavailable_reason()}); CPU: {cpu}, {amx}"
    tiles = ""
    if _active.keeps_tiles and keep_tiles_enabled():
        tiles = (", weights kept in tile layout" if _active.level == "avx512"
                 else ", K-quant weights kept in a byte layout")
    if _active.amx:
        tiles += f", AMX tiles from {_active.amx_min_rows} rows"
    if _active.prompt_route and keep_tiles_enabled():
        tiles += ", prompt rows' matmuls and attention on AMX bfloat16 tiles"
    return (f"CPU kernels: level {level()} (CPU: {cpu}, {amx}); matmul: int16-rounded activations x GGML blocks"
            f"{tiles} (float weights: fp32 FMA), attention: in-place paged, fixed 256-position pieces")


def load(flags: Optional[list[str]] = None, cc: Optional[str] = None) -> ctypes.CDLL:
    """Build (if needed) and load a variant of the kernel library with other flags (tests)."""
    lib = ctypes.CDLL(str(build(cc, flags)))
    _declare(lib)
    return lib


def _reset() -> None:
    """Forget the loaded state so the next call builds and probes again (tests)."""
    global _active, _reason, _tried, _features
    with _lock:
        _active = _reason = None
        _tried = False
        _features = None
        _loaded.clear()


# ---- module-level calls go to the active level ---------------------------------------------------------------
def matmul(x, w, qtype="F32", bias=None, out=None, num_threads=None):
    return active().matmul(x, w, qtype, bias, out, num_threads)


def attention(*args, **kwargs):
    return active().attention(*args, **kwargs)


def embed_rows(w, qtype, ids, dim):
    return active().embed_rows(w, qtype, ids, dim)


def rms_norm(x, weight, eps):
    return active().rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    return active().layer_norm(x, weight, bias, eps)


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
    thread gets its own argument block. Create it only when available() is True.
    """

    __slots__ = ("_fn", "_template", "_blocks", "_args")

    def __init__(self, n: int, k: int, w: torch.Tensor, qtype: str = "F32", bias: Optional[torch.Tensor] = None):
        lib = active()
        if w.dtype == torch.uint8:
            qt = QTYPES[qtype]
            if _short_rows(qtype, k, w.shape[1]):
                raise ValueError(f"K={k} must be a multiple of 32 and fit in {w.shape[1]}-byte {qtype} rows")
            ldw = w.stride(0)
        else:
            qt = FLOAT_TYPES[w.dtype]
            ldw = w.stride(0) * w.element_size()
        self._args = (n, k, w, qtype, bias)
        self._fn = lib.lib.kvq_matmul_packed
        self._template = (0, 0, k, k, w.data_ptr(), n, ldw, qt, bias.data_ptr() if bias is not None else 0, 0, n, 1)
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
