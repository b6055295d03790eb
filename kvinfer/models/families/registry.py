"""The family registry: each family's file registers what kvinfer knows of it, and loaders look it up here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from kvinfer.config import ModelConfig

# (config, checkpoint tensors under their own names) -> the decoder's parameters by name
WeightMap = Callable[[ModelConfig, Iterable[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class GGUFNames:
    """How llama.cpp writes a family: its GGUF architecture and where its tensors and metadata differ from Llama's.

    config(header, d) fills the Hugging Face config dict d from the family's own metadata; the header (the GGUF
    loader's) offers path, arch, infos (tensor name -> info with .shape), opt(key, default), need(key) and
    values(tensor name) (a small tensor's values as a list of floats)."""

    architecture: str  # general.architecture
    layer_names: dict[str, str] = field(default_factory=dict)  # GGUF layer name -> HF, beyond llama.py's table
    config: Optional[Callable[[Any, dict], None]] = None
    own_rope: bool = False  # config reads the RoPE scaling itself (the generic rope.scaling keys do not apply)
    config_tensors: tuple[str, ...] = ()  # tensors read into the config, not loaded as weights
    permuted: bool = False  # the converter permuted q/k rows for interleaved RoPE (llama.cpp's permute())
    weight_map: Optional[WeightMap] = None  # when the GGUF tensors need another map than the checkpoints'


@dataclass(frozen=True)
class Family:
    model_type: str  # Hugging Face config.json model_type
    architecture: str  # ModelConfig.architecture the normaliser gives
    from_hf: Callable[[dict], ModelConfig]  # config.json dict -> ModelConfig
    weight_map: WeightMap
    gguf: Optional[GGUFNames] = None


FAMILIES: dict[str, Family] = {}  # by model_type
_BY_ARCHITECTURE: dict[str, Family] = {}
GGUF_FAMILIES: dict[str, Family] = {}  # by GGUF architecture


def register(family: Family) -> Family:
    for table, key in ((FAMILIES, family.model_type), (_BY_ARCHITECTURE, family.architecture)):
        if key in table:
            raise ValueError(f"family {key!r} is registered twice")
        table[key] = family
    if family.gguf is not None:
        GGUF_FAMILIES[family.gguf.architecture] = family
    return family


def by_architecture(architecture: str) -> Optional[Family]:
    return _BY_ARCHITECTURE.get(architecture)
