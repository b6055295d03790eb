"""Swaps a loaded decoder's linear layers for QuantLinear over the GGUF blocks (applied from outside the model)."""
from __future__ import annotations

import logging

from torch import nn

from kvinfer import kernels
from kvinfer.layers.moe import MoE
from kvinfer.layers.quant_linear import KernelLinear, QuantEmbedding, QuantLinear, QuantParts

log = logging.getLogger("kvinfer")


def _layer_linears(layer: nn.Module):
    """(module holding the linear, its attribute, the checkpoint tensors fused into it in order: each alternative
    naming) for every linear of a decoder layer the GGUF blocks can serve."""
    yield layer.attn, "qkv", (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                              ("self_attn.qkv_proj",))  # Phi-3's fused tensor
    yield layer.attn, "o", (("self_attn.o_proj",),)
    if isinstance(layer.mlp, MoE):
        for e, expert in enumerate(layer.mlp.experts):
            yield expert, "gate_up", ((f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj"),)
            yield expert, "down", ((f"mlp.experts.{e}.down_proj",),)
        if layer.mlp.shared is not None:  # Qwen2-MoE's shared expert
            yield layer.mlp.shared, "gate_up", (("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),)
            yield layer.mlp.shared, "down", (("mlp.shared_expert.down_proj",),)
    else:
        yield layer.mlp, "gate_up", (("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",))
        yield layer.mlp, "down", (("mlp.down_proj",),)


def kernel_types() -> set[str]:
    return set(kernels.QTYPES)


def _swap(parent: nn.Module, attr: str, new: nn.Module) -> None:
    setattr(parent, attr, new)


def quantize_from_gguf(model: nn.Module, raw: dict, keep: bool = False) -> int:
    """Replace every linear whose GGUF parts share a kernel-supported type; returns how many were swapped.

    `raw` is read_gguf(keep_raw=True).raw: HF name -> (uint8 [rows, row_bytes], type name, shape). Every batch
    reads the 4-8x smaller blocks; only with KVINFER_BATCH_INVARIANT=0, where prefills go to BLAS, the float32
    weights already loaded stay as the QuantLinear's copy for them (so nothing is dequantized twice).
    keep: fused projections are kept by packing their parts (QuantLinear.concat(keep=True)), whose bytes in `raw`
    are then given back and must not be read again.
    """
    keep_float = not kernels.batch_invariant()
    ok_types = kernel_types()
    swapped = 0
    for i, layer in enumerate(model.layers):
        for holder, attr, namings in _layer_linears(layer):
            names = next(([f"model.layers.{i}.{p}.weight" for p in parts] for parts in namings
                          if all(f"model.layers.{i}.{p}.weight" in raw for p in parts)), None)
            if names is None:
                continue
            types = {raw[n][1] for n in names}
            if not types <= ok_types or (len(types) > 1 and keep_float):
                continue
            old: nn.Linear = getattr(holder, attr)
            parts = [QuantLinear.from_raw(*raw[n]) for n in names]
            if len(types) > 1:  # mixed types (Q4_K_M): one QuantLinear per part
                if old.bias is not None:
                    for p, b in zip(parts, old.bias.detach().float().split([p.out_features for p in parts])):
                        p.bias = b.contiguous()
                _swap(holder, attr, QuantParts(parts))
                swapped += 1
                continue
            q = QuantLinear.concat(parts, keep=keep)
            if old.bias is not None:
                q.bias = old.bias.detach().float().contiguous()
            if keep_float:
                q._weight = old.weight.detach()  # the prefill copy, already dequantized by the loader
            _swap(holder, attr, q)
            swapped += 1
    emb = raw.get("model.embed_tokens.weight")
    if emb is not None and emb[1] in ok_types:
        qe = QuantEmbedding.from_raw(*emb)
        if model.lm_head is None:  # tied: the same blocks serve as the LM head
            model.lm_head = qe.as_linear()
        model.embed = qe
        swapped += 1
    head = raw.get("lm_head.weight")
    if head is not None and head[1] in ok_types and isinstance(model.lm_head, nn.Linear):
        model.lm_head = QuantLinear.from_raw(*head, kernel_max_rows=None)
        swapped += 1
    return swapped


def use_kernel_linears(model: nn.Module) -> int:
    """Swap every float nn.Linear (and a tied LM head, which shares the embedding's tensor) for KernelLinear, whose
    CPU matmuls keep a row's result independent of the batch; returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                _swap(parent, name, KernelLinear.from_linear(child))
                swapped += 1
    if getattr(model, "lm_head", 1) is None and isinstance(model.embed, nn.Embedding):
        model.lm_head = KernelLinear(model.embed.weight)  # the very same tensor: tied
        swapped += 1
    return swapped
