"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral): config, names of the router and experts, and the
expert metadata of a GGUF file."""
from __future__ import annotations

import re
from typing import Iterable

import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import ModelLoadError, UnsupportedError
from kvinfer.models.families.common import cat_rows
from kvinfer.models.families.llama import llama_like, map_llama
from kvinfer.models.families.qwen import qwen_window
from kvinfer.models.families.registry import Family, GGUFNames, register


def _moe_flags(d: dict, arch: str, experts_key: str, norm_topk: bool, expert_size_key: str) -> dict:
    if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedError(f"{arch} with dense layers among the expert layers (mlp_only_layers, "
                               "decoder_sparse_step) is not supported (supported: experts in every layer)")
    # transformers 5 writes num_local_experts for every family; released Qwen configs say num_experts.
    experts, k = int(d.get(experts_key) or d["num_local_experts"]), int(d["num_experts_per_tok"])
    if not 0 < k <= experts:
        raise UnsupportedError(f"{arch} config has num_experts_per_tok={k}, needs 1 to {experts_key}={experts}")
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=int(d[expert_size_key]),
                norm_topk_prob=norm_topk, shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size")
                                                                               or 0))


def _from_qwen3_moe(d):
    return llama_like(d, "qwen3_moe", head_dim_default=128, sliding_window=qwen_window(d, "qwen3_moe"),
                      qk_norm=True, mlp_bias=False,
                      **_moe_flags(d, "qwen3_moe", "num_experts", bool(d.get("norm_topk_prob", False)),
                                   "moe_intermediate_size"))


def _from_qwen2_moe(d):
    return llama_like(d, "qwen2_moe", sliding_window=qwen_window(d, "qwen2_moe"), qkv_bias=True, o_bias=False,
                      mlp_bias=False,
                      **_moe_flags(d, "qwen2_moe", "num_experts", bool(d.get("norm_topk_prob", False)),
                                   "moe_intermediate_size"))


def _from_mixtral(d):
    # Mixtral always renormalises its top-k weights; the experts are intermediate_size wide.
    window = d.get("sliding_window")
    return llama_like(d, "mixtral", sliding_window=int(window) if window else None, qkv_bias=False, o_bias=False,
                      mlp_bias=False, **_moe_flags(d, "mixtral", "num_local_experts", True, "intermediate_size"))


_MOE_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                     r"(gate\.weight|shared_expert_gate\.weight|experts\.\d+\.\w+\.weight|shared_expert\.\w+\.weight)$")
_EXPERT_RE = re.compile(r"^(experts\.\d+|shared_expert)\.(\w+)\.weight$")
# Qwen's projection names and Mixtral's (w1 gate, w3 up, w2 down).
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def map_moe(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    found: dict[tuple[int, str], torch.Tensor] = {}

    def attention_and_norms():
        for name, t in tensors:
            m = _MOE_RE.match(name)
            if m:
                found[(int(m.group(1)), m.group(2))] = t
            else:
                yield name, t

    out = map_llama(cfg, attention_and_norms())
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for (i, rest), t in found.items():
        if rest == "gate.weight":
            out[f"layers.{i}.mlp.router.weight"] = t
        elif rest == "shared_expert_gate.weight":
            out[f"layers.{i}.mlp.shared_gate.weight"] = t
        else:
            who, proj = _EXPERT_RE.match(rest).groups()
            if proj not in _PART:
                raise ModelLoadError(f"unexpected tensor {rest!r} in layer {i} of a {cfg.architecture} checkpoint")
            parts.setdefault((i, "shared" if who == "shared_expert" else who), {})[_PART[proj]] = t
    for (i, who), p in parts.items():
        if set(p) != {"gate", "up", "down"}:
            raise ModelLoadError(f"layer {i} {who} lacks {sorted({'gate', 'up', 'down'} - set(p))}")
        out[f"layers.{i}.mlp.{who}.gate_up.weight"] = cat_rows([p["gate"], p["up"]])
        out[f"layers.{i}.mlp.{who}.down.weight"] = p["down"]
    return out


def gguf_experts(h, d: dict) -> None:
    """A GGUF file's experts (header h as GGUFNames.config gets it): experts in every layer, softmax routing, top-k
    weights renormalised for llama/Mixtral and qwen3moe and taken as they are for qwen2moe (llama.cpp hard-wires
    each, whatever norm_topk_prob the Hugging Face config had)."""
    arch = h.arch
    if arch not in ("llama", "qwen3moe", "qwen2moe"):
        raise UnsupportedError(f"GGUF file {h.path}: expert tensors in a {arch} file are not supported "
                               "(supported: llama (Mixtral), qwen3moe, qwen2moe)")
    gating = h.opt("expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedError(f"GGUF file {h.path}: {arch}.expert_gating_func={gating!r} is not supported "
                               "(supported: 1, softmax)")
    scale = h.opt("expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise UnsupportedError(f"GGUF file {h.path}: {arch}.expert_weights_scale={scale!r} is not supported "
                               "(supported: 1.0)")
    # qwen2moe's shared expert is read by its own config hook (_qwen2moe_shared); no other file's is.
    if any(n.startswith("blk.") and (("_shexp." in n and arch != "qwen2moe") or "_chexp" in n) for n in h.infos):
        raise UnsupportedError(f"GGUF file {h.path}: shared-expert tensors (ffn_*_shexp) in a {arch} file are not "
                               "supported (supported: qwen2moe)")
    n = d["num_hidden_layers"]
    parts = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    dense = [i for i in range(n) if any(f"blk.{i}.{p}.weight" not in h.infos for p in parts)]
    if dense:
        raise UnsupportedError(f"GGUF file {h.path}: layers {dense[:8]} lack expert tensors ({', '.join(parts)}); "
                               "dense layers among expert layers are not supported")
    experts = h.need("expert_count")
    d["num_experts"] = d["num_local_experts"] = experts
    d["num_experts_per_tok"] = h.need("expert_used_count")
    d["norm_topk_prob"] = arch != "qwen2moe"
    if arch == "llama":
        d["model_type"] = "mixtral"  # its experts are feed_forward_length wide
    else:
        d["moe_intermediate_size"] = h.need("expert_feed_forward_length")


# Qwen2-MoE's shared expert in a GGUF file: a SwiGLU of its own width, and the row of weights giving its gate.
_SHEXP_NAMES = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}


def _qwen2moe_shared(h, d: dict) -> None:
    """qwen2moe: the shared expert's width (expert_shared_feed_forward_length; llama.cpp takes feed_forward_length
    when the key is absent) and its tensors, required in every layer as llama.cpp requires them. The gate
    ffn_gate_inp_shexp is one row of hidden weights: the converter writes it [1, hidden], llama-quantize drops the
    unit dimension and writes it 1-D; both are taken (_map_qwen2moe_gguf gives the 1-D one its row shape)."""
    inter = h.opt("expert_shared_feed_forward_length", d["intermediate_size"])
    if type(inter) is not int or inter <= 0:
        raise UnsupportedError(f"GGUF file {h.path}: metadata qwen2moe.expert_shared_feed_forward_length={inter!r} "
                               "is not supported (need an integer > 0)")
    hid = d["hidden_size"]
    want = {"ffn_gate_shexp": [(inter, hid)], "ffn_up_shexp": [(inter, hid)], "ffn_down_shexp": [(hid, inter)],
            "ffn_gate_inp_shexp": [(hid,), (1, hid)]}  # torch order
    for i in range(d["num_hidden_layers"]):
        for part, shapes in want.items():
            name = f"blk.{i}.{part}.weight"
            if name not in h.infos:
                raise ModelLoadError(f"GGUF file {h.path} lacks the tensor {name} (a qwen2moe file has a shared "
                                     f"expert in every layer: {', '.join(want)})")
            got = tuple(h.infos[name].shape)
            if got not in shapes:
                implied = " or ".join(str(list(reversed(s))) for s in shapes)
                raise ModelLoadError(f"GGUF file {h.path}: tensor {name} has shape {list(reversed(got))}, the "
                                     f"header's metadata implies {implied} (GGUF order)")
    d["shared_expert_intermediate_size"] = inter


def _map_qwen2moe_gguf(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return map_moe(cfg, ((n, t.reshape(1, -1) if t.dim() == 1 and n.endswith(".shared_expert_gate.weight") else t)
                         for n, t in tensors))


register(Family("qwen3_moe", "qwen3_moe", _from_qwen3_moe, map_moe, GGUFNames("qwen3moe")))
register(Family("qwen2_moe", "qwen2_moe", _from_qwen2_moe, map_moe,
                GGUFNames("qwen2moe", layer_names=_SHEXP_NAMES, config=_qwen2moe_shared,
                          weight_map=_map_qwen2moe_gguf)))
register(Family("mixtral", "mixtral", _from_mixtral, map_moe))  # in a GGUF file: the llama architecture, experts
