"""Embeddings from a decoder: which pooling a model wants, and the pooled vector's finishing (normalise, truncate).

The engine pools the final-norm hidden states of a request's prompt (Request.add_pooled_rows): `last` (the last
token's, as Qwen3-Embedding and most decoder embedders), `mean` (over every prompt token) or `cls` (the first).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

from kvinfer.sampling_params import SamplingParams

POOLING = ("last", "mean", "cls")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def model_pooling(model: Optional[str]) -> tuple[Optional[str], bool]:
    """(pooling, normalize) a sentence-transformers model directory asks for (modules.json and its Pooling
    module's config.json); (None, False) when it has none."""
    if not model or not Path(model).is_dir():
        return None, False
    try:
        modules = json.loads((Path(model) / "modules.json").read_text())
    except (OSError, ValueError):
        return None, False
    pooling, normalize = None, False
    for m in modules if isinstance(modules, list) else ():
        kind = str(m.get("type", "")) if isinstance(m, dict) else ""
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            try:
                cfg = json.loads((Path(model) / str(m.get("path", "")) / "config.json").read_text())
            except (OSError, ValueError):
                continue
            pooling = next((v for k, v in _ST_MODES.items() if cfg.get(k)), None)
    return pooling, normalize


def embed_params(pooling: str) -> SamplingParams:
    """An embedding request: prefill, pool, one greedy token that nobody reads (it ends the request)."""
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling, ignore_eos=True)


def finish(vec: Sequence[float], normalize: bool, dimensions: Optional[int] = None) -> list[float]:
    """The first `dimensions` values (renormalised, as OpenAI's `dimensions`), L2-normalised when asked."""
    out = list(vec[:dimensions] if dimensions else vec)
    if normalize or dimensions:
        norm = math.sqrt(math.fsum(x * x for x in out))
        if norm > 0:
            out = [x / norm for x in out]
    return out
