"""kvinfer.kernels.paged_decode_attention against a plain softmax(q k^T) v over the same cached tokens."""
from __future__ import annotations

import pytest
import torch

from kvinfer import kernels
from kvinfer.layers.alibi import alibi_slopes

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable on this machine")


def _case(B, H, KVH, D, BS, lens, seed=0, num_blocks=None):
    g = torch.Generator().manual_seed(seed)
    T = max(-(-n // BS) for n in lens)
    NB = num_blocks or B * T + 3
    k = torch.randn(NB, BS, KVH, D, generator=g)
    v = torch.randn(NB, BS, KVH, D, generator=g)
    perm = torch.randperm(NB, generator=g)[:B * T]  # scattered, distinct blocks per sequence
    tables = perm.view(B, T).contiguous()
    q = torch.randn(B, H, D, generator=g)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int64)


def _reference(q, k, v, tables, lens, scale, slopes=None, window=None):
    B, H, D = q.shape
    _, BS, KVH, _ = k.shape
    out = torch.empty_like(q)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n)
        slots = tables[b][pos // BS] * BS + pos % BS
        kk = k.reshape(-1, KVH, D)[slots].transpose(0, 1).repeat_interleave(H // KVH, 0).double()  # [H, n, D]
        vv = v.reshape(-1, KVH, D)[slots].transpose(0, 1).repeat_interleave(H // KVH, 0).double()
        s = (kk @ q[b].double()[:, :, None])[..., 0] * scale  # [H, n]
        if slopes is not None:
            s = s + slopes.double()[:, None] * (pos - (n - 1)).double()[None]
        if window is not None:
            s = s.masked_fill((pos <= n - 1 - window)[None], float("-inf"))
        out[b] = (torch.softmax(s, -1)[:, None] @ vv)[:, 0].float()
    return out


@pytest.mark.parametrize("H,KVH,D", [(4, 4, 16), (9, 3, 64), (8, 1, 32), (6, 2, 20)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_matches_reference_mha_gqa_mqa(H, KVH, D, threads):
    lens = [1, 5, 16, 17, 70, 3]
    q, k, v, tables, ln = _case(len(lens), H, KVH, D, 16, lens, seed=H * 10 + KVH)
    out = kernels.paged_decode_attention(q, k, v, tables, ln, D ** -0.5, num_threads=threads)
    torch.testing.assert_close(out, _reference(q, k, v, tables, ln, D ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [1, 2, 9])  # few sequences: their blocks are split in chunks; many: one item each
def test_batch_sizes_and_block_size(B):
    lens = [(37 * i) % 90 + 1 for i in range(1, B + 1)]
    q, k, v, tables, ln = _case(B, 8, 2, 32, 4, lens, seed=B)
    out = kernels.paged_decode_attention(q, k, v, tables, ln, 0.3, num_threads=4)
    torch.testing.assert_close(out, _reference(q, k, v, tables, ln, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("lens", [[1], [3], [40], [333], [2, 200]])
def test_split_sequences_merge_their_chunks(threads, lens):
    # MQA (one kv head) and one or two sequences: each sequence's blocks are split across up to 8 work items
    # whose partial softmaxes are merged; a short sequence leaves some chunks empty.
    B = len(lens)
    q, k, v, tables, ln = _case(B, 8, 1, 64, 16, lens, seed=sum(lens) + threads)
    for kw, ref in [({}, {}), ({"alibi_slopes": alibi_slopes(8)}, {"slopes": alibi_slopes(8)}),
                    ({"sliding_window": 37}, {"window": 37})]:
        out = kernels.paged_decode_attention(q, k, v, tables, ln, 0.125, num_threads=threads, **kw)
        torch.testing.assert_close(out, _reference(q, k, v, tables, ln, 0.125, **ref), rtol=1e-5, atol=1e-5)


def test_alibi_and_sliding_window():
    lens = [1, 9, 40]
    q, k, v, tables, ln = _case(3, 8, 8, 16, 8, lens, seed=3)
    slopes = alibi_slopes(8)
    out = kernels.paged_decode_attention(q, k, v, tables, ln, 0.25, alibi_slopes=slopes)
    torch.testing.assert_close(out, _reference(q, k, v, tables, ln, 0.25, slopes=slopes), rtol=1e-5, atol=1e-5)
    out = kernels.paged_decode_attention(q, k, v, tables, ln, 0.25, sliding_window=7)
    torch.testing.assert_close(out, _reference(q, k, v, tables, ln, 0.25, window=7), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    q, k, v, tables, ln = _case(2, 4, 2, 16, 4, [3, 8])
    with pytest.raises(RuntimeError, match="block id outside the pool"):
        kernels.paged_decode_attention(q, k, v, torch.full_like(tables, k.shape[0]), ln, 1.0)
    with pytest.raises(RuntimeError, match="sequence length"):
        kernels.paged_decode_attention(q, k, v, tables, torch.tensor([3, 9]), 1.0)  # 9 > 2 blocks of 4
    with pytest.raises(RuntimeError, match="sequence length"):
        kernels.paged_decode_attention(q, k, v, tables, torch.tensor([0, 8]), 1.0)
    with pytest.raises(ValueError, match="q must be a contiguous torch.float32"):
        kernels.paged_decode_attention(q.double(), k, v, tables, ln, 1.0)
    with pytest.raises(ValueError, match="tables must be"):
        kernels.paged_decode_attention(q, k, v, tables.int(), ln, 1.0)
    with pytest.raises(ValueError, match="shapes do not fit"):
        kernels.paged_decode_attention(q[:, :3].contiguous(), k, v, tables, ln, 1.0)


def test_paged_engine_decodes_through_the_kernel_and_matches_the_gather_path(tiny_llama_dir):
    from kvinfer import LLM, SamplingParams
    from kvinfer.kv.cache import PagedCache

    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 20, block_size=4)
    calls = []
    orig = PagedCache.decode_attend

    def counting(self, *a, **kw):
        calls.append(1)
        return orig(self, *a, **kw)

    PagedCache.decode_attend = counting
    try:
        fast = llm.generate(prompts, params, use_tqdm=False)
    finally:
        PagedCache.decode_attend = orig
    assert calls  # the decode steps took the kernel
    llm.engine.kv_cache.use_decode_kernel = False
    llm.engine.kv_cache._kernel_ok = None
    slow = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
