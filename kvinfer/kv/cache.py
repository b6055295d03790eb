"""KV cache tensors of each backend (none, contiguous, paged) and the per-step attention metadata."""
from __future__ import annotations

import math
import mmap
from typing import Optional, Sequence

import numpy as np
import torch

from kvinfer import kernels
from kvinfer.config import kv_scale_bytes
from kvinfer.errors import ValidationError
from kvinfer.kv.interface import SeqSlice, is_decode, leading_decodes
from kvinfer.layers.attention import AttentionMetadata, AttnGroup, KernelAttn, build_mask
from kvinfer.layers.forward_context import get_forward_context


def _zeros(shape, dtype, device) -> torch.Tensor:
    """A zero-filled cache tensor. On the CPU it is an anonymous memory map: the kernel maps zero pages lazily, so
    the budget is reserved at start-up but memory is only touched as blocks are first written. (calloc gave the
    same only for sizes it maps itself: below glibc's mmap threshold, up to 32 MiB, it may clear reused heap
    memory, touching it.)"""
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.int8: np.int8,
                torch.uint8: np.uint8, torch.bfloat16: np.uint16}.get(dtype)
    if torch.device(device).type == "cpu" and np_dtype is not None:
        count = math.prod(shape)
        nbytes = count * np.dtype(np_dtype).itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        arr = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np_dtype, count=count).reshape(shape)
        return torch.from_numpy(arr).view(dtype)  # (bfloat16: zero bits are 0.0; the array keeps the map alive)
    return torch.zeros(shape, dtype=dtype, device=device)


