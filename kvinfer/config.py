"""ModelConfig (normalised from HF config.json or GGUF metadata), presets, and the frozen EngineConfig."""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from kvinfer.errors import ModelLoadError, UnsupportedError, ValidationError
from kvinfer.utils import parse_size


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: 'linear' (positions / factor), 'llama3' (band-wise), 'longrope' (per frequency) or
    'yarn' (interpolated below a band of frequencies, extrapolated above it)."""

    type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original length
    long_factor: tuple[float, ...] = ()  # longrope: beyond it
    attention_factor: float = 1.0  # longrope, yarn: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: rotations over the original length above which a frequency is kept
    beta_slow: float = 1.0  # yarn: rotations below which it is divided by the factor
    truncate: bool = True  # yarn: the band's ends rounded to whole dimensions


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know; families differ only by these flags."""

    architecture: str  # the family, e.g. "llama"; also the key of the weight-name map
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    norm: str = "rms"  # rms | layer
    position: str = "rope"  # rope | alibi | learned
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    mlp: str = "swiglu"  # swiglu | gelu
    activation: str = "silu"  # silu | gelu | gelu_tanh
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False  # LayerNorm with a bias
    qk_norm: bool = False
    embedding_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: Optional[str] = None  # the dtype the checkpoint was saved in
    # Families beyond the Llama shape (kvinfer/models/families/): defaults leave the plain decoder.
    layer_windows: tuple[Optional[int], ...] = ()  # per layer: its sliding window, None for a global layer
    rope_local_theta: Optional[float] = None  # RoPE base of the windowed layers (Gemma 3), unscaled
    rotary_dim: Optional[int] = None  # rotate only the first rotary_dim of head_dim (partial rotary)
    sandwich_norm: bool = False  # norms before and after attention and MLP (Gemma)
    embed_scale: Optional[float] = None  # embeddings multiplied by this, in the model dtype
    attn_scale: Optional[float] = None  # softmax scale when not head_dim ** -0.5
    final_logit_softcap: Optional[float] = None  # logits = cap * tanh(logits / cap)
    num_experts: int = 0  # > 0: the MLP is a mixture of experts (kvinfer/layers/moe.py)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    shared_expert_intermediate_size: int = 0  # > 0: a gated shared expert beside the routed ones (Qwen2-MoE)

    def __post_init__(self):
        checks = [
            ("hidden_size", self.hidden_size > 0),
            ("num_layers", self.num_layers > 0),
            ("num_heads", self.num_heads > 0),
            ("num_kv_heads", 0 < self.num_kv_heads <= self.num_heads and self.num_heads % self.num_kv_heads == 0),
            ("vocab_size", self.vocab_size > 0),
            ("head_dim", self.head_dim > 0),
            ("norm", self.norm in ("rms", "layer")),
            ("position", self.position in ("rope", "alibi", "learned")),
            ("mlp", self.mlp in ("swiglu", "gelu")),
            ("layer_windows", not self.layer_windows or len(self.layer_windows) == self.num_layers),
            ("rotary_dim", self.rotary_dim is None or (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0)),
            ("num_experts", self.num_experts >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ModelLoadError(f"model config has an invalid {name}={getattr(self, name)!r}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"model config has num_experts_per_tok={self.num_experts_per_tok}, needs 1 to "
                                 f"num_experts={self.num_experts}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V, every layer, one token (an 8-bit cache adds a scale per row: scale_bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes)

    def num_parameters(self) -> int:
        """Parameter count from the shapes (used by the planner for weight bytes)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        mlp = (3 if self.mlp == "swiglu" else 2) * h * i
        if self.num_experts:
            mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h) + self._shared_expert_params()
        norms = (4 if self.sandwich_norm else 2) * h * (2 if self.norm_bias else 1)
        norms += 2 * self.head_dim if self.qk_norm else 0
        per_layer = attn + mlp + norms
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        pos = self.max_position_embeddings * h if self.position == "learned" else 0
        return self.num_layers * per_layer + emb + head + pos + h

    def _shared_expert_params(self) -> int:
        s = self.shared_expert_intermediate_size
        return 3 * self.hidden_size * s + self.hidden_size if s else 0

    def num_active_parameters(self) -> int:
        """Parameters one token reads: every weight but the experts it was not routed to."""
        if not self.num_experts:
            return self.num_parameters()
        unused = self.num_experts - self.num_experts_per_tok
        return self.num_parameters() - self.num_layers * unused * 3 * self.hidden_size * self.moe_intermediate_size

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _eos_tuple(v: Any) -> tuple[int, ...]:
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


def _rope_scaling(d: dict, rs: Optional[dict] = None) -> Optional[RopeScaling]:
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


def _rope_theta(d: dict) -> float:
    if "rope_theta" in d:
        return float(d["rope_theta"])
    rp = d.get("rope_parameters") or {}
    return float(rp.get("rope_theta", 10000.0))


def _llama_like(d: dict, arch: str, *, head_dim_default: Optional[int] = None,
                sliding_window: Optional[int] = None, **flags) -> ModelConfig:
    """Llama-shaped families; `flags` are what the family's HF modelling code hard-wires."""
    heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    bias = bool(d.get("attention_bias", False))
    kw = dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(d.get("mlp_bias", False)), rope_theta=_rope_theta(d),
              rope_scaling=_rope_scaling(d), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))
    kw.update(flags)
    return ModelConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or head_dim_default or hidden // heads,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        norm_eps=d.get("rms_norm_eps", 1e-6),
        sliding_window=sliding_window,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_tuple(d.get("eos_token_id")),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        **kw,
    )


