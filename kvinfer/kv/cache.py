"""KV cache tensors of each backend (none, contiguous, paged) and the per-step attention metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvinfer.layers.attention import AttentionMetadata, AttnGroup, build_mask


@dataclass
class SeqSlice:
    """One sequence's part of a step, as the runner hands it to a backend."""

    start: int  # tokens already in the cache
    num_new: int  # tokens computed this step
    block_table: Optional[Sequence[int]] = None  # paged
    slot: Optional[int] = None  # contiguous

    @property
    def end(self) -> int:
        return self.start + self.num_new


class _Backend:
    name = "?"
    sliding_window: Optional[int] = None
    alibi: Optional[torch.Tensor] = None

    def __init__(self, num_layers: int, device):
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.kv_computed = 0  # K/V projections computed, summed over tokens (one per token per layer pass)

    @property
    def nbytes(self) -> int:
        return 0

    def _mask_group(self, g: AttnGroup, q_pos: torch.Tensor, lens: torch.Tensor, plain_causal: bool) -> AttnGroup:
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


def _group_seqs(seqs: Sequence[SeqSlice]):
    """Single-token decodes are batched into one group (they must come first); others go alone."""
    n_dec = 0
    while n_dec < len(seqs) and seqs[n_dec].num_new == 1 and seqs[n_dec].start > 0:
        n_dec += 1
    groups = [list(seqs[:n_dec])] if n_dec else []
    groups += [[s] for s in seqs[n_dec:]]
    return groups


class ContiguousCache(_Backend):
    """The textbook layout: per layer K and V of [slots, kv_heads, max_len, head_dim]."""

    name = "contiguous"

    def __init__(self, num_layers, num_slots, num_kv_heads, max_len, head_dim, dtype, device):
        super().__init__(num_layers, device)
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def prepare(self, seqs: Sequence[SeqSlice]) -> AttentionMetadata:
        groups, tok = [], 0
        slot_tok, pos_tok = [], []
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
        self.k[layer][md.slot_ids, :, md.positions] = k  # [tokens, kv_heads, dim] into the textbook layout
        self.v[layer][md.slot_ids, :, md.positions] = v

    def gather(self, layer, g: AttnGroup, k, v):
        if g.num_seqs == 1:
            s = int(g.slot_ids[0])
            return self.k[layer][s:s + 1, :, :g.ctx_len], self.v[layer][s:s + 1, :, :g.ctx_len]
        return self.k[layer][g.slot_ids, :, :g.ctx_len], self.v[layer][g.slot_ids, :, :g.ctx_len]

    def seq_len_capacity(self) -> int:
        return self.max_len


class PagedCache(_Backend):
    """Block pools per layer: K and V of [num_blocks, block_size, kv_heads, head_dim].

    Single-token decodes attend through kvinfer.kernels.paged_decode_attention, which reads each sequence's
    blocks in place, when the pools are float32 on CPU and the kernels are available; otherwise, and for
    prefills that follow cached tokens, whole blocks are gathered and attended with SDPA.
    """

    name = "paged"
    use_decode_kernel = True  # tests switch it off to compare with the gather path

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        super().__init__(num_layers, device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._kernel_ok: Optional[bool] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _decode_kernel(self) -> bool:
        if not self.use_decode_kernel:
            return False
        if self._kernel_ok is None:
            from kvinfer import kernels

            self._kernel_ok = (self.device.type == "cpu" and self.k[0].dtype == torch.float32
                               and kernels.available())
        return self._kernel_ok

    def _slots(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # table [b, blocks], pos [b, n] -> flat slot of each position [b, n]
        return table.gather(1, pos // self.block_size) * self.block_size + pos % self.block_size

    def prepare(self, seqs: Sequence[SeqSlice]) -> AttentionMetadata:
        bs = self.block_size
        groups, tok, slot_parts = [], 0, []
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
            if q_len == 1 and members[0].start > 0 and self._decode_kernel():
                g.decode_tables, g.decode_lens = tables, lens  # read in place: no mask, no gather
            else:
                self._mask_group(g, q_pos, lens, b == 1)
            if g.decode_tables is None and not (b == 1 and members[0].start == 0):
                g.gather_idx = tables  # [b, blocks]: whole blocks are copied, not single slots
            slot_parts.append(self._slots(tables, q_pos).reshape(-1))
            groups.append(g)
            tok += b * q_len
        return AttentionMetadata(groups=groups, slot_mapping=torch.cat(slot_parts) if slot_parts else None)

    def store(self, layer, k, v, md) -> None:
        super().store(layer, k, v, md)
        kf = self.k[layer].view(-1, self.num_kv_heads, self.head_dim)  # [slots, kv_heads, dim]
        vf = self.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        kf.index_copy_(0, md.slot_mapping, k)
        vf.index_copy_(0, md.slot_mapping, v)

    def decode_attend(self, layer: int, g: AttnGroup, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [b, heads, dim] of a decode group -> [b, heads, dim], read from the block pools in place."""
        from kvinfer import kernels

        return kernels.paged_decode_attention(q.contiguous(), self.k[layer], self.v[layer], g.decode_tables,
                                              g.decode_lens, scale, alibi_slopes=self.alibi,
                                              sliding_window=self.sliding_window)

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
        for layer in range(self.num_layers):
            self.k[layer][dst] = self.k[layer][src]
            self.v[layer][dst] = self.v[layer][src]
