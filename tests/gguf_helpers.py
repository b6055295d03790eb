"""Tiny checkpoints written as GGUF files the way llama.cpp's converter writes them, shared by the GGUF tests."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as ref_quantize
from safetensors.torch import load_file

LLAMA_QUANTIZE = "/work/llama/build/bin/llama-quantize"  # llama.cpp's quantizer (scripts/make_gguf.py's default)
HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.{kind}"


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Llama q/k rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, cfg: dict, state: dict[str, torch.Tensor], qtype: str = "F32",
               permute: bool = True, vocab_key: bool = True, extra=None, extra_tensors=None) -> Path:
    """Write an HF checkpoint as llama.cpp's converter would (metadata keys, names, q/k permutation)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if vocab_key:
        w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(7 if qtype == "Q8_0" else 0)
    # A gpt2-style tokenizer section with a full token list and a few merges.
    n = cfg["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>", "Ġt", "he", "Ġthe", "é", "\u4e2d"] + [f"t{i}" for i in range(8, n)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (n - 3))
    w.add_token_scores([float(-i) * 0.5 for i in range(n)])
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        w.add_eos_token_id(cfg["eos_token_id"])
    for fn in extra or ():
        fn(w)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for hf, t in state.items():
        a = t.detach().float().numpy()
        if permute and ("q_proj" in hf or "k_proj" in hf):
            a = converter_permute(a, heads if "q_proj" in hf else kv_heads)
        a = np.ascontiguousarray(a)
        if qtype == "Q8_0" and a.ndim == 2 and a.shape[1] % 32 == 0:
            w.add_tensor(gguf_name(hf), ref_quantize(a, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(gguf_name(hf), a)
    for name, a, raw_dtype in extra_tensors or ():
        w.add_tensor(name, a, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_hf(model_cls, config_cls, out: Path, seed: int, **kw) -> tuple[dict, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, **kw)
    model = model_cls(cfg).float()
    with torch.no_grad():  # norms start at 1 and biases at 0; randomise so a mix-up would show
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(out)
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama")
    cfg, state = save_hf(LlamaForCausalLM, LlamaConfig, out, seed=0, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    return out, cfg, state


def same_config(ours, hf):
    # GGUF does not record the dtype the checkpoint was trained/saved in.
    assert dataclasses.replace(ours, torch_dtype=None) == dataclasses.replace(hf, torch_dtype=None)


# A small llama file whose layer 0 mixes quantised types inside both fused projections (as Q4_K_M files do).
H, FFN, HEADS, KV, LAYERS, VOCAB = 64, 128, 4, 2, 2, 64
# Layer 0 mixes types inside both fused projections; layer 1 is uniform.
TYPES = {
    "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "Q5_1", "blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_down.weight": "Q5_1",
    "blk.0.attn_output.weight": "Q8_0", "token_embd.weight": "Q8_0", "output.weight": "Q4_0",
}


def write_mixed(path: Path, seed: int = 0, types: dict | None = None) -> Path:
    rng = np.random.default_rng(seed)
    types = TYPES if types is None else types
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(H // HEADS)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>"] + [f"t{i}" for i in range(2, VOCAB)])
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges([])
    w.add_eos_token_id(1)
    shapes = {"token_embd.weight": (VOCAB, H), "output.weight": (VOCAB, H), "output_norm.weight": (H,)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (KV * H // HEADS, H),
                       f"blk.{i}.attn_v.weight": (KV * H // HEADS, H), f"blk.{i}.attn_output.weight": (H, H),
                       f"blk.{i}.ffn_gate.weight": (FFN, H), f"blk.{i}.ffn_up.weight": (FFN, H),
                       f"blk.{i}.ffn_down.weight": (H, FFN)})
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        a = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        t = T[types.get(name, "Q8_0")]
        if t == T.IQ4_NL:  # the gguf package cannot quantise it: random table indices, small fp16 scales
            blocks = rng.integers(0, 256, (shape[0], shape[1] // 32, 18), dtype=np.uint8)
            d = rng.uniform(0.001, 0.003, blocks.shape[:2]).astype(np.float16)
            blocks[:, :, :2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
            w.add_tensor(name, blocks.reshape(shape[0], -1), raw_dtype=t)
            continue
        w.add_tensor(name, ref_quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
