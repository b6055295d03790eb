"""`kvinfer perplexity`: llama-perplexity's chunking and scoring over the engine's prompt logprobs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvinfer.cli import main
from kvinfer.config import EngineConfig
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.bench.perplexity import chunk_tokens, evaluate, perplexity
from tests.reference_helpers import hf_logits


def test_chunks_are_whole_and_start_with_bos():
    assert chunk_tokens(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the partial rest is dropped
    assert chunk_tokens(list(range(10)), 4, 99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert chunk_tokens(list(range(3)), 4, None) == []
    ppl, err = perplexity([1.0, 3.0])
    assert ppl == pytest.approx(math.exp(2.0)) and err == pytest.approx(math.exp(2.0) * math.sqrt(2.0 / 2))


def test_perplexity_matches_transformers(tiny_llama_dir):
    # Each chunk's second half scored, from the engine's prompt logprobs, against transformers' log-softmax.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", kv_cache_memory=8 << 20, block_size=4))
    ids = torch.randint(3, 256, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    chunks = chunk_tokens(ids, 32, 1)
    nll, counts = evaluate(engine, chunks, 32)
    assert counts == [15, 15, 15]  # tokens 17..31 of each chunk of 32
    want = []
    for c in chunks:
        logp = torch.log_softmax(hf_logits(hf, c), dim=-1)
        want += [-logp[j - 1, c[j]].item() for j in range(17, 32)]
    assert nll == pytest.approx(want, abs=1e-4)


def test_cli_perplexity_of_a_text(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30, encoding="utf-8")
    assert main(["perplexity", str(text), "--context", "64", "--chunks", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["chunks"] == 3 and r["scored_tokens"] == 3 * 31 and r["context"] == 64
    # a repeated sentence is easy to predict once seen: far below the vocabulary's 49,152
    assert 1.0 < r["perplexity"] < 20.0 and r["stderr"] > 0
    assert main(["perplexity", str(text), "--context", "64", "--chunks", "3"]) == 0
    out = capsys.readouterr().out
    assert "[1]" in out and "[3]" in out and f"perplexity {r['perplexity']:.4f} +/-" in out


@pytest.mark.parametrize("args, message", [
    (["/no/such/file.txt"], "cannot be read"),
    (["{short}", "--context", "512"], "needs at least 512"),
    (["{short}", "--context", "4096", "--max-model-len", "1024"], "context window"),
])
def test_cli_perplexity_errors_are_one_line(tmp_path, capsys, args, message):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.", encoding="utf-8")
    args = [a.replace("{short}", str(short)) for a in args]
    assert main(["perplexity", *args]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
