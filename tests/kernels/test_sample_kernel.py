"""kvq_sample_row, the C draw behind every sampled CPU row and the fused multi-step decode: the distribution it
draws from (temperature, top-k, top-p, min-p) against a float64 reference, by inverse CDF over a grid of uniform
numbers (so exact frequencies, no statistics), masked tokens never drawn, odd rows, and the same token on every
ISA level the machine has."""
from __future__ import annotations

import math

import pytest
import torch

from kvinfer import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C kernels (a C compiler)")


def _levels():
    return [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]


def _reference(logits: torch.Tensor, t: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """Probabilities over the vocabulary in float64 with the kernel's rules (ties in top-p ranked by index)."""
    xf = logits / t  # float32, as the kernel divides
    x = xf.double()
    keep = torch.isfinite(x)
    if 0 < top_k < len(x):
        keep &= xf >= torch.sort(xf, descending=True).values[top_k - 1]
    e = torch.where(keep, torch.exp(x - x[keep].max()), torch.zeros_like(x))
    if min_p > 0:
        e = torch.where(e < min_p * e.max(), torch.zeros_like(e), e)
    if top_p < 1.0:
        order = sorted(range(len(e)), key=lambda i: (-float(e[i]), i))
        before, total = 0.0, float(e.sum())
        for i in order:
            w = float(e[i])
            if before >= top_p * total:
                e[i] = 0.0
            before += w
    return e / e.sum()


def _frequencies(logits, n, **kw):
    lib = kernels.active()
    counts = torch.zeros(len(logits), dtype=torch.float64)
    for j in range(n):
        counts[lib.sample_row(logits, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0),
                              kw.get("min_p", 0.0), (j + 0.5) / n)] += 1
    return counts / n


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.7, top_k=5),
                                dict(temperature=0.9, top_p=0.8), dict(temperature=1.2, min_p=0.05),
                                dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.01)])