def _qwen_window(d: dict, arch: str) -> Optional[int]:
    """Qwen2/3 window every layer or none: HF applies it only with use_sliding_window, from max_window_layers on."""
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    if window is None:
        return None
    n = d["num_hidden_layers"]
    types = d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
                                     for i in range(n)]
    sliding = sum(t == "sliding_attention" for t in types)
    if sliding == 0:
        return None
    if sliding != len(types):
        raise UnsupportedError(f"{arch} with sliding-window attention on only some layers ({sliding} of {len(types)}) "
                               "is not supported (supported: all layers or none)")
    return int(window)


def _from_llama(d):
    return _llama_like(d, "llama")


def _from_mistral(d):
    # HF's Mistral has no biases whatever attention_bias says, and windows every layer unless sliding_window is null.
    window = d.get("sliding_window", 4096)
    return _llama_like(d, "mistral", sliding_window=int(window) if window is not None else None,
                       qkv_bias=False, o_bias=False, mlp_bias=False)


def _from_qwen2(d):
    # Qwen2 hard-wires biases on q/k/v only.
    return _llama_like(d, "qwen2", sliding_window=_qwen_window(d, "qwen2"), qkv_bias=True, o_bias=False,
                       mlp_bias=False)


def _from_qwen3(d):
    return _llama_like(d, "qwen3", head_dim_default=128, sliding_window=_qwen_window(d, "qwen3"), qk_norm=True,
                       mlp_bias=False)


def _gemma3_rope(d: dict) -> tuple[float, Optional[RopeScaling], float]:
    """(global theta, global scaling, local theta): transformers 5 nests them per layer type, 4.x kept them flat."""
    rp = d.get("rope_parameters") or {}
    if "full_attention" in rp:
        glob, local = rp["full_attention"], rp.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedError(f"gemma3 with RoPE scaling {local.get('rope_type')!r} on the sliding layers is not "
                                   "supported (supported: default)")
        return float(glob.get("rope_theta", 1e6)), _rope_scaling(d, glob), float(local.get("rope_theta", 1e4))
    return _rope_theta(dict(d, rope_theta=d.get("rope_theta", 1e6))), _rope_scaling(d), \
        float(d.get("rope_local_base_freq", 1e4))


