"""bench decode's memory roofline: weight bytes read per token from the file, the read bandwidth, the share line."""
from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest

from kvinfer.bench import roofline
from kvinfer.cli import main


def _write(path, names):
    w = gguf.GGUFWriter(str(path), "llama")
    sizes = {}
    for i, name in enumerate(names):
        a = np.full((8 + 4 * i, 32), i, dtype=np.float16)
        w.add_tensor(name, a)
        sizes[name] = a.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sizes


def test_bytes_per_token_leave_out_the_embedding_only_when_the_head_is_its_own(tmp_path):
    untied = _write(tmp_path / "u.gguf", ["token_embd.weight", "blk.0.attn_q.weight", "output.weight"])
    assert roofline.weight_bytes_per_token(tmp_path / "u.gguf") == untied["blk.0.attn_q.weight"] + untied["output.weight"]
    tied = _write(tmp_path / "t.gguf", ["token_embd.weight", "blk.0.attn_q.weight"])
    assert roofline.weight_bytes_per_token(tmp_path / "t.gguf") == sum(tied.values())


def test_read_bandwidth_is_a_positive_rate_and_refuses_nonsense():
    bw = roofline.read_bandwidth(1, nbytes=8 << 20, passes=2)
    assert math.isfinite(bw) and bw > 0
    with pytest.raises(ValueError):
        roofline.read_bandwidth(1, nbytes=0)
    with pytest.raises(ValueError):
        roofline.read_bandwidth(1, nbytes=1 << 20, passes=0)


def test_bench_decode_reports_each_engine_against_the_roofline(tmp_path, capsys, monkeypatch):
    import importlib.util
    from pathlib import Path
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("make_gguf", Path(__file__).resolve().parents[2] / "scripts/make_gguf.py")
    make_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_gguf)
    path = make_gguf.make(tmp_path / "m.gguf", "tiny", "Q4_0")
    monkeypatch.setattr(roofline, "BANDWIDTH_BUFFER_BYTES", 16 << 20)
    argv = ["bench", "decode", "--model", str(path), "--tokens", "4", "--prompt-tokens", "4", "--compare", "none",
            "--kv-cache-memory", "8MiB"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["roofline"]
    assert r["bytes_per_token"] == roofline.weight_bytes_per_token(path) > 0
    assert r["bound_tps"] == pytest.approx(r["read_bandwidth"] / r["bytes_per_token"])
    assert len(r["bandwidth_samples"]) == 2 and r["read_bandwidth"] == max(r["bandwidth_samples"])  # before, after
    assert out["rows"][0]["roofline_share"] == pytest.approx(out["rows"][0]["decode_tps"] / r["bound_tps"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "memory roofline:" in text and "kvinfer " in text.split("memory roofline:")[1]
    assert main(argv + ["--no-roofline"]) == 0
    assert "memory roofline" not in capsys.readouterr().out


def test_moe_bytes_count_the_experts_a_token_uses(tmp_path):
    import importlib.util
    from pathlib import Path

    from kvinfer.loaders.dequant import nbytes_for
    from kvinfer.loaders.gguf_loader import _File

    spec = importlib.util.spec_from_file_location("make_gguf", Path(__file__).resolve().parents[2] / "scripts/make_gguf.py")
    mg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mg)
    path = mg.make(tmp_path / "moe.gguf", "tiny-qwen3moe", "Q8_0")
    experts, used = mg.MOE["tiny-qwen3moe"]
    f = _File(path, with_tensors=True)
    sizes = {i.name: nbytes_for(i.type_id, i.shape) for i in f.infos}
    f.close()
    exps = sum(v for k, v in sizes.items() if "_exps." in k)
    assert exps > 0
    assert roofline.weight_bytes_per_token(path) == sum(sizes.values()) - exps + exps * used // experts
