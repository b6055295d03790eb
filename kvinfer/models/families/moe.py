"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral): Hugging Face names of the router and experts."""
from __future__ import annotations

import re
from typing import Iterable

import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import ModelLoadError

_MOE_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                     r"(gate\.weight|shared_expert_gate\.weight|experts\.\d+\.\w+\.weight|shared_expert\.\w+\.weight)$")
_EXPERT_RE = re.compile(r"^(experts\.\d+|shared_expert)\.(\w+)\.weight$")
# Qwen's projection names and Mixtral's (w1 gate, w3 up, w2 down).
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def map_moe(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from kvinfer.models.weights import cat_rows, map_llama

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
