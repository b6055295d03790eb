"""GGUF blocks through kvinfer's kernels vs the dequantized float32 model: greedy agreement and perplexity."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvinfer import LLM, SamplingParams
from kvinfer.kv.cache import NoCache, SeqSlice
from tests.builtin_helpers import PROMPTS

@pytest.fixture(scope="module")
def pair():
    quant = LLM(None, dtype="float32", quantization="gguf", kv_cache_memory=128 << 20)
    plain = LLM(None, dtype="float32", quantization="none", kv_cache_memory=128 << 20)
    assert quant.engine.loaded.quantized_modules > 0 and plain.engine.loaded.quantized_modules == 0
    return quant, plain


def test_greedy_agreement(pair):
    quant, plain = pair
    tok = quant.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    b = [o.outputs[0].token_ids for o in plain.generate(ids, sp, use_tqdm=False)]
    a = [o.outputs[0].token_ids for o in quant.generate(ids, sp, use_tqdm=False)]
    same = sum(x == y for x, y in zip(a, b))
    print(f"identical 32-token continuations: {same}/{len(PROMPTS)}")
    assert same >= 0.9 * len(PROMPTS)


def perplexity(llm, ids) -> float:
    model = llm.engine.loaded.model
    kv = NoCache(model.cfg.num_layers, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv.prepare([SeqSlice(0, len(ids))]), kv)
        logp = torch.log_softmax(model.compute_logits(hidden[:-1]), -1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)


def test_perplexity_within_one_percent(pair):
    quant, plain = pair
    text = (Path(__file__).resolve().parents[1] / "data" / "fidelity.txt").read_text()
    ids = quant.tokenizer.encode(text)
    pq = perplexity(quant, ids)  # every row through the quantised kernel, exactly as it would be alone
    pp = perplexity(plain, ids)
    print(f"perplexity on {len(ids)} tokens: kernels {pq:.4f}, dequantized float32 {pp:.4f}")
    assert abs(pq - pp) / pp < 0.01


def test_batched_equals_alone_bitwise(pair):
    # 20 sequences decoding together and each alone: the same tokens and the same logprob bits (the exactness
    # contract; every matmul row has one arithmetic whatever shares the step).
    quant, _ = pair
    ids = [quant.tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    together = quant.generate(ids, sp, use_tqdm=False)
    alone = [quant.generate([p], sp, use_tqdm=False)[0] for p in ids]
    for t, a in zip(together, alone):
        assert t.outputs[0].token_ids == a.outputs[0].token_ids
        assert [x.logprob for x in t.outputs[0].logprobs] == [x.logprob for x in a.outputs[0].logprobs]