class _Backend:
    """What the three backends share: K/V accounting and the choice of the attention kernel.

    On the CPU in float32 the attention kernel (kvinfer.kernels.attention) serves every token of every step,
    reading keys and values in place: one arithmetic for a query row whether it is a prefill, a chunk, a decode
    or a recompute. With KVINFER_BATCH_INVARIANT=0 it serves decode-only steps and prefills use SDPA (faster on
    long prompts, but a row's bits then depend on how it is served).
    """

    name = "?"  # for messages
    block_pools = False  # K/V as [num_blocks, block_size, kv_heads, head_dim] pools (what the fused decode writes)
    sliding_window: Optional[int] = None
    alibi: Optional[torch.Tensor] = None
    use_kernel = True  # tests switch it off to compare with the SDPA path

    def __init__(self, num_layers: int, device, dtype=torch.float32, kv_dtype: str = "auto"):
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.dtype = dtype
        # Storage in the model's dtype ("auto"), or a cache that only the attention kernel reads, for float32
        # activations: 8-bit (int8 / fp8) with a scale per 32 values, or bfloat16 (a bfloat16 model's own dtype
        # already: "auto").
        if kv_dtype == "bfloat16" and dtype == torch.bfloat16:
            kv_dtype = "auto"
        if kv_dtype == "float32":  # the activations' own type, unrounded
            if dtype != torch.float32:
                raise ValidationError("kv_cache_dtype", kv_dtype, "needs float32 activations (--dtype float32)")
            kv_dtype = "auto"
        self.kv_dtype = kv_dtype if kv_dtype in kernels.KV_STORAGE else "auto"
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        self.kv_computed = 0  # K/V projections computed, summed over tokens (one per token per layer pass)
        self._kernel_ok: Optional[bool] = None
        if self.quantized and not self._kernel_usable():
            why = kernels.unavailable_reason() or \
                f"here: device {self.device.type}, dtype {str(dtype).replace('torch.', '')}"
            raise ValidationError("kv_cache_dtype", kv_dtype, f"needs the CPU kernels with float32 activations "
                                  f"(--dtype float32 --device cpu); {why}")

    @property
    def quantized(self) -> bool:
        """Stored in a type of its own (8-bit or bfloat16), written by kv_store and read by the kernel alone."""
        return self.kv_dtype != "auto"

    @property
    def scaled(self) -> bool:
        """8-bit: a float32 scale per group of values beside the values."""
        return self.kv_dtype in kernels.KV_SCALED

    def _kernel_usable(self) -> bool:
        if self._kernel_ok is None:
            self._kernel_ok = self.device.type == "cpu" and self.dtype == torch.float32 and kernels.available()
        return self._kernel_ok

    def _kernel_for(self, seqs: Sequence[SeqSlice]) -> bool:
        if not seqs or not (self.use_kernel or self.quantized):  # an 8-bit cache is read by the kernel alone
            return False
        return self._kernel_usable() and (kernels.batch_invariant() or self.quantized
                                          or all(is_decode(s) for s in seqs))

    def _alloc(self, shape) -> None:
        """Per-layer K and V of `shape` (an 8-bit cache: int8 / e4m3 values plus a float32 scale per row)."""
        store = kernels.KV_STORAGE[self.kv_dtype] if self.quantized else self.dtype
        self.k = [_zeros(shape, store, self.device) for _ in range(self.num_layers)]
        self.v = [_zeros(shape, store, self.device) for _ in range(self.num_layers)]
        if self.scaled:  # a scale per group of KV_GROUP values of each row
            sshape = (*shape[:-1], kv_scale_bytes(shape[-1]) // 4)
            self.k_scale = [_zeros(sshape, torch.float32, self.device) for _ in range(self.num_layers)]
            self.v_scale = [_zeros(sshape, torch.float32, self.device) for _ in range(self.num_layers)]

    def _store_quantized(self, layer: int, k, v, offsets: torch.Tensor, head_stride: int) -> None:
        lib = kernels.active()
        sc = self.scaled
        lib.kv_store(k, self.k[layer], self.k_scale[layer] if sc else None, offsets, head_stride, self.kv_dtype)
        lib.kv_store(v, self.v[layer], self.v_scale[layer] if sc else None, offsets, head_stride, self.kv_dtype)

    def _kernel_md(self, seqs: Sequence[SeqSlice], tables: torch.Tensor, block_size: int,
                   num_blocks: int) -> KernelAttn:
        tok_seq, tok_pos = [], []
        for i, s in enumerate(seqs):
            tok_seq += [i] * s.num_new
            tok_pos += range(s.start, s.end)
        return KernelAttn(tables, torch.tensor(tok_seq, dtype=torch.long), torch.tensor(tok_pos, dtype=torch.long),
                          block_size, num_blocks, all(is_decode(s) for s in seqs))

    def _kernel_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """(keys, values, (block, token, head) strides in elements, kv heads, key scales, value scales) the kernel
        reads for this layer (the scales: an 8-bit cache's, else None)."""
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
               scale: float, window: Optional[int] = None) -> torch.Tensor:
        """q [tokens, heads, dim] -> [tokens, heads, dim] through the attention kernel (md.kernel is set); window:
        the layer's own sliding window, where layers differ (else the backend's)."""
        km = md.kernel
        keys, values, strides, kvh, k_scale, v_scale = self._kernel_kv(layer, k, v)
        return kernels.attention(q, keys, values, km.tables, km.tok_seq, km.tok_pos, num_kv_heads=kvh,
                                 block_size=km.block_size, num_blocks=km.num_blocks, strides=strides, scale=scale,
                                 alibi_slopes=self.alibi, sliding_window=window or self.sliding_window,
                                 kv_dtype=self.kv_dtype if self.quantized else "float32",
                                 k_scale=k_scale, v_scale=v_scale, prompt_spans=get_forward_context().prompt_spans)

    def _layer_scales(self, layer: int):
        """This layer's key and value scales (an 8-bit cache), else (None, None)."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.scaled else (None, None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in getattr(self, "k", []) + getattr(self, "v", [])
                   + self.k_scale + self.v_scale)

    def _mask_group(self, g: AttnGroup, q_pos: torch.Tensor, lens: torch.Tensor, plain_causal: bool) -> AttnGroup:
        g.q_pos, g.lens = q_pos, lens
        if plain_causal and self.sliding_window is None and self.alibi is None:
            if g.q_len == g.ctx_len:
                g.is_causal = g.q_len > 1
                return g
            if g.q_len == 1 and g.num_seqs == 1:
                return g  # one query at the end of its context attends to everything
        k_pos = torch.arange(g.ctx_len, device=self.device).expand(g.num_seqs, g.ctx_len)
        valid = k_pos < lens[:, None]
        g.mask = build_mask(q_pos, k_pos, valid, self.sliding_window, self.alibi)
        return g

    def store(self, layer: int, k, v, md) -> None:
        if layer == 0:
            self.kv_computed += k.shape[0] * self.num_layers

    def copy_blocks(self, pairs) -> None:
        if pairs:
            raise RuntimeError(f"{self.name} backend cannot copy blocks")


class NoCache(_Backend):
    """Recompute: the runner feeds whole sequences every step; K and V live only within the step."""

    name = "none"

    def prepare(self, seqs: Sequence[SeqSlice]) -> AttentionMetadata:
        if self._kernel_for(seqs):
            # Each sequence's keys are its own rows of this step's K/V: one "block" starting at its first token.
            starts, tok = [], 0
            for s in seqs:
                assert s.start == 0, "the none backend recomputes from position 0"
                starts.append(tok)
                tok += s.num_new
            tables = torch.tensor(starts, dtype=torch.long).view(-1, 1)
            return AttentionMetadata(groups=[], kernel=self._kernel_md(seqs, tables, 1 << 40, tok))
        groups = []
        tok = 0
        for s in seqs:
            assert s.start == 0, "the none backend recomputes from position 0"
            n = s.num_new
            g = AttnGroup(tok, tok + n, 1, n, n)
            q_pos = torch.arange(n, device=self.device)[None]
            groups.append(self._mask_group(g, q_pos, torch.tensor([n], device=self.device), True))
            tok += n
        return AttentionMetadata(groups=groups)

    def gather(self, layer, g: AttnGroup, k, v):
        n = g.end - g.start
        return (k[g.start:g.end].view(1, n, *k.shape[1:]).transpose(1, 2),
                v[g.start:g.end].view(1, n, *v.shape[1:]).transpose(1, 2))

    def _kernel_kv(self, layer, k, v):
        if self.quantized:  # stored as a cache of this dtype stores them (kv_store), then read the same
            T, kvh, d = k.shape
            offsets = torch.arange(T, dtype=torch.int64) * (kvh * d)
            kb, vb = (torch.empty((T, kvh, d), dtype=kernels.KV_STORAGE[self.kv_dtype]) for _ in range(2))
            ks = vs = None
            if self.scaled:
                ks, vs = (torch.empty((T, kvh, kv_scale_bytes(d) // 4), dtype=torch.float32) for _ in range(2))
            lib = kernels.active()
            lib.kv_store(k, kb, ks, offsets, d, self.kv_dtype)
            lib.kv_store(v, vb, vs, offsets, d, self.kv_dtype)
            return kb, vb, (kvh * d, kvh * d, d), kvh, ks, vs
        if k.stride() != v.stride() or k.stride(2) != 1:  # q/k norms made k a tensor of its own
            k, v = k.contiguous(), v.contiguous()
        return k, v, (k.stride(0), k.stride(0), k.stride(1)), k.shape[1], None, None


def _group_seqs(seqs: Sequence[SeqSlice]):
    """The step's leading decodes (kv.interface.decodes_first put them there) batch into one group; others go alone."""
    n_dec = leading_decodes(seqs)
    groups = [list(seqs[:n_dec])] if n_dec else []
    groups += [[s] for s in seqs[n_dec:]]
    return groups


