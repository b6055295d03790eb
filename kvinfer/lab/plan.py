"""Memory planner: KV bytes per token, weights, and how many requests fit contiguous vs paged."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvinfer.config import KV_CACHE_DTYPES, kv_element_bytes, PRESETS, ModelConfig
from kvinfer.errors import ModelLoadError, ValidationError
from kvinfer.utils import format_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# A serving mix of total lengths (prompt + output): mostly chat turns, some documents, a few long contexts.
# Ranges past max_model_len are clipped or dropped, so the mix adapts to the context window.
DEFAULT_MIX = ((0.6, 128, 1024), (0.3, 1025, 4096), (0.1, 4097, 8192))


# ---- model shapes ------------------------------------------------------------------------------
def _gguf_config(path: Path) -> ModelConfig:
    from kvinfer.loaders import gguf_loader

    fn = getattr(gguf_loader, "read_metadata_config", None)
    if fn is not None:
        return fn(path)
    return gguf_loader.read_gguf(path).config  # slower: decodes every tensor, but only the shapes are kept


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_model_config(model: Optional[str]) -> tuple[ModelConfig, str]:
    """(shapes, a label) from a preset name, an HF directory, a config.json, a GGUF file, or None (built-in)."""
    if model is None:
        from kvinfer.utils import builtin_model_path

        path = builtin_model_path()
        return _gguf_config(path), f"{path.name} (built-in)"
    # Imported here: the families' modules bring torch, which the planner's arithmetic does not need.
    from kvinfer.models.families import load_hf_config, preset_config

    if model in PRESETS:
        return preset_config(model), f"{model} (preset)"
    p = Path(model)
    if p.is_dir():
        if (p / "config.json").is_file():
            return load_hf_config(p / "config.json"), f"{p} (config.json)"
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_config(ggufs[0]), f"{ggufs[0]} (GGUF)"
        raise ModelLoadError(f"model directory {model!r} has no config.json and no single .gguf file")
    if p.is_file():
        if _is_gguf(p):
            return _gguf_config(p), f"{p} (GGUF)"
        return load_hf_config(p), f"{p} (config.json)"
    raise ModelLoadError(f"--model {model!r} is not a preset ({', '.join(PRESETS)}), a directory, "
                         f"a config.json or a GGUF file")


# ---- workloads ---------------------------------------------------------------------------------
def _sum_blocks(n: int, bs: int) -> int:
    """sum of ceil(l / bs) for l = 1..n, in closed form."""
    if n <= 0:
        return 0
    q, r = divmod(n, bs)
    return bs * q * (q + 1) // 2 + r * (q + 1)


@dataclass(frozen=True)
class Workload:
    """A distribution of per-request total lengths: weighted uniform integer ranges (weights sum to 1)."""

    spec: str
    parts: tuple[tuple[float, int, int], ...]  # (weight, lowest, highest) tokens

    def mean_tokens(self) -> float:
        return sum(w * (lo + hi) / 2 for w, lo, hi in self.parts)

    def mean_blocks(self, block_size: int) -> float:
        """Expected ceil(length / block_size): the blocks a request holds at its final length."""
        return sum(w * (_sum_blocks(hi, block_size) - _sum_blocks(lo - 1, block_size)) / (hi - lo + 1)
                   for w, lo, hi in self.parts)

    @property
    def max_tokens(self) -> int:
        return max(hi for _, _, hi in self.parts)

    def describe(self) -> str:
        body = ", ".join(f"{w * 100:.0f}% {lo}-{hi}" if lo != hi else f"{w * 100:.0f}% {lo}"
                         for w, lo, hi in self.parts)
        return f"{self.spec}: {body} tokens (prompt + output)"


_WORKLOAD_HELP = "expected uniform:A-B, mean:L, or mix:W@A-B,W@A-B,... (lengths in tokens, prompt + output)"


def _range(text: str, spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not m:
        raise ValidationError("workload", spec, _WORKLOAD_HELP)
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if lo < 1 or hi < lo:
        raise ValidationError("workload", spec, f"range {text.strip()!r} must satisfy 1 <= A <= B")
    return lo, hi


def parse_workload(spec: Optional[str], max_model_len: int) -> Workload:
    """Parse a --workload value; lengths beyond max_model_len are an error (except in the default mix)."""
    if spec is None or spec in ("mix", "default"):
        parts = [(w, min(lo, max_model_len), min(hi, max_model_len)) for w, lo, hi in DEFAULT_MIX
                 if lo <= max_model_len or (w, lo, hi) == DEFAULT_MIX[0]]
        total = sum(w for w, _, _ in parts)
        return Workload("default mix", tuple((w / total, lo, hi) for w, lo, hi in parts))
    kind, _, body = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "uniform":
        lo, hi = _range(body, spec)
        parts = [(1.0, lo, hi)]
    elif kind in ("mean", "fixed"):
        lo, hi = _range(body, spec)
        if lo != hi:
            raise ValidationError("workload", spec, "mean:L takes one length")
        parts = [(1.0, lo, lo)]
    elif kind == "mix":
        parts = []
        for item in body.split(","):
            w, at, rng = item.partition("@")
            try:
                weight = float(w)
            except ValueError:
                raise ValidationError("workload", spec, _WORKLOAD_HELP) from None
            if not at or not weight > 0 or not math.isfinite(weight):
                raise ValidationError("workload", spec, "each mix part is WEIGHT@A-B with WEIGHT > 0")
            parts.append((weight, *_range(rng, spec)))
        total = sum(w for w, _, _ in parts)
        parts = [(w / total, lo, hi) for w, lo, hi in parts]
    else:
        raise ValidationError("workload", spec, _WORKLOAD_HELP)
    too_long = max(hi for _, _, hi in parts)
    if too_long > max_model_len:
        raise ValidationError("workload", spec, f"a length of {too_long} exceeds max_model_len={max_model_len}")
    return Workload(spec, tuple(parts))


# ---- the plan ----------------------------------------------------------------------------------
def kv_heads_per_device(cfg: ModelConfig, tp: int) -> int:
    """KV heads each device holds: split when they divide, one replicated head when there are fewer heads."""
    from kvinfer.parallel.shard import kv_heads_per_rank

    return kv_heads_per_rank(cfg, tp, "tp")  # the engine's own rule, so the plan and a -tp run agree


def make_plan(cfg: ModelConfig, memory: int, max_model_len: int, dtype: str = "float16", block_size: int = 16,
              tp: int = 1, workload: Optional[Workload] = None, model_label: str = "",
              concurrent: int = 8, kv_cache_dtype: str = "auto") -> dict:
    """Every number of the plan, per device; plain data so --json and the text view print the same thing."""
    if dtype not in DTYPE_BYTES:
        raise ValidationError("dtype", dtype, f"must be one of {', '.join(DTYPE_BYTES)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValidationError("kv_cache_dtype", kv_cache_dtype, f"must be one of {', '.join(KV_CACHE_DTYPES)}")
    if memory <= 0:
        raise ValidationError("memory", memory, "must be > 0 bytes")
    if max_model_len < 1:
        raise ValidationError("max_model_len", max_model_len, "must be >= 1")
    if concurrent < 1:
        raise ValidationError("concurrent", concurrent, "must be >= 1")
    if not 1 <= block_size <= 1024:
        raise ValidationError("block_size", block_size, "must be in [1, 1024]")
    workload = workload or parse_workload(None, max_model_len)
    dbytes = DTYPE_BYTES[dtype]
    kv_heads = kv_heads_per_device(cfg, tp)
    # An 8-bit cache: one byte per value plus a float32 scale per group of 32 values of a K or V row.
    kv_dbytes, scale_bytes = kv_element_bytes(kv_cache_dtype, cfg.head_dim, dbytes)
    kv_values = 2 * cfg.num_layers * kv_heads * cfg.head_dim * kv_dbytes
    kv_scales = 2 * cfg.num_layers * kv_heads * scale_bytes
    kv_per_token = kv_values + kv_scales
    params = cfg.num_parameters()
    weight_bytes = math.ceil(params * dbytes / tp)
    per_request = kv_per_token * max_model_len
    kv_budget = memory - weight_bytes
    block_bytes = kv_per_token * block_size
    num_blocks = max(0, kv_budget // block_bytes)
    num_blocks_kv_only = memory // block_bytes
    mean_blocks = workload.mean_blocks(block_size)
    mean_tokens = workload.mean_tokens()
    contiguous = max(0, kv_budget // per_request)
    contiguous_kv_only = memory // per_request
    paged = int(num_blocks // mean_blocks)
    paged_kv_only = int(num_blocks_kv_only // mean_blocks)
    # Max-length reservations (the 40 GB / 8-request example): n requests side by side, with and without the
    # weights beside them.
    rows = sorted(set(range(1, min(contiguous_kv_only + 1, 12) + 1))
                  | {contiguous, contiguous + 1, contiguous_kv_only, contiguous_kv_only + 1, concurrent} - {0})
    seed_view = [dict(requests=n, kv_bytes=n * per_request, kv_plus_weights_bytes=n * per_request + weight_bytes,
                      fits_kv_only=n * per_request <= memory,
                      fits_with_weights=n * per_request + weight_bytes <= memory)
                 for n in rows]
    return dict(
        model=model_label, architecture=cfg.architecture, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, kv_heads_per_device=kv_heads, head_dim=cfg.head_dim,
        dtype=dtype, dtype_bytes=dbytes, block_size=block_size, tp=tp, memory_bytes=memory,
        kv_cache_dtype=dtype if kv_cache_dtype == "auto" else kv_cache_dtype, kv_dtype_bytes=kv_dbytes,
        kv_value_bytes_per_token=kv_values, kv_scale_bytes_per_token=kv_scales,
        max_model_len=max_model_len, num_parameters=params, num_active_parameters=cfg.num_active_parameters(),
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        kv_bytes_per_token=kv_per_token, kv_bytes_per_request=per_request,
        weight_bytes=weight_bytes, kv_budget_bytes=kv_budget, weights_fit=kv_budget > 0,
        workload=dict(spec=workload.spec, description=workload.describe(), mean_tokens=mean_tokens,
                      mean_blocks=mean_blocks, max_tokens=workload.max_tokens),
        contiguous=dict(max_requests=contiguous, max_requests_kv_only=contiguous_kv_only,
                        reserved_tokens_per_request=max_model_len,
                        used_fraction=mean_tokens / max_model_len),
        paged=dict(num_blocks=num_blocks, num_blocks_kv_only=num_blocks_kv_only, block_bytes=block_bytes,
                   token_capacity=num_blocks * block_size, mean_requests=paged, mean_requests_kv_only=paged_kv_only,
                   used_fraction=mean_tokens / (mean_blocks * block_size)),
        seed_view=seed_view,
        # The 40 GB / 8-request example: this many requests at once, reserved at max length vs paged at workload
        # lengths.
        concurrent=dict(requests=concurrent, contiguous_kv_bytes=concurrent * per_request,
                        paged_kv_bytes=math.ceil(concurrent * mean_blocks) * block_bytes,
                        contiguous_fits_kv_only=concurrent * per_request <= memory,
                        contiguous_fits=concurrent * per_request <= kv_budget,
                        paged_fits=math.ceil(concurrent * mean_blocks) * block_bytes <= kv_budget),
    )


def format_plan(p: dict) -> str:
    """The plan as a few aligned lines and one small table."""
    gib = format_bytes
    c, pg, w = p["contiguous"], p["paged"], p["workload"]
    lines = [
        f"Model      {p['model']}: {p['architecture']}, {p['num_layers']} layers, {p['num_heads']} heads, "
        f"{p['num_kv_heads']} KV heads x {p['head_dim']} dims, {p['num_parameters'] / 1e9:.2f} B parameters"
        + (f" ({p['num_active_parameters'] / 1e9:.2f} B active per token: {p['num_experts_per_tok']} of "
           f"{p['num_experts']} experts; memory holds them all)" if p["num_experts"] else ""),
        f"Setting    {p['dtype']} ({p['dtype_bytes']} bytes), KV cache {p['kv_cache_dtype']}, memory "
        f"{gib(p['memory_bytes'])} per device, max_model_len {p['max_model_len']}, block size {p['block_size']}, "
        f"tensor parallel {p['tp']}",
        "",
        f"KV per token            {p['kv_bytes_per_token']:,} B ({gib(p['kv_bytes_per_token'])}) = 2 (K,V) x "
        f"{p['num_layers']} layers x {p['kv_heads_per_device']} KV heads x {p['head_dim']} x {p['kv_dtype_bytes']} B"
        + (f" + {p['kv_scale_bytes_per_token']:,} B of scales (one float32 per 32 values)"
           if p['kv_scale_bytes_per_token'] else ""),
        f"KV per request          {gib(p['kv_bytes_per_request'])} at {p['max_model_len']} tokens",
        f"Weights                 {gib(p['weight_bytes'])} ({p['num_parameters']:,} x {p['dtype_bytes']} B"
        + (f" / {p['tp']} devices)" if p['tp'] > 1 else ")"),
        f"Left for KV             {gib(p['kv_budget_bytes'])}"
        + ("" if p["weights_fit"] else "  (the weights alone exceed the memory)"),
        "",
        f"Workload                {w['description']}; mean {w['mean_tokens']:,.0f} tokens = "
        f"{w['mean_blocks']:.1f} blocks",
        "",
        f"{'Concurrent requests':<36}{'contiguous (max length each)':>30}{'paged (workload, on average)':>32}",
        f"{'  after weights (' + gib(max(p['kv_budget_bytes'], 0)) + ' KV)':<36}{c['max_requests']:>30}"
        f"{pg['mean_requests']:>32}",
        f"{'  pure KV (all ' + gib(p['memory_bytes']) + ')':<36}{c['max_requests_kv_only']:>30}"
        f"{pg['mean_requests_kv_only']:>32}",
        f"{'  reserved KV holding tokens':<36}{c['used_fraction'] * 100:>29.1f}%{pg['used_fraction'] * 100:>31.1f}%",
        "",
        f"Reserving the full context: n requests at {p['max_model_len']} tokens, {gib(p['kv_bytes_per_request'])} "
        f"each, in {gib(p['memory_bytes'])}:",
        f"  {'n':>3}  {'KV':>12}  {'KV + weights':>14}  {'fits (pure KV)':>14}  {'fits (with weights)':>19}",
    ]
    for r in p["seed_view"]:
        lines.append(f"  {r['requests']:>3}  {gib(r['kv_bytes']):>12}  {gib(r['kv_plus_weights_bytes']):>14}  "
                     f"{'yes' if r['fits_kv_only'] else 'no':>14}  {'yes' if r['fits_with_weights'] else 'no':>19}")
    k = p["concurrent"]
    yes = {True: "fits", False: "does not fit"}
    lines += [
        "",
        f"{k['requests']} concurrent requests: contiguous reserves {k['requests']} x "
        f"{gib(p['kv_bytes_per_request'])} = {gib(k['contiguous_kv_bytes'])} of KV "
        f"({k['contiguous_kv_bytes'] / p['memory_bytes'] * 100:.0f}% of the memory before any weights; "
        f"{yes[k['contiguous_fits']]} beside the weights); paged holds about {gib(k['paged_kv_bytes'])} for "
        f"the workload's lengths ({yes[k['paged_fits']]}).",
    ]
    return "\n".join(lines)
