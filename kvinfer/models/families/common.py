"""Helpers more than one family's file uses: Hugging Face config fields, RoPE scaling, fusing and renaming tensors."""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable, Optional

import torch

from kvinfer.config import ModelConfig, RopeScaling
from kvinfer.errors import ModelLoadError, UnsupportedError

# Hugging Face activation names; "gelu_new" and "gelu_fast" are the tanh approximation written out.
GELU_NAMES = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


def eos_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


def _yarn_parameters(rs: dict, d: dict, original: int) -> dict:
    """YaRN's factor, attention factor and band, as transformers derives them from a config."""
    factor = rs.get("factor") or d.get("max_position_embeddings", original) / original
    if factor <= 0:
        raise UnsupportedError(f"rope_scaling yarn needs a factor > 0, not {factor!r}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rs.get("attention_factor")
    if attention is None:
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            attention = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
        else:
            attention = mscale(factor)
    return dict(factor=float(factor), attention_factor=float(attention), beta_fast=float(rs.get("beta_fast") or 32),
                beta_slow=float(rs.get("beta_slow") or 1), truncate=bool(rs.get("truncate", True)))


def rope_scaling(d: dict, rs: Optional[dict] = None) -> Optional[RopeScaling]:
    """d's RoPE scaling, or that of rs (one layer type's parameters, Gemma 3)."""
    if rs is None:
        rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    if kind not in ("linear", "llama3", "longrope", "yarn"):
        raise UnsupportedError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3, longrope, "
                               "yarn)")
    original = rs.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") or (
        d.get("max_position_embeddings") if kind == "yarn" else None) or 8192
    kw = {}
    if kind == "yarn":
        kw = _yarn_parameters(rs, d, original)
    if kind == "longrope":
        # As transformers: the attention factor follows from how far the context was stretched, unless given.
        factor = rs.get("factor") or d.get("max_position_embeddings", original) / original
        attention = rs.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        kw = dict(short_factor=tuple(float(x) for x in rs["short_factor"]),
                  long_factor=tuple(float(x) for x in rs["long_factor"]), attention_factor=float(attention))
    return RopeScaling(
        type=kind,
        factor=float(kw.pop("factor", rs.get("factor") or 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        **kw,
    )


def rope_theta(d: dict) -> float:
    if "rope_theta" in d:
        return float(d["rope_theta"])
    rp = d.get("rope_parameters") or {}
    return float(rp.get("rope_theta", 10000.0))


def unsupported_if(arch: str, d: dict, key: str, default: Any, ok: Any) -> None:
    if d.get(key, default) != ok:
        raise UnsupportedError(f"{arch} with {key}={d.get(key, default)!r} is not supported (supported: {ok!r})")


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0, but a free view when the parts already sit back to back in one buffer.

    The GGUF loader lays q, k, v (and gate, up) out adjacently, so fusing them costs no copy.
    """
    first = parts[0]
    if all(p.is_meta for p in parts):  # shape-only placeholders (matrices kept as quantised blocks)
        return torch.empty((sum(p.shape[0] for p in parts), *first.shape[1:]), dtype=first.dtype, device="meta")
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:]
                   and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts)
    if adjacent:
        for a, b in zip(parts, parts[1:]):
            if a.storage_offset() + a.numel() != b.storage_offset():
                adjacent = False
                break
    if not adjacent:
        return torch.cat(parts, dim=0)
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


# (our name, an optional reshape of the checkpoint tensor)
Rule = tuple[str, Optional[Callable[[ModelConfig, torch.Tensor], torch.Tensor]]]
_H_RE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)$")


def map_renamed(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], global_rules: dict[str, Rule],
                layer_rules: dict[str, Rule], skip: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """One checkpoint tensor per parameter, renamed and optionally reshaped (GPT-2, BLOOM: layers under h.N.)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        m = _H_RE.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if rest in skip:
                continue
            rule = layer_rules.get(rest)
            if rule is None:
                raise ModelLoadError(f"unexpected tensor {name!r} in a {cfg.architecture} checkpoint")
            ours, fn = rule
            out[f"layers.{i}.{ours}"] = fn(cfg, t) if fn else t
            continue
        short = name[len("transformer."):] if name.startswith("transformer.") else name
        rule = global_rules.get(short)
        if rule is None:
            raise ModelLoadError(f"unexpected tensor {name!r} in a {cfg.architecture} checkpoint")
        ours, fn = rule
        out[ours] = fn(cfg, t) if fn else t
    return out
