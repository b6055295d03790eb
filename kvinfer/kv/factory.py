"""The KV backend chosen once: `KVSpec` (the budget turned into plain data) and a matching (manager, cache) pair.

Torch is imported only to build the tensors, so the simulator plans and runs the bookkeeping without it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvinfer.config import EngineConfig, ModelConfig, kv_element_bytes
from kvinfer.errors import ValidationError
from kvinfer.kv.interface import KVManager
from kvinfer.kv.manager import NullManager, PagedKVManager, SlotManager
from kvinfer.utils import format_bytes

if TYPE_CHECKING:
    import torch

    from kvinfer.kv.cache import _Backend


@dataclass(frozen=True)
class KVSpec:
    """Everything that builds a backend; plain data, so tensor-parallel ranks build the same cache from it."""

    kind: str  # "paged" | "contiguous" | "none"
    num_layers: int
    count: int  # blocks (paged) or slots (contiguous)
    block_size: int
    num_kv_heads: int  # this rank's share under tensor parallelism
    max_len: int  # the context window: a contiguous slot's length
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kv_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8 | bfloat16
    enable_prefix_caching: bool = True
    sliding_window: Optional[int] = None


def kv_storage_dtype(kind: str, kv_cache_dtype: str) -> str:
    # Every backend, `none` included: it keeps no cache, but rounds (bfloat16) or quantises (int8 / fp8) its own
    # K/V as a cache of that dtype stores them, so that the backends agree bit for bit
    return kv_cache_dtype


def kv_bytes_per_token(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> int:
    import torch

    return mc.kv_bytes_per_token(*kv_element_bytes(kv_storage_dtype(config.kv_cache, config.kv_cache_dtype),
                                                   mc.head_dim, torch.empty((), dtype=dtype).element_size()))


def kv_layout(kind: str, bytes_per_token: int, block_size: int, max_len: int, max_num_seqs: int, budget: int,
              allow_no_slot: bool = False) -> tuple[int, int]:
    """(blocks or slots, bytes) a budget buys; raises if not even one fits (the simulator may show a contiguous
    cache without a slot: it rejects every request)."""
    if kind == "paged":
        block = bytes_per_token * block_size
        count = budget // block
        if count < 1:  # a block pool needs one block to exist at all
            raise ValidationError("kv_cache_memory", budget,
                                  f"too small for one block of {block_size} tokens ({format_bytes(block)})")
        return count, count * block
    if kind == "contiguous":
        per_slot = bytes_per_token * max_len
        count = min(budget // per_slot, max_num_seqs)
        if count < 1 and not allow_no_slot:
            raise ValidationError("kv_cache_memory", budget,
                                  f"too small for one contiguous slot of max_model_len={max_len} "
                                  f"tokens ({format_bytes(per_slot)})")
        return count, count * per_slot
    return 0, 0


def make_manager(kind: str, count: int, block_size: int, max_len: int, enable_prefix_caching: bool = True,
                 prompt_roles: bool = False) -> KVManager:
    """The bookkeeping alone (the simulator runs it without tensors). prompt_roles: the runner computes prompt
    rows by their own route (ModelRunner.prompt_route_for), so paged blocks' hashes count their prompt tokens."""
    if kind == "paged":
        return PagedKVManager(count, block_size, enable_prefix_caching, prompt_roles)
    if kind == "contiguous":
        return SlotManager(count, max_len)
    return NullManager()


def make_cache(spec: KVSpec, alibi: Optional[torch.Tensor] = None) -> _Backend:
    """The cache tensors alone (what a tensor-parallel worker holds); alibi: the model's slopes, if it uses them."""
    from kvinfer.kv.cache import ContiguousCache, NoCache, PagedCache

    s = spec
    if s.kind == "paged":
        cache = PagedCache(s.num_layers, s.count, s.block_size, s.num_kv_heads, s.head_dim, s.dtype, s.device,
                           s.kv_dtype)
    elif s.kind == "contiguous":
        cache = ContiguousCache(s.num_layers, s.count, s.num_kv_heads, s.max_len, s.head_dim, s.dtype, s.device,
                                s.kv_dtype)
    else:
        cache = NoCache(s.num_layers, s.device, s.dtype, s.kv_dtype)
    cache.sliding_window = s.sliding_window
    cache.alibi = alibi
    return cache


def make_kv(spec: KVSpec, alibi: Optional[torch.Tensor] = None, prompt_roles: bool = False
            ) -> tuple[KVManager, _Backend]:
    """A manager and the cache it describes: the only place a backend is picked by name. prompt_roles: as for
    make_manager (the manager's alone: the cache, which tensor-parallel ranks also build, does not depend on it)."""
    manager = make_manager(spec.kind, spec.count, spec.block_size, spec.max_len, spec.enable_prefix_caching,
                           prompt_roles)
    return manager, make_cache(spec, alibi)


def spec_for(config: EngineConfig, mc: ModelConfig, bytes_per_token: int, max_len: int, budget: int,
             dtype: torch.dtype, device: torch.device) -> KVSpec:
    """The engine's backend from its flags; mc holds this rank's share of the KV heads."""
    count, _ = kv_layout(config.kv_cache, bytes_per_token, config.block_size, max_len, config.max_num_seqs, budget)
    return KVSpec(config.kv_cache, mc.num_layers, count, config.block_size, mc.num_kv_heads, max_len, mc.head_dim,
                  dtype, device, kv_storage_dtype(config.kv_cache, config.kv_cache_dtype),
                  config.enable_prefix_caching, mc.sliding_window)
