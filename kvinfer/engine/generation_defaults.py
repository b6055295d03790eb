"""Sampling defaults a model ships with: its generation_config.json, as vLLM's `--generation-config auto` reads it,
or, for the built-in model, what its authors publish."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

# SmolLM2-135M-Instruct: its HF generation_config.json sets no sampling fields and no do_sample, which
# transformers' generate() runs greedily; that is what the built-in model does by default. (The model card's example
# samples at temperature=0.2, top_p=0.9; at 135M parameters such draws fall into repeated phrases too often for a
# default answer: README's chat example came back as a loop of French at engine seed 0.)
BUILTIN_SAMPLING = {"temperature": 0.0}

# generation_config.json keys that map one to one onto SamplingParams fields.
_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model: Optional[str]) -> dict:
    """SamplingParams fields the model's authors chose: {} when it names none (then the request's own defaults)."""
    if model is None:
        return dict(BUILTIN_SAMPLING)
    p = Path(model)
    root = p if p.is_dir() else p.parent
    f = root / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict) or cfg.get("do_sample") is False:
        return {}
    out = {}
    for k in _KEYS:
        v = cfg.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = int(v) if k == "top_k" else float(v)
    return out