class ContiguousCache(_Backend):
    """The textbook layout: per layer K and V of [slots, kv_heads, max_len, head_dim]."""

    name = "contiguous"

    def __init__(self, num_layers, num_slots, num_kv_heads, max_len, head_dim, dtype, device, kv_dtype="auto"):
        super().__init__(num_layers, device, dtype, kv_dtype)
        self._alloc((num_slots, num_kv_heads, max_len, head_dim))
        self.max_len = max_len
        self.num_slots = num_slots

    def prepare(self, seqs: Sequence[SeqSlice]) -> AttentionMetadata:
        groups, tok = [], 0
        slot_tok, pos_tok = [], []
        if self._kernel_for(seqs):  # a slot is one "block" of max_len positions
            for s in seqs:
                slot_tok += [s.slot] * s.num_new
                pos_tok += range(s.start, s.end)
            tables = torch.tensor([s.slot for s in seqs], dtype=torch.long).view(-1, 1)
            return AttentionMetadata(groups=[], slot_ids=torch.tensor(slot_tok), positions=torch.tensor(pos_tok),
                                     kernel=self._kernel_md(seqs, tables, self.max_len, self.num_slots))
        for members in _group_seqs(seqs):
            b = len(members)
            q_len = members[0].num_new
            ctx = max(s.end for s in members)
            g = AttnGroup(tok, tok + b * q_len, b, q_len, ctx)
            g.slot_ids = torch.tensor([s.slot for s in members], device=self.device)
            q_pos = torch.tensor([list(range(s.start, s.end)) for s in members], device=self.device)
            lens = torch.tensor([s.end for s in members], device=self.device)
            groups.append(self._mask_group(g, q_pos, lens, b == 1))
            for s in members:
                slot_tok += [s.slot] * s.num_new
                pos_tok += range(s.start, s.end)
            tok += b * q_len
        return AttentionMetadata(groups=groups,
                                 slot_ids=torch.tensor(slot_tok, device=self.device),
                                 positions=torch.tensor(pos_tok, device=self.device))

    def store(self, layer, k, v, md) -> None:
        super().store(layer, k, v, md)
        if self.quantized:  # element offset of (slot, head 0, position) in [slots, kv_heads, max_len, dim]
            _, kvh, max_len, d = self.k[layer].shape
            self._store_quantized(layer, k, v, (md.slot_ids * kvh * max_len + md.positions) * d, max_len * d)
            return
        self.k[layer][md.slot_ids, :, md.positions] = k  # [tokens, kv_heads, dim] into the textbook layout
        self.v[layer][md.slot_ids, :, md.positions] = v

    def gather(self, layer, g: AttnGroup, k, v):
        if g.num_seqs == 1:
            s = int(g.slot_ids[0])
            return self.k[layer][s:s + 1, :, :g.ctx_len], self.v[layer][s:s + 1, :, :g.ctx_len]
        return self.k[layer][g.slot_ids, :, :g.ctx_len], self.v[layer][g.slot_ids, :, :g.ctx_len]

    def seq_len_capacity(self) -> int:
        return self.max_len

    def _kernel_kv(self, layer, k, v):
        kvh, max_len, d = self.k[layer].shape[1:]
        return self.k[layer], self.v[layer], (kvh * max_len * d, d, max_len * d), kvh, *self._layer_scales(layer)


