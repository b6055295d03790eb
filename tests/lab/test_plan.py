"""The memory planner: the 40 GB / 8-request example's arithmetic, bytes per token equal to what the engine allocates."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvinfer.cli import main
from kvinfer.config import EngineConfig
from kvinfer.errors import ValidationError
from kvinfer.lab.plan import make_plan, parse_workload, resolve_model_config
from kvinfer.models.families import load_hf_config, preset_config

GIB = 1 << 30

MHA = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
GQA = dict(MHA, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16)


def test_llama2_7b_seed_arithmetic():
    p = make_plan(preset_config("llama-2-7b"), 40 * GIB, 8192, "float16")
    assert p["kv_bytes_per_token"] == 524_288 == 512 * 1024
    assert p["kv_bytes_per_request"] == 4 * GIB
    assert p["num_parameters"] == 6_738_415_616
    assert p["weight_bytes"] == 2 * 6_738_415_616
    # "8 x 4 GB fills 40 GB": eight max-length requests reserve 32 GiB of KV; the pure-KV view fits them
    # (and stops at ten), but beside 12.55 GiB of weights the eighth is already past the ceiling of six.
    eight = next(r for r in p["seed_view"] if r["requests"] == 8)
    assert eight["kv_bytes"] == 32 * GIB and eight["fits_kv_only"] and not eight["fits_with_weights"]
    assert p["concurrent"]["requests"] == 8 and p["concurrent"]["contiguous_kv_bytes"] == 32 * GIB
    assert not p["concurrent"]["contiguous_fits"] and p["concurrent"]["contiguous_fits_kv_only"]
    assert p["contiguous"]["max_requests_kv_only"] == 10
    assert p["contiguous"]["max_requests"] == 6
    # Paging the same memory: requests hold what their lengths need, so many more fit.
    assert p["paged"]["mean_requests"] > 4 * p["contiguous"]["max_requests"]
    assert p["concurrent"]["paged_fits"]
    assert p["paged"]["block_bytes"] == 16 * 524_288


def test_pure_kv_ceiling_in_decimal_gigabytes():
    p = make_plan(preset_config("llama-2-7b"), 40 * 10**9, 8192, "float16")
    assert p["contiguous"]["max_requests_kv_only"] == 9  # 40e9 / 2**32


@pytest.mark.parametrize("shape", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_bytes_per_token_equal_engine_allocation(tmp_path, shape, dtype, kind):
    from kvinfer.engine.llm_engine import LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(shape))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", dtype=dtype, kv_cache=kind,
                                    block_size=8, kv_cache_memory=96 << 10, max_model_len=32, max_num_seqs=4))
    allocated = engine.kv_cache.nbytes / engine.kv_manager.token_capacity
    plan = make_plan(load_hf_config(tmp_path / "config.json"), 1 << 30, 32, dtype, block_size=8)
    assert plan["kv_bytes_per_token"] == allocated == engine.kv_bytes_per_token
    if kind == "paged":
        assert engine.kv_cache.nbytes == engine.kv_manager.num_total_blocks * plan["paged"]["block_bytes"]


def test_tensor_parallel_divides_weights_and_kv():
    one = make_plan(preset_config("llama-3-8b"), 80 * GIB, 8192, "bfloat16", tp=1)
    two = make_plan(preset_config("llama-3-8b"), 80 * GIB, 8192, "bfloat16", tp=2)
    assert two["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"] == 131_072
    assert two["weight_bytes"] == one["weight_bytes"] // 2
    # More devices than KV heads: each device keeps one (replicated) head.
    sixteen = make_plan(preset_config("llama-3-8b"), 80 * GIB, 8192, "bfloat16", tp=16)
    assert sixteen["kv_heads_per_device"] == 1
    with pytest.raises(ValidationError, match="tp"):
        make_plan(preset_config("llama-3-8b"), 80 * GIB, 8192, tp=3)


def test_workloads():
    u = parse_workload("uniform:1-32", 8192)
    assert u.mean_tokens() == pytest.approx(16.5)
    assert u.mean_blocks(16) == pytest.approx(np.mean([-(-n // 16) for n in range(1, 33)]))
    odd = parse_workload("uniform:7-1000", 8192)
    assert odd.mean_blocks(13) == pytest.approx(np.mean([-(-n // 13) for n in range(7, 1001)]))
    m = parse_workload("mean:1000", 8192)
    assert m.mean_tokens() == 1000 and m.mean_blocks(16) == 63
    mix = parse_workload("mix:3@100-100,1@200-200", 8192)
    assert mix.mean_tokens() == pytest.approx(125)
    d = parse_workload(None, 2048)
    assert d.max_tokens == 2048 and sum(w for w, _, _ in d.parts) == pytest.approx(1.0)
    for bad in ("normal:5", "uniform:9-3", "mean:3-4", "mix:x@1-2", "mix:0@1-2", "uniform:1-9000"):
        with pytest.raises(ValidationError, match="workload"):
            parse_workload(bad, 8192)


def test_resolve_model_sources(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GQA))
    cfg_dir, _ = resolve_model_config(str(tmp_path))
    cfg_file, _ = resolve_model_config(str(tmp_path / "config.json"))
    assert cfg_dir == cfg_file and cfg_dir.num_kv_heads == 2
    assert resolve_model_config("llama-2-7b")[0] == preset_config("llama-2-7b")


def test_resolve_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    h, inter, layers, heads, kv, vocab = 32, 64, 2, 4, 2, 64
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    hd = h // heads

    def t(name, *shape):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    t("token_embd.weight", vocab, h)
    t("output_norm.weight", h)
    t("output.weight", vocab, h)
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", h)
        t(f"blk.{i}.ffn_norm.weight", h)
        t(f"blk.{i}.attn_q.weight", heads * hd, h)
        t(f"blk.{i}.attn_k.weight", kv * hd, h)
        t(f"blk.{i}.attn_v.weight", kv * hd, h)
        t(f"blk.{i}.attn_output.weight", h, heads * hd)
        t(f"blk.{i}.ffn_gate.weight", inter, h)
        t(f"blk.{i}.ffn_up.weight", inter, h)
        t(f"blk.{i}.ffn_down.weight", h, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg, label = resolve_model_config(str(tmp_path / "t.gguf"))
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 8)
    assert "GGUF" in label
    assert make_plan(cfg, GIB, 256, "float32")["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4


def test_cli_json(capsys):
    rc = main(["plan", "--model", "llama-2-7b", "--memory", "40GiB", "--max-model-len", "8192", "--dtype", "float16",
               "--json"])
    assert rc == 0
    p = json.loads(capsys.readouterr().out)
    assert p["kv_bytes_per_token"] == 524_288 and p["kv_bytes_per_request"] == 4 * GIB


def test_cli_text_mentions_the_numbers(capsys):
    assert main(["plan", "--model", "llama-2-7b", "--memory", "40GiB", "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "524,288 B (512.00 KiB)" in out and "4.00 GiB at 8192 tokens" in out and "32.00 GiB" in out


@pytest.mark.parametrize("argv, word", [
    (["--memory", "40XB"], "memory"),
    (["--memory", "40GiB", "--workload", "uniform:1-99999"], "workload"),
    (["--memory", "40GiB", "--tp", "5"], "tp"),
])
def test_cli_bad_values_are_one_line(capsys, argv, word):
    rc = main(["plan", "--model", "llama-2-7b"] + argv)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and word in err and "Traceback" not in err


def test_cli_unknown_model_is_one_line(capsys):
    assert main(["plan", "--model", "no-such-model", "--memory", "1GiB"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err