def test_draws_follow_the_filtered_softmax(kw):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, generator=g) * 2
    logits[7] = float("-inf")  # a banned token
    n = 4000
    got = _frequencies(logits, n, **kw)
    want = _reference(logits, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    # Inverse CDF over a grid of n points: each token's share is within one grid step of its probability.
    assert (got - want).abs().max() <= 1.0 / n + 1e-6, (got - want).abs().max()
    assert got[want == 0].sum() == 0  # masked tokens never come up
    assert got[7] == 0


@pytest.mark.parametrize("k", [1, 2, 7, 63, 64, 65, 300, 3000])
def test_top_k_keeps_the_k_largest(k):
    # Small k go through a heap, large ones through selection (the switch is at n / 16 = 64 here).
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(1024, generator=g)
    n = 3000
    got = _frequencies(logits, n, temperature=0.6, top_k=k)
    want = _reference(logits, 0.6, top_k=k)
    assert int((want > 0).sum()) == min(k, 1024)
    assert (got - want).abs().max() <= 1.0 / n + 1e-6
    assert got[want == 0].sum() == 0


def test_nucleus_over_a_whole_vocabulary_matches_the_sorted_reference():
    # A 49152-token row spreads over many of the kernel's buckets; the kept set must be exactly the sorted prefix.
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(49152, generator=g) * 4
    for top_p in (0.3, 0.9, 0.99):
        want = _reference(logits, 1.0, top_p=top_p)
        kept = set(torch.nonzero(want).flatten().tolist())
        lib = kernels.active()
        seen = {lib.sample_row(logits, 1.0, 0, top_p, 0.0, (j + 0.5) / 3000) for j in range(3000)}
        assert seen <= kept
        # the largest of the kept tokens come up, and the edges of u give the first and last kept token
        assert lib.sample_row(logits, 1.0, 0, top_p, 0.0, 0.0) == min(kept)
        assert lib.sample_row(logits, 1.0, 0, top_p, 0.0, math.nextafter(1.0, 0.0)) == max(kept)
        top = sorted(kept, key=lambda i: -float(want[i]))[:5]
        assert set(top) <= seen


def test_ties_rank_by_index_and_odd_rows():
    lib = kernels.active()
    flat = torch.zeros(4)
    # Equal mass: the first two tokens hold half of it, so top_p=0.5 keeps exactly them.
    assert {lib.sample_row(flat, 1.0, 0, 0.5, 0.0, u) for u in (0.0, 0.3, 0.6, 0.99)} == {0, 1}
    # top-k keeps ties at the k-th value
    assert {lib.sample_row(torch.tensor([1.0, 2.0, 2.0, 0.0]), 1.0, 1, 1.0, 0.0, u) for u in (0.1, 0.9)} == {1, 2}
    # NaN: numpy's argmax (the NaN); nothing finite: the first index; one finite token: always it
    assert lib.sample_row(torch.tensor([0.0, float("nan"), 5.0]), 1.0, 0, 1.0, 0.0, 0.5) == 1
    assert lib.sample_row(torch.full((5,), float("-inf")), 1.0, 0, 1.0, 0.0, 0.5) == 0
    one = torch.full((9,), float("-inf"))
    one[6] = -3.0
    assert {lib.sample_row(one, 0.3, 0, 0.7, 0.2, u) for u in (0.0, 0.5, 0.999)} == {6}
    # a huge logit gap at a low temperature: the top token only (exp underflows, never overflows)
    assert lib.sample_row(torch.tensor([0.0, 80.0, -50.0]), 0.01, 0, 1.0, 0.0, 0.999) == 1
    with pytest.raises(RuntimeError, match="sampling failed"):
        lib.sample_row(flat, 0.0, 0, 1.0, 0.0, 0.5)  # temperature 0 is the caller's argmax, not a draw


def test_every_level_draws_the_same_token():
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(49152, generator=g) * s for s in (1.0, 3.0)] + [torch.randn(1001, generator=g)]
    params = [(1.0, 0, 1.0, 0.0), (0.7, 40, 0.95, 0.0), (1.3, 0, 0.9, 0.02), (0.5, 0, 1.0, 0.1)]
    us = [0.0, 0.123456789, 0.5, 0.87654321, 0.999999]
    per_level = {}
    for lv in _levels():
        lib = kernels.library(lv)
        per_level[lv] = [lib.sample_row(r, *p, u) for r in rows for p in params for u in us]
    first = next(iter(per_level.values()))
    assert all(v == first for v in per_level.values()), per_level.keys()


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=9, top_p=0.85, min_p=0.03)])
def test_sample_probs_is_the_distribution_the_draw_takes(kw):
    # What speculative rejection sampling compares (filter_probs on the CPU) is what sample_row draws from.
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(64, generator=g) * 2
    lib = kernels.active()
    probs = lib.sample_probs(logits, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0),
                             kw.get("min_p", 0.0))
    n = 5000
    got = _frequencies(logits, n, **kw)
    assert (got - probs.double()).abs().max() <= 1.0 / n + 1e-6
    want = _reference(logits, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    assert torch.equal(probs > 0, want > 0) and (probs.double() - want).abs().max() < 1e-5
    assert abs(float(probs.double().sum()) - 1.0) < 1e-6
    nan = logits.clone()
    nan[5] = float("nan")
    assert lib.sample_probs(nan, 1.0, 0, 1.0, 0.0).tolist() == [1.0 if i == 5 else 0.0 for i in range(64)]


def test_sample_rows_is_masking_then_the_row_kernels():
    # The sampler's one C call for a step's plain rows (grammar masks as bits) gives each row the token that
    # masking it (-inf) and then the argmax or sample_row gives, on 1 and 2 threads.
    g = torch.Generator().manual_seed(4)
    rows, n = 7, 1000
    logits = torch.randn(rows, n, generator=g) * 3
    logits[2, 17] = float("nan")  # a NaN the mask forbids: gone; one it allows (row 3): the argmax rule
    logits[3, 5] = float("nan")
    bits = torch.randint(0, 2, (rows, n), generator=g, dtype=torch.int64)
    bits[2, 17], bits[3, 5] = 0, 1
    bits[4] = 0  # nothing allowed
    bits[5] = 0
    bits[5, 999] = 1  # only the last token
    words = torch.zeros(rows, (n + 31) // 32, dtype=torch.int64)
    for i in range(n):
        words[:, i // 32] |= bits[:, i] << (i % 32)
    allow = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same bits as int32
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 0.0, 1.1], dtype=torch.float32)
    top_k = torch.tensor([0, 0, 50, 0, 0, 0, 3], dtype=torch.int64)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0, 1.0, 0.95], dtype=torch.float32)
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0], dtype=torch.float32)
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    lib = kernels.active()
    want = []
    for r in range(rows):
        row = torch.where(bits[r] == 1, logits[r], torch.tensor(float("-inf")))
        want.append(lib.argmax_rows(row[None])[0] if temp[r] == 0 else
                    lib.sample_row(row, float(temp[r]), int(top_k[r]), float(top_p[r]), float(min_p[r]), float(u[r])))
    for threads in (1, 2):
        assert lib.sample_rows(logits, temp, top_k, top_p, min_p, u, allow, num_threads=threads) == want
    assert want[5] == 999 and want[3] == 5
    # without masks: the rows as they are
    plain = [lib.argmax_rows(logits[r][None])[0] if temp[r] == 0 else
             lib.sample_row(logits[r], float(temp[r]), int(top_k[r]), float(top_p[r]), float(min_p[r]), float(u[r]))
             for r in range(rows)]
    assert lib.sample_rows(logits, temp, top_k, top_p, min_p, u) == plain
