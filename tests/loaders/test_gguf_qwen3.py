"""GGUF architecture qwen3 (per-head q/k RMSNorm, rows in HF order): config, tokenizer section and logits match
the same weights as a Hugging Face Qwen3 model."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvinfer.config import EngineConfig
from kvinfer.loaders.gguf_loader import read_gguf
from kvinfer.loaders.model_loader import load_model
from kvinfer.models.families import model_config_from_hf
from kvinfer.utils import builtin_model_path
from tests.gguf_helpers import gguf_name, same_config
from tests.reference_helpers import hf_logits, step_logits

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def _make_gguf_module():
    script = Path(__file__).resolve().parents[2] / "scripts/make_gguf.py"
    spec = importlib.util.spec_from_file_location("make_gguf", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_gguf = _make_gguf_module()
VOCAB = len(make_gguf.tokenizer_entries(builtin_model_path())["tokenizer.ggml.tokens"])


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():  # norms start at 1; randomise so a mix-up of q_norm and k_norm would show
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape) if p.ndim == 1 else 0.1 * torch.randn(p.shape))
    model.save_pretrained(out)
    return out, json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def write_qwen3(path, cfg, state):
    norms = {k: v for k, v in state.items() if k.endswith(("q_norm.weight", "k_norm.weight"))}
    rest = {k: v for k, v in state.items() if k not in norms}
    extra = []
    for k, v in norms.items():
        layer, which = k.split(".")[2], "attn_q_norm" if "q_norm" in k else "attn_k_norm"
        extra.append((f"blk.{layer}.{which}.weight", v.float().numpy(), None))
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tok = make_gguf.tokenizer_entries(builtin_model_path())
    tok.update({"tokenizer.chat_template": TEMPLATE, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eot_token_id": 7})
    make_gguf.add_entries(w, tok)
    for hf, t in rest.items():
        w.add_tensor(gguf_name(hf), np.ascontiguousarray(t.float().numpy()))
    for name, a, _ in extra:
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen3_config_and_tensors(tiny_qwen3, tmp_path):
    _, cfg, state = tiny_qwen3
    ck = read_gguf(write_qwen3(tmp_path / "q3.gguf", cfg, state))
    want = model_config_from_hf(cfg)
    # eos from the file: the eos token and the end-of-turn token.
    assert ck.config.eos_token_ids == (2, 7)
    same_config(ck.config.replace(eos_token_ids=want.eos_token_ids), want)
    assert ck.config.qk_norm and ck.config.head_dim == 32
    assert set(ck.tensors) == set(state)
    for name, t in state.items():
        assert torch.equal(ck.tensors[name], t.float()), name
    assert gguf_name("model.layers.0.self_attn.q_proj.weight") == "blk.0.attn_q.weight"


@torch.inference_mode()
def test_qwen3_logits_match_hf(tiny_qwen3, tmp_path):
    from transformers import Qwen3ForCausalLM

    out, cfg, state = tiny_qwen3
    path = write_qwen3(tmp_path / "q3.gguf", cfg, state)
    ours = load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    assert ours.tokenizer.has_chat_template and ours.tokenizer.chat_template == TEMPLATE
    hf = Qwen3ForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = [5, 9, 40, 77, 120, 3, 250]
    got = step_logits(ours, ids[:4], ids[4:], "paged")
    want = hf_logits(hf, ids)
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (got - want).abs().max()