class PagedCache(_Backend):
    """Block pools per layer: K and V of [num_blocks, block_size, kv_heads, head_dim].

    The attention kernel reads each sequence's blocks in place through its block table; on the SDPA path
    (other devices and dtypes) prefills that follow cached tokens gather whole blocks first.
    """

    name = "paged"
    block_pools = True

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, kv_dtype="auto"):
        super().__init__(num_layers, device, dtype, kv_dtype)
        self._alloc((num_blocks, block_size, num_kv_heads, head_dim))
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def _kernel_kv(self, layer, k, v):
        row = self.num_kv_heads * self.head_dim
        return (self.k[layer], self.v[layer], (self.block_size * row, row, self.head_dim), self.num_kv_heads,
                *self._layer_scales(layer))

    def _slots(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # table [b, blocks], pos [b, n] -> flat slot of each position [b, n]
        return table.gather(1, pos // self.block_size) * self.block_size + pos % self.block_size

    def prepare(self, seqs: Sequence[SeqSlice]) -> AttentionMetadata:
        bs = self.block_size
        groups, tok, slot_parts = [], 0, []
        if self._kernel_for(seqs):
            # Plain lists, then one tensor each: a decode step's metadata is a handful of numbers, and torch's
            # per-op cost would be most of the time spent here.
            nblk = max(-(-s.end // bs) for s in seqs)
            rows = [list(s.block_table[:nblk]) for s in seqs]
            slots = [t[p // bs] * bs + p % bs for t, s in zip(rows, seqs) for p in range(s.start, s.end)]
            km = self._kernel_md(seqs, torch.tensor([t + [0] * (nblk - len(t)) for t in rows], dtype=torch.long),
                                 bs, self.num_blocks)
            return AttentionMetadata(groups=[], slot_mapping=torch.tensor(slots, dtype=torch.long), kernel=km)
        for members in _group_seqs(seqs):
            b = len(members)
            q_len = members[0].num_new
            ctx = max(s.end for s in members)
            nblk = -(-ctx // bs)
            tables = torch.zeros(b, nblk, dtype=torch.long)
            for i, s in enumerate(members):
                t = s.block_table[:nblk]
                tables[i, :len(t)] = torch.as_tensor(t, dtype=torch.long)
            tables = tables.to(self.device)
            g = AttnGroup(tok, tok + b * q_len, b, q_len, ctx)
            q_pos = torch.tensor([list(range(s.start, s.end)) for s in members], device=self.device)
            lens = torch.tensor([s.end for s in members], device=self.device)
            self._mask_group(g, q_pos, lens, b == 1)
            if not (b == 1 and members[0].start == 0):
                g.gather_idx = tables  # [b, blocks]: whole blocks are copied, not single slots
            slot_parts.append(self._slots(tables, q_pos).reshape(-1))
            groups.append(g)
            tok += b * q_len
        return AttentionMetadata(groups=groups, slot_mapping=torch.cat(slot_parts) if slot_parts else None)

    def store(self, layer, k, v, md) -> None:
        super().store(layer, k, v, md)
        if self.quantized:
            row = self.num_kv_heads * self.head_dim
            self._store_quantized(layer, k, v, md.slot_mapping * row, self.head_dim)
            return
        kf = self.k[layer].view(-1, self.num_kv_heads, self.head_dim)  # [slots, kv_heads, dim]
        vf = self.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        kf.index_copy_(0, md.slot_mapping, k)
        vf.index_copy_(0, md.slot_mapping, v)

    def gather(self, layer, g: AttnGroup, k, v):
        if g.gather_idx is None:
            # A prefill with nothing cached before it: its keys are exactly this step's.
            n = g.end - g.start
            return (k[g.start:g.end].view(1, n, *k.shape[1:]).transpose(1, 2),
                    v[g.start:g.end].view(1, n, *v.shape[1:]).transpose(1, 2))
        b, nblk = g.gather_idx.shape
        flat = g.gather_idx.reshape(-1)
        shape = (b, nblk * self.block_size, self.num_kv_heads, self.head_dim)
        # index_select of whole blocks moves contiguous block_size-token chunks (faster than per-slot indexing);
        # positions past each sequence's length are masked out.
        keys = self.k[layer].index_select(0, flat).view(shape)[:, :g.ctx_len]
        values = self.v[layer].index_select(0, flat).view(shape)[:, :g.ctx_len]
        return keys.transpose(1, 2), values.transpose(1, 2)  # [b, kv_heads, L, dim]

    def copy_blocks(self, pairs) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for t in self.k + self.v + self.k_scale + self.v_scale:
            t[dst] = t[src]

