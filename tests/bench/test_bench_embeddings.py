"""`kvinfer bench serve --workload embeddings`: the same requests to kvinfer's server and to llama-server."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvinfer.bench.serve_embeddings import embedding_workload
from kvinfer.cli import main

LLAMA_SERVER = Path("/work/llama/build/bin/llama-server")


def test_workload_is_seeded_and_mixed_length():
    a, b = embedding_workload(3, 4, 0), embedding_workload(3, 4, 0)
    assert a == b and a != embedding_workload(3, 4, 1)
    lengths = {len(t.split()) for req in a for t in req}
    assert len(lengths) > 3 and all(8 <= n <= 200 for n in lengths)


def test_without_llama_server_kvinfer_row_only(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    rc = main(["bench", "serve", "--workload", "embeddings", "--num-requests", "2", "--inputs-per-request", "2",
               "--max-model-len", "512", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in out["rows"]] == ["kvinfer serve"] and out["rows"][0]["inputs"] == 4
    assert out["rows"][0]["tokens"] > 4 * 8 and "not found" in out["note"]


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason=f"{LLAMA_SERVER} is not built")
def test_against_llama_server_counts_the_same_tokens(capsys):
    rc = main(["bench", "serve", "--workload", "embeddings", "--num-requests", "2", "--inputs-per-request", "2",
               "--max-model-len", "512", "--llama-server", str(LLAMA_SERVER), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ours, peer = out["rows"]
    assert peer["name"] == "llama-server" and ours["inputs"] == peer["inputs"] == 4
    assert ours["tokens"] == peer["tokens"]  # the same GGUF tokenizer, the same texts
    assert out["kvinfer_over_llama_server"] > 0
