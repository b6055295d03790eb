"""Every supported family, one file each (or per group of close relatives): its Hugging Face config normaliser,
weight-name map, GGUF names and metadata, and any block that would bend the one decoder. Importing this package
registers them all (registry.py); adding a family is one new file here and its line below."""
from __future__ import annotations

import json
from pathlib import Path

from kvinfer.config import PRESETS, ModelConfig
from kvinfer.errors import ModelLoadError, UnsupportedError, ValidationError
from kvinfer.models.families import llama, qwen, gpt2, bloom, gemma3, phi3, moe  # noqa: F401  (each registers)
from kvinfer.models.families.registry import FAMILIES, GGUF_FAMILIES, Family, GGUFNames, by_architecture

__all__ = ["FAMILIES", "GGUF_FAMILIES", "Family", "GGUFNames", "by_architecture", "load_hf_config",
           "model_config_from_hf", "preset_config"]


def model_config_from_hf(d: dict) -> ModelConfig:
    """Normalise a Hugging Face config.json dict."""
    model_type = d.get("model_type")
    if model_type is None:
        archs = d.get("architectures") or []
        raise UnsupportedError(
            f"config has no model_type (architectures={archs}); supported: {', '.join(sorted(FAMILIES))}"
        )
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    try:
        return family.from_hf(d)
    except KeyError as e:
        raise ModelLoadError(f"config for {model_type!r} lacks the key {e.args[0]!r}") from None


def load_hf_config(path: Path) -> ModelConfig:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read model config {path}: {e}") from None
    return model_config_from_hf(d)


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValidationError("model", name, f"unknown preset; presets: {', '.join(PRESETS)}")
    return model_config_from_hf(PRESETS[name])
