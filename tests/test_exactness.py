"""The exactness contract, as a property: a request's tokens and logprobs are bitwise the same however it is served
(batch composition, arrival order and time, chunked-prefill budget, prefix-cache hits, preemption and recompute,
KV backend, block size), for the built-in model and a tiny model of every family."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvinfer import SamplingParams, kernels
from kvinfer.config import EngineConfig
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.engine.startup import resolve_kv_cache_dtype
from kvinfer.loaders.model_loader import load_model
from tests.conftest import save_tiny_llama
from tests.reference_helpers import save_tiny
from tests.test_families import FAMS

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the exact path needs the CPU kernels")

MAX_LEN = 96


def _requests(vocab: int, lo: int) -> list[tuple[list[int], SamplingParams]]:
    """Six requests: shared prefixes (prefix-cache hits), lengths 3-41, greedy and seeded sampling, logprobs,
    prompt logprobs for two of them (one of which shares its prefix with others) and allowed_token_ids for two."""
    g = torch.Generator().manual_seed(5)
    stem = torch.randint(lo, vocab, (24,), generator=g).tolist()
    prompts = [stem[:20] + [lo + 1, lo + 2], stem[:20] + [lo + 3], stem + stem[:17],
               torch.randint(lo, vocab, (3,), generator=g).tolist(), stem[:9],
               torch.randint(lo, vocab, (30,), generator=g).tolist()]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 2:
            p = SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=10, ignore_eos=True, logprobs=2)
        else:
            p = SamplingParams(temperature=0, max_tokens=8 + 2 * i, ignore_eos=True, logprobs=2)
        if i in (0, 2):
            p = SamplingParams(**{**p.__dict__, "prompt_logprobs": 2 - i})
        if i in (1, 5):  # a mask on the logits (greedy and sampled): the same tokens however served
            p = SamplingParams(**{**p.__dict__, "allowed_token_ids": list(range(lo, vocab, 2 + i % 3))})
        params.append(p)
    return list(zip(prompts, params))


def _serve(loaded, path, reqs, *, kv_cache="paged", block_size=16, kv_tokens=None, budget=2048, prefix=True,
           arrivals=None, order=None):
    """Run the requests through one engine; arrivals[i] is the step before which request i joins. Returns
    ({index: (token ids, logprobs)}, preemptions)."""
    kv_dtype = resolve_kv_cache_dtype(EngineConfig(model=path, dtype="float32", device="cpu"), loaded).kv_cache_dtype
    kv_per_token = loaded.config.kv_bytes_per_token(2 if kv_dtype == "bfloat16" else 4)
    if kv_tokens is None:
        mem = kv_per_token * MAX_LEN * 8
    elif kv_cache == "contiguous":
        mem = kv_per_token * MAX_LEN * max(1, kv_tokens // MAX_LEN)
    else:
        mem = kv_per_token * kv_tokens
    cfg = EngineConfig(model=path, dtype="float32", device="cpu", kv_cache=kv_cache, block_size=block_size,
                       kv_cache_memory=mem, max_model_len=MAX_LEN, max_num_batched_tokens=budget,
                       enable_prefix_caching=prefix)
    eng = LLMEngine(cfg, loaded)
    order = list(range(len(reqs))) if order is None else order
    arrivals = arrivals or [0] * len(reqs)
    pending = sorted(order, key=lambda i: arrivals[i])  # stable: ties keep the given order
    done, step = {}, 0
    while pending or eng.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            eng.add_request(str(i), reqs[i][0], reqs[i][1])
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                pl = out.prompt_logprobs
                done[int(out.request_id)] = (list(c.token_ids), [lp.logprob for lp in c.logprobs],
                                             [lp.top for lp in c.logprobs],
                                             None if pl is None else [lp and (lp.token_id, lp.logprob, lp.top)
                                                                      for lp in pl])
        step += 1
    return done, eng.scheduler.num_preemptions


ways = st.fixed_dictionaries({
    "kv_cache": st.sampled_from(["paged", "paged", "contiguous", "none"]),
    "block_size": st.sampled_from([1, 4, 16, 32]),
    "kv_tokens": st.sampled_from([None, 72, 160]),  # small budgets preempt
    "budget": st.sampled_from([2048, 64, 16, 7]),  # chunked prefill
    "prefix": st.booleans(),
    "arrivals": st.lists(st.integers(0, 12), min_size=6, max_size=6),
    "order": st.permutations(range(6)),
})


def _check(loaded, path, reqs, alone, way):
    got, _ = _serve(loaded, path, reqs, **way)
    for i, want in alone.items():
        assert got[i][0] == want[0], (i, way)  # tokens
        assert got[i][1] == want[1], (i, way)  # logprobs, bitwise
        assert got[i][2] == want[2], (i, way)  # top alternatives and their logprobs
        assert got[i][3] == want[3], (i, way)  # prompt logprobs


def _alone(loaded, path, reqs):
    return {i: _serve(loaded, path, [r])[0][0] for i, r in enumerate(reqs)}


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


def _family_model(name, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"exact_{name}")
    if name == "llama":
        save_tiny_llama(path, max_position_embeddings=MAX_LEN)
    else:
        fam = FAMS[name]
        save_tiny(fam.config_cls, fam.model_cls, path, seed=1, **fam.init, **fam.config)
    return str(path), load_model(EngineConfig(model=str(path), dtype="float32", device="cpu"))


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gpt2", "bloom"])
def test_every_family_is_exact_however_served(name, tmp_path_factory):
    path, loaded = _family_model(name, tmp_path_factory)
    reqs = _requests(loaded.config.vocab_size, 3)
    alone = _alone(loaded, path, reqs)

    @settings(max_examples=6, **_SETTINGS)
    @given(way=ways)
    def prop(way):
        _check(loaded, path, reqs, alone, way)

    prop()


def test_builtin_model_is_exact_however_served(builtin_llm):
    loaded = builtin_llm.engine.loaded
    reqs = _requests(49152, 1000)
    alone = _alone(loaded, None, reqs)

    @settings(max_examples=5, **_SETTINGS)
    @given(way=ways)
    def prop(way):
        _check(loaded, None, reqs, alone, way)

    prop()


def test_the_property_really_preempts_and_chunks(builtin_llm):
    # Guard against a vacuous pass: the small budget does preempt, and the results still match alone.
    loaded = builtin_llm.engine.loaded
    reqs = _requests(49152, 1000)
    alone = _alone(loaded, None, reqs)
    got, preemptions = _serve(loaded, None, reqs, kv_tokens=72, block_size=4, budget=16)
    assert preemptions > 0
    assert all(got[i] == alone[i] for i in alone)
    # and the prompt logprobs are really there: none for the first prompt token, one per later token
    for i, (prompt, p) in enumerate(reqs):
        pl = alone[i][3]
        assert (pl is None) == (p.prompt_logprobs is None)
        if pl is not None:
            assert pl[0] is None and len(pl) == len(prompt)
            assert [t for t, _, _ in pl[1:]] == prompt[1:] and all(len(top) == p.prompt_logprobs for *_, top in pl[1:])


def test_thread_count_does_not_change_a_bit(builtin_llm):
    loaded = builtin_llm.engine.loaded
    reqs = _requests(49152, 1000)[:3]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _serve(loaded, None, reqs)
        torch.set_num_threads(2)
        two, _ = _serve(loaded, None, reqs)
    finally:
        torch.set_num_threads(n)
    assert one == two


def test_every_isa_level_gives_the_same_bits_end_to_end(tiny_llama_dir):
    # The portable level and the vector levels perform the same IEEE operations lane for lane: a whole
    # generation (prefill, decode, sampling with a seed) matches bit for bit.
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from kvinfer import LLM, SamplingParams, kernels\n"
        f"llm = LLM({tiny_llama_dir!r}, dtype='float32', kv_cache_memory=1 << 20, block_size=4)\n"
        "ps = [[5, 9, 13, 2, 77, 31, 8], [100, 101, 102]]\n"
        "sp = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),\n"
        "      SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)]\n"
        "outs = llm.generate(ps, sp, use_tqdm=False)\n"
        "print(json.dumps([kernels.level(), [[list(o.outputs[0].token_ids),\n"
        "      [lp.logprob.hex() for lp in o.outputs[0].logprobs]] for o in outs]]))\n")
    runs = {}
    levels = [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]
    for lv in levels:
        env = dict(os.environ, KVINFER_ISA=lv)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        level, result = json.loads(out.stdout.strip().splitlines()[-1])
        assert level == lv
        runs[lv] = result
    assert len(runs) >= 2
    first = runs[levels[0]]
    for lv in levels[1:]:
        assert runs[lv] == first, lv


def test_a_cpu_dtype_without_the_guarantee_says_so(tiny_llama_dir, caplog):
    # bfloat16 on the CPU runs eager PyTorch (oneDNN's blocking follows the batch shape): the engine warns at start-up
    # that outputs may depend on batching; float32, the CPU default, does not warn.
    import logging

    with caplog.at_level(logging.WARNING, logger="kvinfer"):
        LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="bfloat16", device="cpu"))
    assert any("bfloat16 on the CPU" in r.getMessage() and "batched" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvinfer"):
        LLMEngine(EngineConfig(model=tiny_llama_dir, device="cpu"))
    assert not [r for r in caplog.records if "eager PyTorch path" in r.getMessage()]
