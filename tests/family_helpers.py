"""Tiny models of every family, as the family tests, the exactness property and the GGUF tests build them."""
from __future__ import annotations

from dataclasses import dataclass, field

from tests.reference_helpers import TINY_LLAMA_LIKE

WINDOW = 8  # Mistral's sliding window: shorter than every sequence below, so it really cuts


@dataclass
class Family:
    config_cls: str
    model_cls: str
    config: dict
    expect: dict  # ModelConfig fields the normaliser must set for this family
    init: dict = field(default_factory=dict)


FAMS = {
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", dict(TINY_LLAMA_LIKE),
                    dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None)),
    # head_dim 32 with 4 heads: q is wider than the hidden size, as in the real Qwen3s.
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(TINY_LLAMA_LIKE, head_dim=32),
                    dict(qkv_bias=False, o_bias=False, qk_norm=True, head_dim=32, sliding_window=None)),
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(TINY_LLAMA_LIKE, sliding_window=WINDOW),
                      dict(qkv_bias=False, o_bias=False, sliding_window=WINDOW, position="rope")),
    # GELU MLPs and tied heads settle into repeating one token unless the blocks outweigh the embeddings.
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel",
                   dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1,
                        eos_token_id=2),
                   dict(position="learned", norm="layer", norm_bias=True, mlp="gelu", activation="gelu_tanh",
                        qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True),
                   dict(gain=2.0, embed_std=0.1)),
    # 6 heads: not a power of two, so ALiBi's extra-slope rule is exercised.
    "bloom": Family("BloomConfig", "BloomForCausalLM",
                    dict(vocab_size=256, hidden_size=96, n_layer=2, n_head=6, seq_length=256),
                    dict(position="alibi", norm="layer", embedding_norm=True, mlp="gelu", activation="gelu_tanh",
                         num_heads=6, head_dim=16, intermediate_size=384, tie_word_embeddings=True),
                    dict(gain=2.0, embed_std=0.1)),
}

# Gemma 3, Phi-3 and the mixture-of-experts families (test_families_new.py, test_gguf_families.py).
# Three layers: windowed, global, windowed, each kind with its own RoPE base (the global one linearly scaled); a
# window shorter than the prompts; a softmax scale not head_dim ** -0.5; logit soft-capping.
GEMMA3 = dict(TINY_LLAMA_LIKE, num_hidden_layers=3, head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=30.0,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})
# Partial rotary (half of each head) with longrope factors; the prompts stay within the original length, where
# transformers and kvinfer both take the short factors.
PHI3 = dict(TINY_LLAMA_LIKE, pad_token_id=0, original_max_position_embeddings=64,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 5.0]})

NEW_FAMS = {
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3,
                     dict(sandwich_norm=True, qk_norm=True, layer_windows=(6, None, 6), rope_local_theta=100.0,
                          embed_scale=8.0, attn_scale=24 ** -0.5, final_logit_softcap=30.0, activation="gelu_tanh",
                          tie_word_embeddings=True, sliding_window=None),
                     # The embeddings are scaled by sqrt(hidden): small ones keep a tied head from repeating.
                     dict(gain=2.0, embed_std=0.05)),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", PHI3, dict(rotary_dim=8, qkv_bias=False, sliding_window=None)),
    # Top-2 of 8 experts without renormalising (Qwen3-MoE's default), with q/k norms.
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(TINY_LLAMA_LIKE, head_dim=32, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=False),
                        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                             qk_norm=True)),
    # Softmax, top-2 of 4, renormalised (always, in Mixtral).
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",
                      dict(TINY_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
                      dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                           sliding_window=None)),
    # A sigmoid-gated shared expert beside top-3 of 6.
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                        dict(TINY_LLAMA_LIKE, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, norm_topk_prob=True),
                        dict(num_experts=6, num_experts_per_tok=3, shared_expert_intermediate_size=48,
                             qkv_bias=True)),
}
