"""`kvinfer bench decode|throughput` end to end on a tiny model, with transformers as the peer."""
from __future__ import annotations

import json

import pytest

from kvinfer.bench.workload import throughput_workload
from kvinfer.cli import main


def test_bench_throughput_json_counts_and_ratio(tiny_llama_dir, capsys):
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "4", "--hf-batch-size", "2",
               "--kv-cache-memory", "8MiB", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    ours, hf = res["rows"]
    work = throughput_workload(4, 0, vocab_size=256)
    assert ours["generated"] == sum(w.output_tokens for w in work)  # ignore_eos: every request runs to its length
    assert ours["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in work)
    assert hf["name"] == "transformers (static batches of 2)" and hf["useful_tokens"] == ours["generated"]
    assert hf["kvinfer_vs_this"] == ours["tps"] / hf["tps"]
    assert 0.5 < ours["kv_utilisation"] <= 1.0 and 0 < ours["peak_blocks"] <= ours["total_blocks"]
    assert ours["kv_bytes"] == 8 << 20 and ours["overhead_bytes"] == ours["peak_rss"] - ours["weights_bytes"] - (8 << 20)


def test_bench_throughput_prints_ours_before_the_peers(tiny_llama_dir, capsys):
    assert main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "2", "--compare", "none"]) == 0
    out = capsys.readouterr().out
    assert out.index("generated tokens/s") < out.index("KV blocks peak") < out.index("engine ")
    assert "utilisation" in out and "peak RSS" in out and "transformers" not in out


def test_bench_decode_table(tiny_llama_dir, capsys):
    rc = main(["bench", "decode", "--model", tiny_llama_dir, "--tokens", "8", "--prompt-tokens", "4", "--block-size", "2",
               "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in res["rows"]]
    assert names == ["kvinfer", "transformers"]
    for r in res["rows"]:
        assert r["decode_tps"] > 0 and r["ttft"] > 0
        assert r["prefill_tps"] == 4 / r["ttft"]
    assert res["rows"][0]["cached_prompt_tokens"] == 0  # the warm-up must not serve the prompt from the cache
    assert res["rows"][1]["kvinfer_vs_this"] == res["rows"][0]["decode_tps"] / res["rows"][1]["decode_tps"]


def test_bench_rejects_unknown_peer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode", "--compare", "vllm"])
    assert e.value.code == 2
    assert "unknown peer 'vllm'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["throughput", "--num-requests", "0"], "--num-requests must be >= 1"),
    (["decode", "--tokens", "1"], "--tokens must be >= 2"),
    (["decode", "--prompt-tokens", "0"], "--prompt-tokens must be >= 1"),
    (["throughput", "--hf-batch-size", "-1"], "--hf-batch-size must be >= 1"),
    (["serve", "--rounds", "0"], "--rounds must be >= 1"),
    (["serve", "--max-concurrency", "x"], "--max-concurrency must be an integer"),
])
def test_bench_bad_counts_are_one_line_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
