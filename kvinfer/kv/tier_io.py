"""The KV tiers built for one engine: a pool block's bytes copied out of and into the cache tensors, the
fingerprint of what those bytes mean, and the tiers the flags ask for."""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from kvinfer.kv.tier_stores import RedisTier, open_disk
from kvinfer.kv.tiers import KVTiers, RamTier, Tier, env_switches, file_identity, fingerprint

log = logging.getLogger("kvinfer")

DEFAULT_DIR_SIZE = 10 << 30  # --kv-cache-dir without --kv-cache-dir-size


def block_tensors(cache) -> list[torch.Tensor]:
    """Every per-layer tensor of a paged cache whose first dimension is the block: keys, values, scales."""
    return list(cache.k) + list(cache.v) + list(cache.k_scale) + list(cache.v_scale)


def block_nbytes(cache) -> int:
    return sum(t[0].numel() * t.element_size() for t in block_tensors(cache))


def block_copier(cache):
    """(read(block id) -> bytes, write(block id, payload)) over the cache's tensors, in a fixed order."""
    tensors = block_tensors(cache)
    sizes = [t[0].numel() * t.element_size() for t in tensors]
    total = sum(sizes)

    def read(bid: int) -> bytes:
        out = np.empty(total, dtype=np.uint8)
        pos = 0
        for t, n in zip(tensors, sizes):
            out[pos:pos + n] = t[bid].view(torch.uint8).reshape(-1).cpu().numpy()
            pos += n
        return out.tobytes()

    def write(bid: int, payload) -> None:
        src = np.frombuffer(payload, dtype=np.uint8, count=total)
        pos = 0
        for t, n in zip(tensors, sizes):
            dst = t[bid].view(torch.uint8).reshape(-1)
            if dst.device.type == "cpu":
                dst.numpy()[:] = src[pos:pos + n]
            else:
                dst.copy_(torch.from_numpy(src[pos:pos + n].copy()))
            pos += n

    return read, write


def cache_fingerprint(config, loaded, cache, prompt_route: bool) -> bytes:
    """Everything that changes a block's bytes: the model (its files' identity, or a dummy's preset and seed), how
    it was loaded (dtype, quantised kernels), the cache layout (KV dtype, block size, every tensor's shape), and the
    routes that change a row's arithmetic (the prompt route, the kernels' switches)."""
    from kvinfer import kernels

    src = loaded.source
    parts = {
        "model": file_identity(src.path).hex() if src.kind != "dummy" else f"dummy:{config.model}:{config.seed}",
        "kind": src.kind, "dtype": str(loaded.dtype), "device": loaded.device.type,
        "quantized_modules": loaded.quantized_modules, "kv_dtype": cache.kv_dtype, "block_size": config.block_size,
        "tensors": [(tuple(t.shape[1:]), str(t.dtype)) for t in block_tensors(cache)],
        "prompt_route": prompt_route, "kernels": kernels.available(), "batch_invariant": kernels.batch_invariant(),
        "env": env_switches(),
    }
    return fingerprint(parts)


def copy_ahead_blocks(config, block_bytes: int) -> int:
    """How many blocks at the head of the pool's free queue the RAM tier copies ahead of their eviction: what two
    steps can allocate (a step's token budget in blocks, plus a block per sequence), at most a quarter of the RAM
    tier (those copies are also still in the pool). 0: none, every eviction copies on the spot."""
    if not config.kv_offload_memory:
        return 0
    bs = config.block_size
    per_step = -(-config.max_num_batched_tokens // bs) + config.max_num_seqs
    return min(2 * per_step, config.kv_offload_memory // block_bytes // 4)


def make_tiers(config, loaded, cache, manager, prompt_route: bool, one_rank: bool = True) -> Optional[KVTiers]:
    """The tiers the flags ask for, attached to the manager (None if none); a disk directory that cannot be used is
    refused; an unreachable Redis is logged (it may come up later). Paged caches with prefix caching only: the tiers are keyed by the prefix cache's hashes."""
    if not (config.kv_offload_memory or config.kv_cache_dir or config.kv_cache_redis):
        return None
    if not (getattr(manager, "prefix_caching", False) and hasattr(manager, "attach_tiers") and one_rank):
        log.warning("KV tiers need the paged cache with prefix caching, on one rank; they are off")
        return None
    fp = cache_fingerprint(config, loaded, cache, prompt_route)
    nbytes = block_nbytes(cache)
    tiers: list[Tier] = []
    if config.kv_offload_memory:
        tiers.append(RamTier(config.kv_offload_memory))
    if config.kv_cache_dir:
        tiers.append(open_disk(config.kv_cache_dir, config.kv_cache_dir_size or DEFAULT_DIR_SIZE, fp, nbytes))
    if config.kv_cache_redis:
        tiers.append(RedisTier(config.kv_cache_redis, fp, nbytes))
    if not tiers:
        return None
    read, write = block_copier(cache)
    out = KVTiers(fp, nbytes, read, write, tiers, ahead=copy_ahead_blocks(config, nbytes),
                  block_tokens=config.block_size)
    manager.attach_tiers(out)
    log.info("KV tiers below the pool: %s (%d bytes per block)", out.describe(), nbytes)
    return out