def _from_gemma3(d):
    n = d["num_hidden_layers"]
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
    types = d.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                     for i in range(n)]
    window = d.get("sliding_window")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if _GPT2_ACTIVATIONS.get(act) != "gelu_tanh":
        raise UnsupportedError(f"gemma3 hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
    if d.get("attn_logit_softcapping") is not None:
        raise UnsupportedError("gemma3 with attn_logit_softcapping is not supported (supported: null, as released)")
    theta, scaling, local_theta = _gemma3_rope(d)
    cap = d.get("final_logit_softcapping")
    return _llama_like(d, "gemma3", head_dim_default=256, qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
                       layer_windows=tuple(int(window) if t == "sliding_attention" and window else None
                                           for t in types),
                       rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                       embed_scale=float(d["hidden_size"]) ** 0.5,
                       attn_scale=float(d.get("query_pre_attn_scalar") or 256) ** -0.5,
                       final_logit_softcap=float(cap) if cap else None,
                       tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))


def _from_phi3(d):
    rp = d.get("rope_parameters") or {}
    partial = float(rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    rotary = int(head_dim * partial)
    window = d.get("sliding_window")
    # Phi-3's modelling code has no biases and windows every layer when sliding_window is set.
    return _llama_like(d, "phi3", sliding_window=int(window) if window else None,
                       rotary_dim=rotary if rotary != head_dim else None, qkv_bias=False, o_bias=False,
                       mlp_bias=False)


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
    return _llama_like(d, "qwen3_moe", head_dim_default=128, sliding_window=_qwen_window(d, "qwen3_moe"),
                       qk_norm=True, mlp_bias=False,
                       **_moe_flags(d, "qwen3_moe", "num_experts", bool(d.get("norm_topk_prob", False)),
                                    "moe_intermediate_size"))


def _from_qwen2_moe(d):
    return _llama_like(d, "qwen2_moe", sliding_window=_qwen_window(d, "qwen2_moe"), qkv_bias=True, o_bias=False,
                       mlp_bias=False,
                       **_moe_flags(d, "qwen2_moe", "num_experts", bool(d.get("norm_topk_prob", False)),
                                    "moe_intermediate_size"))


def _from_mixtral(d):
    # Mixtral always renormalises its top-k weights; the experts are intermediate_size wide.
    window = d.get("sliding_window")
    return _llama_like(d, "mixtral", sliding_window=int(window) if window else None, qkv_bias=False, o_bias=False,
                       mlp_bias=False, **_moe_flags(d, "mixtral", "num_local_experts", True, "intermediate_size"))


# GPT-2's activation_function names; "gelu_new" and "gelu_fast" are the tanh approximation written out.
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                     "gelu": "gelu"}


def _unsupported_if(arch: str, d: dict, key: str, default: Any, ok: Any) -> None:
    if d.get(key, default) != ok:
        raise UnsupportedError(f"{arch} with {key}={d.get(key, default)!r} is not supported (supported: {ok!r})")


