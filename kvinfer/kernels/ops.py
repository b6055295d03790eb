"""One level's kernel library (Kernels): each C call wrapped with its argument checks, and the helpers they share."""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional, Sequence

import torch

from .abi import (_EBADSHAPE, _EBADTYPE, FLOAT_TYPES, KV_DTYPES, KV_SCALED, KV_STORAGE, QTYPES, AttnJob, DecodeJob,
                  Sampling, _check, _declare, _short_rows)
from .build import LEVELS
from .kept import _DROP_CHUNK_BYTES, _DROPPABLE, KeptTiles, drop_pages


_PACK_THREAD_BYTES = 2 << 20


def _pack_threads(nbytes: int) -> int:
    """Threads to pack a kept copy of about nbytes: one per _PACK_THREAD_BYTES at most. Packing writes fresh
    pages and is bound by faulting them in; below a few MiB, waking the OpenMP team and waiting for its slowest
    thread costs about what the second thread saves, and more when another process holds a core; from a 1B model's
    layers (3-20 MiB a matrix) up, the second thread halves the packing (docs/BENCHMARKS.md). The bytes are the same
    whatever the count (each thread packs whole groups of columns)."""
    return max(1, min(torch.get_num_threads(), nbytes // _PACK_THREAD_BYTES))


def _nt(n: Optional[int]) -> int:
    return torch.get_num_threads() if n is None else int(n)



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
        """Prompt rows (matmul_prompt) on AMX bfloat16 tiles: needs the tiles on (set_amx), a CPU with AMX-BF16
        and AVX512_BF16, and 16 activation bits. Returns whether the route is now on."""
        self._want_prompt_route = bool(on) and self.activation_bits == 16
        self.prompt_route = bool(self.lib.kvq_amx_bf16_enable(int(self._want_prompt_route)))
        return self.prompt_route

    @property
    def prefetch_l2(self) -> bool:
        """Whether the kept copies are prefetched into L2 rather than L1 (AMD family 19h, Zen 3 and Zen 4: fixed
        when the library loads; speed only, never a bit)."""
        return bool(self.lib.kvq_prefetch_l2())

    @property
    def activation_bits(self) -> int:
        """The bits activations are rounded to where they meet quantised weights (16 or 8; process-wide)."""
        return int(self.lib.kvq_activation_bits(0))

    def set_activation_bits(self, bits: int) -> int:
        """Round activations to 16 bits (default) or 8 where they meet quantised weights; returns the bits now
        in use. AMX bfloat16 prompt rows (set_prompt_route) do not round them, so they stay off at 8."""
        if bits not in (8, 16):
            raise ValueError(f"activation bits must be 16 or 8, not {bits!r}")
        got = int(self.lib.kvq_activation_bits(int(bits)))
        if got == 8 and self.prompt_route:
            self.set_prompt_route(False)
        return got

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
        rows), so that the matmuls given the copy (kept=) read it: AMX tiles without per-call unpacking, and the
        vector route without its per-block transpose (docs/KQUANTS.md, docs/BENCHMARKS.md). None below the avx512
        level or where W is not quantised; the copy lives as long as the result (or until its release()).
        drop_source (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, K-quants, IQ4_XS): W's pages are given back as they are packed, so
        the process holds the weight once; W must then be read only by the kernels or after
        KeptTiles.restore_source()."""
        if (not self.keeps_tiles or qtype not in QTYPES or w.dtype != torch.uint8 or not w.is_cpu
                or w.stride(1) != 1):
            return None
        qt = QTYPES[qtype]
        nbytes = self.lib.kvq_amx_tiles_bytes(n, k, qt)
        if nbytes <= 0:
            return None
        tiles = torch.empty(nbytes, dtype=torch.uint8)
        drop = drop_source and qtype in _DROPPABLE and (n <= 1 or w.is_contiguous())
        ld, nt = w.stride(0), _pack_threads(n * w.stride(0))
        # Dropping: packed in runs of rows (whole groups of 32 columns), each run's source pages given back once
        # packed, so the copy never sits beside the whole source.
        step = max(32, _DROP_CHUNK_BYTES // max(ld, 1) // 32 * 32) if drop else n
        group = self.lib.kvq_amx_tiles_bytes(16, k, qt)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            _check(self.lib.kvq_amx_tiles_pack(w.data_ptr() + r0 * ld, r1 - r0, k, ld, qt,
                                               tiles.data_ptr() + r0 // 16 * group, nt), "AMX tile packing")
            if drop:
                drop_pages(w.data_ptr() + r0 * ld, (r1 - r0) * ld)
        return KeptTiles(self, w, tiles, qtype, n, k, drop)

    def drops_kept_source(self, qtype: str) -> bool:
        """Whether keep_tiles(drop_source=True) gives the pages of a qtype weight back at this level (its copy holds
        every byte of the GGUF rows)."""
        qt = QTYPES.get(qtype)
        return (self.keeps_tiles and qtype in _DROPPABLE and qt is not None
                and self.lib.kvq_amx_tiles_bytes(32, 256, qt) > 0)

    def keep_tiles_from(self, w: torch.Tensor, parts: list[torch.Tensor], k: int,
                        qtype: str) -> Optional["KeptTiles"]:
        """The kept copy of W (uint8 [n, row_bytes]) packed from `parts`, W's rows in blocks (stacked, they are W),
        without W's own rows ever being written: W is taken as dropped (its pages untouched, so it holds none;
        KeptTiles.restore_source writes them from the copy). This is how a fused projection is kept without the copy
        of its parts into one buffer. Each part's pages are given back as it is packed: the parts must not be read
        afterwards. None (nothing packed) where keep_tiles(drop_source=True) would not drop W, or a part does not
        start at a whole group of 32 columns."""
        n = w.shape[0]
        if (not self.drops_kept_source(qtype) or w.dtype != torch.uint8 or not w.is_cpu or not w.is_contiguous()
                or sum(p.shape[0] for p in parts) != n):
            return None
        at = 0
        for p in parts:
            if (at % 32 or p.dtype != torch.uint8 or not p.is_cpu or not p.is_contiguous()
                    or tuple(p.shape[1:]) != tuple(w.shape[1:])):
                return None
            at += p.shape[0]
        qt = QTYPES[qtype]
        nbytes = self.lib.kvq_amx_tiles_bytes(n, k, qt)
        if nbytes <= 0:
            return None
        tiles = torch.empty(nbytes, dtype=torch.uint8)
        group, nt, r0 = self.lib.kvq_amx_tiles_bytes(16, k, qt), _pack_threads(nbytes), 0
        for p in parts:  # each part as keep_tiles packs a dropped weight: in runs of rows, each given back once packed
            ld = p.stride(0) if p.shape[0] > 1 else p.shape[1]
            step = max(32, _DROP_CHUNK_BYTES // max(ld, 1) // 32 * 32)
            for a in range(0, p.shape[0], step):
                b = min(p.shape[0], a + step)
                _check(self.lib.kvq_amx_tiles_pack(p.data_ptr() + a * ld, b - a, k, ld, qt,
                                                   tiles.data_ptr() + (r0 + a) // 16 * group, nt), "AMX tile packing")
                drop_pages(p.data_ptr() + a * ld, (b - a) * ld)
            r0 += p.shape[0]
        drop_pages(w.data_ptr(), w.numel())  # W's memory may have been used before: it holds no pages either
        return KeptTiles(self, w, tiles, qtype, n, k, dropped=True)

    # -- matmul ---------------------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, w: torch.Tensor, qtype: str = "F32", bias: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None, num_threads: Optional[int] = None,
               kept: Optional[KeptTiles] = None) -> torch.Tensor:
        """y[M, N] = x[M, K] @ W^T (+ bias). W: raw GGML rows (uint8 [N, row_bytes], a qtype of QTYPES) or a
        float32/float16/bfloat16 [N, K] tensor (qtype ignored). x float32 [M, K] with contiguous rows. kept: W's
        copy from keep_tiles (read instead of W's rows, same bits; required once W's pages were dropped)."""
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
        kp = None if kept is None else kept.ptr_for(self, w, N, K, qtype)
        rc = self.lib.kvq_matmul(x.data_ptr(), M, K, x.stride(0) if M > 1 else K, w.data_ptr(), N, ldw, qt, kp,
                                 bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                 out.stride(0) if M > 1 else N, _nt(num_threads))
        _check(rc, "matmul")
        return out

    def matmul_prompt(self, x: torch.Tensor, w: torch.Tensor, qtype: str, bias: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, num_threads: Optional[int] = None,
                      kept: Optional[KeptTiles] = None) -> Optional[torch.Tensor]:
        """matmul() by the prompt rows' route: W (raw GGML rows) read from its kept tile copy and x widened and
        rounded to bfloat16, products summed by AMX bfloat16 tiles in K order; a row's bits depend on its own
        values only, on this CPU. None when the route is off or no copy is given (use matmul)."""
        if not self.prompt_route or w.dtype != torch.uint8 or qtype not in QTYPES or kept is None:
            return None
        _cpu_f32("x", x, 2)
        M, K = x.shape
        N = w.shape[0]
        if x.stride(1) != 1 and K > 1:
            raise ValueError("x rows must be contiguous")
        if out is None:
            out = torch.empty((M, N), dtype=torch.float32)
        kp = kept.ptr_for(self, w, N, K, qtype)
        rc = self.lib.kvq_matmul_prompt(x.data_ptr(), M, K, x.stride(0) if M > 1 else K, w.data_ptr(), N,
                                        w.stride(0) if N > 1 else w.shape[1], QTYPES[qtype], kp,
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
    def embed_rows(self, w: torch.Tensor, qtype: str, ids: torch.Tensor, dim: int,
                   kept: Optional[KeptTiles] = None) -> torch.Tensor:
        """Rows `ids` (any shape) of raw GGML rows w (uint8 [N, row_bytes], a type of QTYPES) or a float32 /
        float16 / bfloat16 [N, dim] tensor, as float32 [*ids.shape, dim]: the floats kvinfer.loaders.dequant
        gives. An id outside [0, N) is a ValueError. kept: w's copy from keep_tiles (its rows read back from it)."""
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
        kp = None if kept is None else kept.ptr_for(self, w, w.shape[0], dim, qtype)
        rc = self.lib.kvq_embed_rows(w.data_ptr(), ldw, qt, kp, flat.data_ptr(), flat.shape[0], w.shape[0], dim,
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

    def moe_route(self, logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A router's logits [tokens, experts] (float32 CPU, rows contiguous) -> (weights [tokens, top_k] float32,
        experts [tokens, top_k] int64) by kvq_moe_route: the fused decode step's own routing."""
        x = logits if logits.is_contiguous() else logits.contiguous()
        n, e = x.shape
        w = torch.empty((n, top_k), dtype=torch.float32)
        ex = torch.empty((n, top_k), dtype=torch.int64)
        _check(self.lib.kvq_moe_route(x.data_ptr(), n, e, top_k, int(renormalise), w.data_ptr(), ex.data_ptr()),
               "moe_route")
        return w, ex

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

