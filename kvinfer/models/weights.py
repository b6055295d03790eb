"""Checkpoint tensors onto the decoder's parameters, through the family's weight-name map (kvinfer/models/families/)."""
from __future__ import annotations

from typing import Iterable

import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import ModelLoadError
from kvinfer.models.families import by_architecture


def load_into(model: torch.nn.Module, cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
              from_gguf: bool = False) -> None:
    """Map checkpoint tensors onto `model`'s parameters; every parameter must be filled exactly once.

    from_gguf: the tensors come from the GGUF loader (as llama.cpp's converter wrote them)."""
    family = by_architecture(cfg.architecture)
    if family is None:
        raise ModelLoadError(f"no weight map for architecture {cfg.architecture!r}")
    # A family whose GGUF tensors need another map than its checkpoints' says so in its GGUFNames.
    mapper = (from_gguf and family.gguf and family.gguf.weight_map) or family.weight_map
    state = mapper(cfg, tensors)
    params = dict(model.named_parameters())
    if "lm_head.weight" in state and "lm_head.weight" not in params:
        state.pop("lm_head.weight")  # tied checkpoints sometimes store the head anyway
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in state.items():
        p = params[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(t.shape)}, the config implies {tuple(p.shape)}")
    # assign=True adopts the checkpoint tensors instead of copying them (the loader converts dtype and
    # device afterwards, once).
    model.load_state_dict({k: _aligned(t) for k, t in state.items()}, strict=True, assign=True)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # BLAS kernels pick code paths by alignment; a misaligned weight (e.g. inside a safetensors file) could
    # change results in the last bit, so adopt only contiguous 64-byte-aligned tensors, copy the rest.
    if t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)
