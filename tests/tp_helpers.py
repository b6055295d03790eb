"""Spawned-process helpers for the tensor-parallel tests: one gloo job shards tiny models of every family."""
from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch

from kvinfer.config import ModelConfig

# heads 6: TP 2 and 3 both divide it; KV heads 6 or 1 work at both sizes (1: replicated), 2 and 3 split.
BASE = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=6,
            head_dim=8, max_position_embeddings=64)
FAMILIES = {
    "llama": dict(architecture="llama", num_kv_heads=1),
    "qwen2": dict(architecture="qwen2", qkv_bias=True),
    "qwen3": dict(architecture="qwen3", qk_norm=True, head_dim=16, num_kv_heads=1),
    "mistral": dict(architecture="mistral", sliding_window=6),
    "gpt2": dict(architecture="gpt2", position="learned", norm="layer", norm_bias=True, mlp="gelu",
                 activation="gelu_tanh", qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "bloom": dict(architecture="bloom", position="alibi", norm="layer", norm_bias=True, embedding_norm=True,
                  mlp="gelu", activation="gelu_tanh", qkv_bias=True, o_bias=True, mlp_bias=True,
                  tie_word_embeddings=True),
    # Mixtures: experts dealt out whole (5 experts: 3, 2 at TP 2; 2, 2, 1 at TP 3), a shared expert replicated.
    "qwen3_moe": dict(architecture="qwen3_moe", qk_norm=True, head_dim=16, num_kv_heads=1, num_experts=5,
                      num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False),
    "qwen2_moe": dict(architecture="qwen2_moe", qkv_bias=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=False, shared_expert_intermediate_size=40),
    "mixtral": dict(architecture="mixtral", num_experts=3, num_experts_per_tok=2, moe_intermediate_size=24),
}
# (family, tp, extra config): every family at both sizes, plus grouped KV heads split across ranks.
CASES = [(f, tp, {}) for f in FAMILIES for tp in (2, 3)] + [("llama", 2, dict(num_kv_heads=2)),
                                                          ("llama", 3, dict(num_kv_heads=3))]
PROMPT = [5, 17, 3, 99, 42, 7, 64, 12, 33, 8, 21, 90, 4]  # 13 tokens: crosses 4-token blocks and the window
FEED = [11, 57, 2, 76, 30, 45]  # decoded one per step


def config_of(family: str, extra: dict) -> ModelConfig:
    return ModelConfig(**{**BASE, **FAMILIES[family], **extra})


def build(cfg: ModelConfig, seed: int = 0):
    """The same random decoder on every rank (seeded), biases and norms random too so that every path counts; its
    linears on the fixed-order kernel, as the loader sets them (BLAS would pick its order from the shard's shape)."""
    from kvinfer.loaders.model_loader import build_model
    from kvinfer.models.quantize import use_kernel_linears

    model = build_model(cfg, cfg.max_position_embeddings, torch.float32, torch.device("cpu")).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)
    use_kernel_linears(model)
    return model


@torch.inference_mode()
def run_steps(model, cfg: ModelConfig, kv_heads: int) -> torch.Tensor:
    """Prefill PROMPT, then decode FEED one token a step over a paged cache -> log-probs [steps + 12, vocab]."""
    from kvinfer.kv.cache import PagedCache, SeqSlice

    bs, nblk = 4, 8
    kv = PagedCache(cfg.num_layers, nblk, bs, kv_heads, cfg.head_dim, torch.float32, "cpu")
    kv.sliding_window = cfg.sliding_window
    kv.alibi = model.alibi if cfg.position == "alibi" else None
    table = list(reversed(range(nblk)))
    out, start, new = [], 0, list(PROMPT)
    for t in [None] + FEED:
        if t is not None:
            new = [t]
        md = kv.prepare([SeqSlice(start, len(new), block_table=table)])
        hidden = model(torch.tensor(new), torch.arange(start, start + len(new)), md, kv)
        out.append(torch.log_softmax(model.compute_logits(hidden), dim=-1))
        start += len(new)
    return torch.cat(out)


def family_job(rank: int, world: int, port: int, results) -> None:
    """One rank of the 3-process gloo job: every CASE sharded both ways (exact, all-reduce) and run; rank 0 reports
    the largest difference from the unsharded model."""
    import torch.distributed as dist

    from kvinfer.parallel.shard import CommStats, kv_heads_per_rank, shard_decoder

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        groups = {3: dist.group.WORLD, 2: dist.new_group([0, 1])}  # every rank creates every group, in order
        for family, tp, extra in CASES:
            if rank >= tp:
                continue
            cfg = config_of(family, extra)
            ref = run_steps(build(cfg), cfg, cfg.num_kv_heads) if rank == 0 else None
            for exact in (True, False):
                model = shard_decoder(build(cfg), cfg, rank, tp, groups[tp], CommStats(), exact=exact)
                got = run_steps(model, cfg, kv_heads_per_rank(cfg, tp))
                if rank == 0:
                    same = bool((got.argmax(-1) == ref.argmax(-1)).all())
                    results.put((family, tp, cfg.num_kv_heads, exact, float((got - ref).abs().max()), same))
        dist.destroy_process_group()
    except Exception:
        results.put(("error", rank, traceback.format_exc()))
        os._exit(1)