def _from_gpt2(d):
    hidden, heads = d["n_embd"], d["n_head"]
    act = d.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise UnsupportedError(f"gpt2 activation_function {act!r} is not supported "
                               f"(supported: {', '.join(_GPT2_ACTIVATIONS)})")
    # These change the attention scale or add layers; no released checkpoint we target uses them.
    _unsupported_if("gpt2", d, "scale_attn_weights", True, True)
    _unsupported_if("gpt2", d, "scale_attn_by_inverse_layer_idx", False, False)
    _unsupported_if("gpt2", d, "add_cross_attention", False, False)
    return ModelConfig(
        architecture="gpt2",
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d.get("n_inner") or 4 * hidden,
        num_layers=d["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=d.get("n_positions", 1024),
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        norm="layer",
        norm_bias=True,
        position="learned",
        mlp="gelu",
        activation=_GPT2_ACTIVATIONS[act],
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_tuple(d.get("eos_token_id")),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def _from_bloom(d):
    hidden = d.get("hidden_size") or d.get("n_embed") or 64
    heads = d.get("n_head") or d.get("num_attention_heads") or 8
    # The residual taken after the norm is a different block wiring; no released BLOOM uses it.
    _unsupported_if("bloom", d, "apply_residual_connection_post_layernorm", False, False)
    return ModelConfig(
        architecture="bloom",
        vocab_size=d.get("vocab_size", 250880),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=d.get("n_layer") or d.get("num_hidden_layers") or 2,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        # ALiBi has no table to outgrow; this only bounds max_model_len by default.
        max_position_embeddings=d.get("seq_length") or 2048,
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        norm="layer",
        norm_bias=True,
        position="alibi",
        mlp="gelu",
        activation="gelu_tanh",  # bloom_gelu_forward: the tanh approximation
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        embedding_norm=True,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_tuple(d.get("eos_token_id")),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


# model_type (HF config.json) -> normaliser. GGUF metadata is mapped onto these keys by the GGUF loader.
FAMILIES = {
    "llama": _from_llama,
    "mistral": _from_mistral,
    "qwen2": _from_qwen2,
    "qwen3": _from_qwen3,
    "gpt2": _from_gpt2,
    "bloom": _from_bloom,
    "gemma3_text": _from_gemma3,
    "phi3": _from_phi3,
    "qwen3_moe": _from_qwen3_moe,
    "qwen2_moe": _from_qwen2_moe,
    "mixtral": _from_mixtral,
}


def model_config_from_hf(d: dict) -> ModelConfig:
    """Normalise a Hugging Face config.json dict."""
    model_type = d.get("model_type")
    if model_type is None:
        archs = d.get("architectures") or []
        raise UnsupportedError(
            f"config has no model_type (architectures={archs}); supported: {', '.join(sorted(FAMILIES))}"
        )
    fn = FAMILIES.get(model_type)
    if fn is None:
        raise UnsupportedError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    try:
        return fn(d)
    except KeyError as e:
        raise ModelLoadError(f"config for {model_type!r} lacks the key {e.args[0]!r}") from None


def load_hf_config(path: Path) -> ModelConfig:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read model config {path}: {e}") from None
    return model_config_from_hf(d)


# Named presets (HF config.json dicts) for `--load-format dummy` and the planner.
PRESETS: dict[str, dict] = {
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    "llama-2-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192),
                         bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
                       bos_token_id=1, eos_token_id=2),
    "tinyllama-1.1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, eos_token_id=151645),
    # Shapes of the released models (RoPE scaling left out: the planner needs shapes only).
    "gemma-3-1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       max_position_embeddings=32768, sliding_window=512, sliding_window_pattern=6,
                       rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
                       bos_token_id=2, eos_token_id=[1, 106]),
    "phi-4-mini": dict(model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                       max_position_embeddings=131072, partial_rotary_factor=0.75, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, bos_token_id=199999, eos_token_id=[199999, 200020]),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                          bos_token_id=151643, eos_token_id=151645),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValidationError("model", name, f"unknown preset; presets: {', '.join(PRESETS)}")
    return model_config_from_hf(PRESETS[name])


KV_BACKENDS = ("paged", "contiguous", "none")
# auto: the model's dtype; int8 / fp8 (e4m3): 8 bits + a scale per group of 32 values; bfloat16: 16 bits, no scale
KV_CACHE_DTYPES = ("auto", "float32", "int8", "fp8", "bfloat16")
KV_8BIT = ("int8", "fp8")
KV_GROUP = 32  # an 8-bit cache has a float32 scale per group of this many values of a row (or per row if D % 32)


def kv_scale_bytes(head_dim: int) -> int:
    """Bytes of scales per K or V row (one token, one kv head) of an 8-bit cache."""
    return 4 * (head_dim // KV_GROUP if head_dim % KV_GROUP == 0 else 1)


def kv_element_bytes(kv_cache_dtype: str, head_dim: int, dtype_bytes: int) -> tuple[int, int]:
    """(bytes per K or V value, bytes of scales per K or V row) of a cache of `kv_cache_dtype` ("auto": the model's
    dtype of `dtype_bytes`)."""
    if kv_cache_dtype in KV_8BIT:
        return 1, kv_scale_bytes(head_dim)
    if kv_cache_dtype == "bfloat16":
        return 2, 0
    if kv_cache_dtype == "float32":
        return 4, 0
    return dtype_bytes, 0


DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATIONS = ("auto", "none", "gguf")
SPECULATIVE = (None, "ngram", "draft")


MAX_SCHEDULER_STEPS = 64


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings fixed at start-up; nothing mutates them afterwards."""

    model: Optional[str] = None  # None: the built-in model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"
    load_format: str = "auto"
    # gguf: keep a GGUF's quantised blocks and multiply small batches with kvinfer's kernels; none: float only;
    # auto: gguf for GGUF files on CPU in float32 when the kernels build, none otherwise.
    quantization: str = "auto"
    kv_cache: str = "paged"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: Optional[int] = None  # bytes; None: derived from kv_cache_fraction
    kv_cache_fraction: float = 0.0  # of free memory, used when kv_cache_memory is None and > 0
    max_model_len: Optional[int] = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Decode steps (greedy, or sampled with only temperature/top-k/top-p/min-p) per call into the fused C step while
    # nothing waits to be admitted (vLLM's multi-step scheduling): the per-step Python work (scheduling, metadata,
    # sampling, outputs) is paid once per call.
    num_scheduler_steps: int = 8
    seed: int = 0
    num_threads: Optional[int] = None
    tokenizer: Optional[str] = None
    chat_template: Optional[str] = None  # a Jinja file's path or the template itself, instead of the model's own
    # Tensor parallelism: ranks over `nnodes` machines (tensor_parallel_size / nnodes each); node 0 runs the engine.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None  # node 0's address (default 127.0.0.1)
    master_port: Optional[int] = None  # default: a free port on one node, 29500 across nodes
    # Speculative decoding: None, "ngram" (prompt lookup) or "draft" (speculative_model proposes).
    speculative: Optional[str] = None
    speculative_model: Optional[str] = None
    # Most tokens proposed per step; None: spec.speculator.default_tokens (by method and machine).
    num_speculative_tokens: Optional[int] = None
    ngram_min: int = 1
    ngram_max: int = 4
    # KV tiers below the paged pool (docs/kv_tiers.md): a RAM tier for blocks evicted from the pool, a directory of
    # block files that outlives the process (LRU within kv_cache_dir_size, 10 GiB by default), a Redis server
    # shared by replicas. Sizes in bytes (or "4GiB").
    kv_offload_memory: Optional[int] = None
    kv_cache_dir: Optional[str] = None
    kv_cache_dir_size: Optional[int] = None
    kv_cache_redis: Optional[str] = None

    def _check_types(self) -> None:
        """A value of the wrong type is a ValidationError naming the setting (not a TypeError from a comparison)."""
        kinds = {"int": (numbers.Integral, "an integer"), "float": (numbers.Real, "a number"),
                 "bool": (bool, "True or False"), "str": (str, "a string")}
        for f in dataclasses.fields(self):
            ann = str(f.type)  # "int", "Optional[str]", ... (annotations are strings here)
            optional = ann.startswith("Optional[")
            kind = kinds.get(ann[9:-1] if optional else ann)
            value = getattr(self, f.name)
            if kind is None or (optional and value is None):
                continue
            want, words = kind
            if want is str and isinstance(value, os.PathLike):  # a path given as a Path
                object.__setattr__(self, f.name, value := os.fspath(value))
            if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
                raise ValidationError(f.name, value, f"must be {words}" + (" or None" if optional else ""))

    def __post_init__(self):
        for name in ("kv_cache_memory", "kv_offload_memory", "kv_cache_dir_size"):
            if isinstance(getattr(self, name), str):  # "512MiB", as on the command line
                object.__setattr__(self, name, parse_size(getattr(self, name), name))
        self._check_types()
        if self.kv_cache not in KV_BACKENDS:
            raise ValidationError("kv_cache", self.kv_cache, f"must be one of {', '.join(KV_BACKENDS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValidationError("kv_cache_dtype", self.kv_cache_dtype, f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValidationError("dtype", self.dtype, f"must be one of auto, {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ValidationError("device", self.device, f"must be one of {', '.join(DEVICES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValidationError("load_format", self.load_format, f"must be one of {', '.join(LOAD_FORMATS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValidationError("quantization", self.quantization, f"must be one of {', '.join(QUANTIZATIONS)}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValidationError("block_size", self.block_size, "must be in [1, 1024]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValidationError("kv_cache_memory", self.kv_cache_memory, "must be > 0 bytes")
        for name in ("kv_offload_memory", "kv_cache_dir_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValidationError(name, getattr(self, name), "must be > 0 bytes")
        if self.kv_cache_dir is not None and os.path.exists(self.kv_cache_dir) and not os.path.isdir(self.kv_cache_dir):
            raise ValidationError("kv_cache_dir", self.kv_cache_dir, "is a file, not a directory")
        if self.kv_cache_dir_size is not None and not self.kv_cache_dir:
            raise ValidationError("kv_cache_dir_size", self.kv_cache_dir_size, "needs kv_cache_dir")
        if self.kv_cache_redis is not None and not self.kv_cache_redis.startswith(("redis://", "rediss://", "unix://")):
            raise ValidationError("kv_cache_redis", self.kv_cache_redis,
                                  "must be a URL such as redis://127.0.0.1:6379/0")
        if not 0.0 <= self.kv_cache_fraction < 1.0:
            raise ValidationError("kv_cache_fraction", self.kv_cache_fraction, "must be in [0, 1)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError("max_model_len", self.max_model_len, "must be >= 1")
        if self.max_num_seqs < 1:
            raise ValidationError("max_num_seqs", self.max_num_seqs, "must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValidationError("max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")
        if not 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
            raise ValidationError("num_scheduler_steps", self.num_scheduler_steps,
                                  f"must be in [1, {MAX_SCHEDULER_STEPS}]")
        if not isinstance(self.seed, int) or not -(1 << 63) <= self.seed < (1 << 64):
            raise ValidationError("seed", self.seed, "must be an integer that fits in 64 bits")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValidationError("num_threads", self.num_threads, "must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValidationError("tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValidationError("nnodes", self.nnodes,
                                  f"must be >= 1 and divide tensor_parallel_size={self.tensor_parallel_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValidationError("node_rank", self.node_rank, f"must be in [0, {self.nnodes})")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValidationError("master_port", self.master_port, "must be in [1, 65535]")
        if self.speculative not in SPECULATIVE:
            raise ValidationError("speculative", self.speculative, "must be one of ngram, draft (or None)")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValidationError("speculative_model", self.speculative_model,
                                  "is needed for speculative='draft' (a draft model path)")
        if self.speculative_model and self.speculative != "draft":
            raise ValidationError("speculative", self.speculative, "must be 'draft' when speculative_model is given")
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ValidationError("num_speculative_tokens", self.num_speculative_tokens, "must be in [1, 16]")
        if not isinstance(self.ngram_min, int) or self.ngram_min < 1:
            raise ValidationError("ngram_min", self.ngram_min, "must be an integer >= 1")
        if not isinstance(self.ngram_max, int) or not self.ngram_min <= self.ngram_max <= 64:
            raise ValidationError("ngram_max", self.ngram_max, f"must be in [ngram_min={self.ngram_min}, 64]")

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
