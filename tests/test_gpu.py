"""The same code on CUDA: greedy tokens equal the CPU's (skipped without a GPU)."""
from __future__ import annotations

import pytest

from kvinfer import LLM, SamplingParams


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["paged", "contiguous", "none"])
def test_cuda_matches_cpu(tiny_llama_dir, kv):
    ps = [[5, 9, 13, 17], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache=kv, kv_cache_memory=8 << 20).generate(ps, sp)
    gpu = LLM(tiny_llama_dir, dtype="float32", device="cuda", kv_cache=kv, kv_cache_memory=8 << 20).generate(ps, sp)
    assert [o.outputs[0].token_ids for o in cpu] == [o.outputs[0].token_ids for o in gpu]
