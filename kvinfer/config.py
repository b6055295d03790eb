"""ModelConfig (what the decoder needs of a model), presets, and the frozen EngineConfig.

The families' normalisers that make a ModelConfig from a Hugging Face config.json live in kvinfer/models/families/."""
from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from typing import Optional

from kvinfer.errors import ModelLoadError, ValidationError
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


# Named presets (HF config.json dicts, normalised by kvinfer.models.families.preset_config) for
# `--load-format dummy` and the planner.
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
    # Bits activations are rounded to where they meet quantised weights on the CPU kernels: 16 (within 0.03% of
    # the file's float model) or 8 (llama.cpp's precision; faster prompts). Process-wide: docs/KQUANTS.md.
    activation_bits: int = 16
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
        if self.activation_bits not in (8, 16):
            raise ValidationError("activation_bits", self.activation_bits, "must be 16 or 8")
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
