"""Which GGUF matrices stay quantized for the kernels and which are widened to float32 (and the line saying so)."""
from __future__ import annotations

import math
import re
from pathlib import Path

from kvinfer.loaders.dequant import type_name

# Checkpoint matrices the decoder fuses into one layer (q/k/v, gate/up, and each expert's gate/up): the kernels
# take a fused layer whose parts are all kernel types (one QuantLinear, or one per part where the types differ,
# as in Q4_K_M), so the parts are kept quantized (lazy) together or widened together.
_FUSED_GROUP = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _fusion_group(hf_name: str) -> str:
    m = re.match(r"(model\.layers\.\d+\.[\w.]+\.)(\w+)\.weight$", hf_name)
    if not m or m.group(2) not in _FUSED_GROUP:
        return hf_name
    return m.group(1) + _FUSED_GROUP[m.group(2)]


_FUSION_RANK = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 3, "up_proj": 4}


def fusion_order(hf_name: str) -> tuple:
    """A sort key putting a layer's fused parts side by side in the decoder's order (q, k, v; gate, up)."""
    m = re.match(r"model\.layers\.(\d+)\.\w+\.(\w+)\.(weight|bias)$", hf_name)
    if not m:
        return (-1, 0, hf_name)
    return (int(m.group(1)), _FUSION_RANK.get(m.group(2), 9), m.group(3), hf_name)


def lazy_names(names: dict[str, str], infos: dict[str, tuple], lazy_types: frozenset) -> set[str]:
    """HF names of the matrices left quantized: 2-D (or stacked experts, 3-D), not a router, and every part of their
    fused group of a type the kernels take (lazy_types) (a group of Q4_K q/k with a Q6_K v stays quantized in parts;
    one with any other type is widened whole).

    names: GGUF name -> HF name; infos: GGUF name -> (shape, type id)."""
    group_types: dict[str, set[str]] = {}
    for gname, hf in names.items():
        group_types.setdefault(_fusion_group(hf), set()).add(type_name(infos[gname][1]))
    out = set()
    for gname, hf in names.items():
        types = group_types[_fusion_group(hf)]
        # The routers stay float (the experts' and Qwen2-MoE's shared expert's gate): their few rows decide the
        # experts, and llama.cpp leaves them unquantized too.
        if len(infos[gname][0]) in (2, 3) and types <= lazy_types and \
                not hf.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight")):
            out.add(hf)
    return out


def widening_note(path: Path, widened: list[tuple[str, str, tuple, int]]) -> str:
    """One line: which matrices are widened to float32 (by type, and by kind of tensor) and what that costs."""
    by_type: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    f32 = nbytes = 0
    for gname, tname, shape, n in widened:
        by_type[tname] = by_type.get(tname, 0) + 1
        kind = re.sub(r"^blk\.\d+\.", "", gname)
        by_kind[kind] = by_kind.get(kind, 0) + 1
        f32 += math.prod(shape) * 4
        nbytes += n
    types = ", ".join(f"{t} x{c}" for t, c in sorted(by_type.items(), key=lambda kv: -kv[1]))
    kinds = ", ".join(f"{k} x{c}" for k, c in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    return (f"GGUF file {path}: {len(widened)} matrices widened to float32, the kernels do not take them "
            f"({types}; {kinds}): {f32 / 2**20:.1f} MiB of float32 for {nbytes / 2**20:.1f} MiB in the file")


def expected_shape(hf_name: str, cfg) -> tuple[int, ...] | None:
    """The torch-order shape a tensor must have under the model config (None: not a tensor checked here)."""
    h, q, kv, ffn = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, h)
    if hf_name == "model.norm.weight":
        return (h,)
    m = re.fullmatch(r"model\.layers\.\d+\.([\w.]+)\.(weight|bias)", hf_name)
    if not m:
        return None
    n, e = cfg.num_experts, cfg.moe_intermediate_size
    rows_cols = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (ffn, h), "mlp.up_proj": (ffn, h),
                 "mlp.down_proj": (h, ffn), "input_layernorm": (h,), "post_attention_layernorm": (h,),
                 "pre_feedforward_layernorm": (h,), "post_feedforward_layernorm": (h,),
                 "self_attn.q_norm": (cfg.head_dim,), "self_attn.k_norm": (cfg.head_dim,),
                 "self_attn.qkv_proj": (q + 2 * kv, h), "mlp.gate_up_proj": (2 * ffn, h),
                 "mlp.gate": (n, h), "mlp.experts.gate_proj": (n, e, h), "mlp.experts.up_proj": (n, e, h),
                 "mlp.experts.down_proj": (n, h, e)}.get(m.group(1))
    if rows_cols is None:
        return None
    return rows_cols[:1] if m.group(2) == "bias" else rows_cols
