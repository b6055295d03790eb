"""kvinfer.kernels.attention against a plain softmax(q k^T) v over the same cached tokens, and its invariances."""
from __future__ import annotations

import pytest
import torch

from kvinfer import kernels
from kvinfer.layers.alibi import alibi_slopes

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable on this machine")


def paged_decode_attention(q, k, v, tables, lens, scale, num_threads=None, alibi_slopes=None, sliding_window=None,
                           lib=None):
    """One decode token per sequence (the last position of each) over paged pools [NB, BS, KVH, D]."""
    NB, BS, KVH, D = k.shape
    B = q.shape[0]
    return (lib or kernels).attention(q, k, v, tables, torch.arange(B), lens - 1, num_kv_heads=KVH, block_size=BS,
                                      num_blocks=NB,
                                      strides=(BS * KVH * D, KVH * D, D), scale=scale, num_threads=num_threads,
                                      alibi_slopes=alibi_slopes, sliding_window=sliding_window)


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
    out = paged_decode_attention(q, k, v, tables, ln, D ** -0.5, num_threads=threads)
    torch.testing.assert_close(out, _reference(q, k, v, tables, ln, D ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [1, 2, 9])
def test_batch_sizes_and_block_size(B):
    lens = [(37 * i) % 90 + 1 for i in range(1, B + 1)]
    q, k, v, tables, ln = _case(B, 8, 2, 32, 4, lens, seed=B)
    out = paged_decode_attention(q, k, v, tables, ln, 0.3, num_threads=4)
    torch.testing.assert_close(out, _reference(q, k, v, tables, ln, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lens", [[1], [40], [257], [600], [2, 700]])
def test_long_sequences_merge_their_pieces(threads, lens):
    # Positions are split into pieces of 256 whose partial softmaxes are merged in order; with one or two
    # sequences the pieces are the work items, spread over the threads.
    B = len(lens)
    q, k, v, tables, ln = _case(B, 8, 1, 64, 16, lens, seed=sum(lens) + threads)
    for kw, ref in [({}, {}), ({"alibi_slopes": alibi_slopes(8)}, {"slopes": alibi_slopes(8)}),
                    ({"sliding_window": 37}, {"window": 37})]:
        out = paged_decode_attention(q, k, v, tables, ln, 0.125, num_threads=threads, **kw)
        torch.testing.assert_close(out, _reference(q, k, v, tables, ln, 0.125, **ref), rtol=1e-5, atol=1e-5)


def test_alibi_and_sliding_window():
    lens = [1, 9, 40]
    q, k, v, tables, ln = _case(3, 8, 8, 16, 8, lens, seed=3)
    slopes = alibi_slopes(8)
    out = paged_decode_attention(q, k, v, tables, ln, 0.25, alibi_slopes=slopes)
    torch.testing.assert_close(out, _reference(q, k, v, tables, ln, 0.25, slopes=slopes), rtol=1e-5, atol=1e-5)
    out = paged_decode_attention(q, k, v, tables, ln, 0.25, sliding_window=7)
    torch.testing.assert_close(out, _reference(q, k, v, tables, ln, 0.25, window=7), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    q, k, v, tables, ln = _case(2, 4, 2, 16, 4, [3, 8])
    with pytest.raises(RuntimeError, match="block id or slot outside the pool"):
        paged_decode_attention(q, k, v, torch.full_like(tables, k.shape[0]), ln, 1.0)
    with pytest.raises(RuntimeError, match="bad shape or position"):
        paged_decode_attention(q, k, v, tables, torch.tensor([3, 9]), 1.0)  # 9 > 2 blocks of 4
    with pytest.raises(RuntimeError, match="bad shape or position"):
        paged_decode_attention(q, k, v, tables, torch.tensor([0, 8]), 1.0)  # position -1
    with pytest.raises(ValueError, match="q must be float32"):
        paged_decode_attention(q.double(), k, v, tables, ln, 1.0)
    with pytest.raises(ValueError, match="tables must be"):
        paged_decode_attention(q, k, v, tables.int(), ln, 1.0)
    with pytest.raises(ValueError, match="tok_seq names a sequence"):
        kernels.attention(q, k, v, tables, torch.tensor([0, 5]), ln - 1, num_kv_heads=2, block_size=4, num_blocks=k.shape[0],
                          strides=(4 * 2 * 16, 2 * 16, 16), scale=1.0)


def _prefill_reference(q, keys, values, scale, window=None, slopes=None, start=0):
    """q [n, H, D] at positions start..start+n-1 over keys/values [L, KVH, D] (causal)."""
    n, H, D = q.shape
    L, KVH, _ = keys.shape
    kk = keys.transpose(0, 1).repeat_interleave(H // KVH, 0).double()  # [H, L, D]
    vv = values.transpose(0, 1).repeat_interleave(H // KVH, 0).double()
    s = torch.einsum("nhd,hld->hnl", q.double(), kk) * scale
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(L)[None]
    if slopes is not None:
        s = s + slopes.double()[:, None, None] * (kpos - qpos).double()[None]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", torch.softmax(s, -1), vv).float()


@pytest.mark.parametrize("window,alibi,kv_dtype", [(None, False, torch.float32), (70, False, torch.float32),
                                                   (None, True, torch.float32), (None, False, torch.bfloat16)])
@pytest.mark.parametrize("D", [32, 64])
def test_prefill_over_three_layouts_matches_reference_and_is_bitwise_one_arithmetic(window, alibi, kv_dtype, D):
    # The same sequence's keys laid out as paged blocks (two block sizes), a contiguous slot and a step's own
    # fresh K/V: every query row gives the reference, and the same bits whatever the layout, the batch, the
    # chunking of the prefill and the thread count. D = 64 without a window is the tiled route (up to 16 query
    # tokens' pieces at once, tiles straddling the 256-position piece boundary; a bfloat16 cache's rows widened
    # once per tile); a token alone is not tiled.
    g = torch.Generator().manual_seed(7)
    L, H, KVH = 300, 6, 2
    keys, values = torch.randn(L, KVH, D, generator=g), torch.randn(L, KVH, D, generator=g)
    keys, values = keys.to(kv_dtype), values.to(kv_dtype)
    q = torch.randn(L, H, D, generator=g)
    slopes = alibi_slopes(H) if alibi else None
    kw = dict(scale=0.2, alibi_slopes=slopes, sliding_window=window, num_kv_heads=KVH,
              kv_dtype=str(kv_dtype).replace("torch.", ""))
    pos = torch.arange(L)
    outs = []
    for bs in (4, 16):
        nb = L // bs + 5
        perm = torch.randperm(nb, generator=g)[: -(-L // bs)]
        kp, vp = torch.zeros(nb, bs, KVH, D, dtype=kv_dtype), torch.zeros(nb, bs, KVH, D, dtype=kv_dtype)
        kp[perm[pos // bs], pos % bs], vp[perm[pos // bs], pos % bs] = keys, values
        outs.append(kernels.attention(q, kp, vp, perm.view(1, -1).contiguous(), torch.zeros(L, dtype=torch.long),
                                      pos, block_size=bs, num_blocks=nb, strides=(bs * KVH * D, KVH * D, D), **kw))
    slots = 3
    kc, vc = torch.zeros(slots, KVH, L, D, dtype=kv_dtype), torch.zeros(slots, KVH, L, D, dtype=kv_dtype)
    kc[1], vc[1] = keys.transpose(0, 1), values.transpose(0, 1)
    outs.append(kernels.attention(q, kc, vc, torch.tensor([[1]]), torch.zeros(L, dtype=torch.long), pos,
                                  block_size=L, num_blocks=slots, strides=(KVH * L * D, D, L * D), **kw))
    outs.append(kernels.attention(q, keys, values, torch.tensor([[0]]), torch.zeros(L, dtype=torch.long), pos,
                                  block_size=1 << 40, num_blocks=L, strides=(KVH * D, KVH * D, D), num_threads=1,
                                  **kw))
    torch.testing.assert_close(outs[0], _prefill_reference(q, keys.float(), values.float(), 0.2, window, slopes),
                               rtol=1e-5, atol=1e-5)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    # A chunk of the prefill (queries 200-259, keys already in the cache) and single rows alone.
    chunk = kernels.attention(q[200:260], keys, values, torch.tensor([[0]]), torch.zeros(60, dtype=torch.long),
                              pos[200:260], block_size=1 << 40, num_blocks=L, strides=(KVH * D, KVH * D, D), **kw)
    assert torch.equal(chunk, outs[0][200:260])
    for t in (0, 253, 255, 256, 257, 299):
        one = kernels.attention(q[t:t + 1], keys, values, torch.tensor([[0]]), torch.zeros(1, dtype=torch.long),
                                pos[t:t + 1], block_size=1 << 40, num_blocks=L, strides=(KVH * D, KVH * D, D),
                                num_threads=2, **kw)
        assert torch.equal(one[0], outs[0][t]), t


def test_every_level_computes_the_same_bits():
    lens = [5, 300, 17]
    q, k, v, tables, ln = _case(3, 9, 3, 64, 16, lens, seed=11)
    levels = [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]
    outs = [paged_decode_attention(q, k, v, tables, ln, 0.125, lib=kernels.library(lv)) for lv in levels]
    assert len(outs) >= 2
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_paged_engine_attends_through_the_kernel_and_matches_the_sdpa_path(tiny_llama_dir):
    from kvinfer import LLM, SamplingParams
    from kvinfer.kv.cache import PagedCache

    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 20, block_size=4)
    calls = []
    orig = PagedCache.attend

    def counting(self, *a, **kw):
        calls.append(1)
        return orig(self, *a, **kw)

    PagedCache.attend = counting
    try:
        fast = llm.generate(prompts, params, use_tqdm=False)
    finally:
        PagedCache.attend = orig
    assert calls  # prefill and decode steps took the kernel
    llm.engine.kv_cache.use_kernel = False
    slow = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]


def test_query_tiles_follow_sequences_and_positions():
    """Tiles only join consecutive positions of one sequence: tokens of two sequences interleaved, a repeated
    position and a gap give every row the bits it gets alone."""
    g = torch.Generator().manual_seed(3)
    H, KVH, D, bs = 6, 2, 64, 16
    lens = [270, 40]
    nb = sum(-(-n // bs) for n in lens) + 2
    k, v = torch.randn(nb, bs, KVH, D, generator=g), torch.randn(nb, bs, KVH, D, generator=g)
    tables = torch.tensor([list(range(17)), [17, 18, 19] + [0] * 14])
    seq = torch.tensor([0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0], dtype=torch.long)
    pos = torch.tensor([250, 251, 252, 30, 31, 253, 255, 255, 256, 257, 39, 269], dtype=torch.long)
    q = torch.randn(len(seq), H, D, generator=g)
    kw = dict(num_kv_heads=KVH, block_size=bs, num_blocks=nb, strides=(bs * KVH * D, KVH * D, D), scale=0.125)
    for threads in (1, 2):
        batch = kernels.attention(q, k, v, tables, seq, pos, num_threads=threads, **kw)
        for t in range(len(seq)):
            one = kernels.attention(q[t:t + 1], k, v, tables, seq[t:t + 1], pos[t:t + 1], num_threads=1, **kw)
            assert torch.equal(one[0], batch[t]), (threads, t)
