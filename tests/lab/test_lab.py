"""The KV-cache lab: K/V work matches the formulas exactly, outputs agree, files and the CLI come out right."""
from __future__ import annotations

import csv
import json
import math

import pytest

from kvinfer.cli import main
from kvinfer.config import EngineConfig
from kvinfer.lab.kvcache import (BackendRun, LabResult, StepRecord, check_identical, kv_formula, latency_trend,
                                 markdown_table, run_lab, summary, write_outputs)

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lab_tiny")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


@pytest.fixture(scope="module")
def lab8(tiny_dir):
    cfg = EngineConfig(model=tiny_dir, load_format="dummy", dtype="float32", block_size=4)
    return run_lab(cfg, num_tokens=8, prompt_tokens=5)


def test_kv_computations_match_formulas_exactly(lab8):
    layers, p, n = TINY["num_hidden_layers"], 5, 8
    none, contiguous, paged = (lab8.runs[b] for b in ("none", "contiguous", "paged"))
    # No cache: step i pushes the whole sequence of p + i tokens through every layer's K/V projection.
    assert [s.kv_computed for s in none.steps] == [layers * (p + i) for i in range(n)]
    assert none.kv_computed == sum(layers * (p + i) for i in range(n)) == kv_formula("none", p, n, layers)
    # A cache: the prompt once, then one token per step; the last generated token is never projected.
    for run in (contiguous, paged):
        assert [s.kv_computed for s in run.steps] == [layers * p] + [layers] * (n - 1)
        assert run.kv_computed == layers * (p + n - 1) == kv_formula(run.backend, p, n, layers)


def test_three_backends_agree_and_report_memory(lab8):
    assert lab8.identical and not lab8.mismatch
    tokens = [r.token_ids for r in lab8.runs.values()]
    assert len(tokens[0]) == 8 and tokens[0] == tokens[1] == tokens[2]
    bpt = lab8.kv_bytes_per_token
    assert bpt == 2 * 3 * 2 * 16 * 4
    none, contiguous, paged = (lab8.runs[b] for b in ("none", "contiguous", "paged"))
    longest = 5 + 8 - 1
    assert none.peak_kv_bytes == longest * bpt // 3  # one layer's transient K/V
    assert contiguous.peak_kv_bytes == contiguous.reserved_kv_bytes == 128 * bpt  # one max-length slot
    assert paged.peak_kv_bytes == math.ceil(longest / 4) * 4 * bpt  # blocks actually used
    s = summary(lab8)
    assert s["backends"]["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert s["backends"]["paged"]["kv_formula"] == s["backends"]["paged"]["kv_computed"]


def test_outputs_written(lab8, tmp_path):
    files = write_outputs(lab8, tmp_path)
    for key in ("csv", "table", "latency_by_position", "kv_computations", "kv_memory"):
        assert files[key].is_file() and files[key].stat().st_size > 0
    rows = list(csv.DictReader(open(files["csv"])))
    assert len(rows) == 3 * 8
    assert {r["backend"] for r in rows} == {"none", "contiguous", "paged"}
    last_none = [r for r in rows if r["backend"] == "none"][-1]
    assert int(last_none["kv_computed_cumulative"]) == kv_formula("none", 5, 8, 3)
    table = files["table"].read_text()
    for row in ("per-token latency trend", "total K/V computations", "total time", "KV memory"):
        assert row in table
    assert "| | no cache | contiguous cache | paged cache |" in table
    assert files["latency_by_position"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mismatch_is_detected():
    def run(name, toks):
        return BackendRun(name, toks, [StepRecord(0, 3, 3, 0.01, 3, 0)])

    res = LabResult("m", "float32", 1, 8, 3, 3, 16, 16,
                    {"none": run("none", [1, 2, 3]), "paged": run("paged", [1, 2, 4])})
    check_identical(res)
    assert not res.identical
    assert "generated token 2" in res.mismatch and "3 vs 4" in res.mismatch
    assert "NO" in markdown_table(res)
    # Same tokens, logprobs one ulp apart: still a mismatch (the contract is bitwise).
    a, b = run("none", [1, 2, 3]), run("paged", [1, 2, 3])
    a.logprobs, b.logprobs = [-0.5, -1.0, -2.0], [-0.5, -1.0000001, -2.0]
    res = LabResult("m", "float32", 1, 8, 3, 3, 16, 16, {"none": a, "paged": b})
    check_identical(res)
    assert not res.identical and "logprobs differ" in res.mismatch and "generated token 1" in res.mismatch


def test_latency_trend_slope_and_ratio():
    steps = [StepRecord(i, 10 + i, 1, (1 + i) / 1000, 1, 0) for i in range(21)]
    t = latency_trend(BackendRun("none", [], steps))
    assert t["slope_ms_per_1k"] == pytest.approx(1000.0)
    assert t["ratio"] == pytest.approx(t["last_ms"] / t["first_ms"]) and t["ratio"] > 5
    assert latency_trend(BackendRun("none", [], steps[:2]))["ratio"] is None


def test_cli_json(tiny_dir, tmp_path, capsys):
    rc = main(["lab", "kvcache", "--model", tiny_dir, "--load-format", "dummy", "--dtype", "float32",
               "--tokens", "4", "--prompt-tokens", "3", "--out", str(tmp_path), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outputs_identical"] is True
    assert out["backends"]["none"]["kv_computed"] == kv_formula("none", 3, 4, 3)
    assert out["backends"]["paged"]["kv_computed"] == kv_formula("paged", 3, 4, 3)
    assert (tmp_path / "kvcache_lab.md").is_file()


def test_cli_bad_value_is_one_line(tiny_dir, tmp_path, capsys):
    rc = main(["lab", "kvcache", "--model", tiny_dir, "--load-format", "dummy", "--tokens", "500",
               "--prompt-tokens", "3", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("\n") == 1 and "max_model_len" in err and "Traceback" not in err
