"""`kvinfer bench exact`: serve the same requests many ways and count how many come out bitwise identical."""
from __future__ import annotations

import random
import time

from kvinfer.bench import machine_line

WAYS = ("batch of 24", "shuffled order", "chunked prefill (64-token budget)", "after a prefix-cache hit",
        "small KV budget (preemption)", "contiguous backend", "none backend", "one decode step per call",
        "after a restart, from the disk tier")


def register_exact(bs) -> None:
    from kvinfer.cli import add_engine_args, int_at_least

    e = bs.add_parser("exact", help="the same requests served 9 ways: how many are bitwise identical to alone",
                      description="Each prompt is generated alone, then again inside a batch of 24, in shuffled "
                                  "order, with a 64-token chunked-prefill budget, after a prefix-cache hit, under a "
                                  "KV budget small enough to preempt, with the contiguous and with the none "
                                  "backend, with one decode step per C call (--num-scheduler-steps 1), and by a "
                                  "new engine from the disk tier (--kv-cache-dir) an earlier one filled. "
                                  "Prints, per way, how many requests gave bitwise the same token ids and logprobs "
                                  "as alone, and how many the same tokens.")
    e.add_argument("--prompts", type=int_at_least("--prompts", 2), default=12, help="requests (default 12)")
    e.add_argument("--tokens", type=int_at_least("--tokens"), default=32, help="new tokens each (default 32)")
    e.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); above 0 every request samples with its own seed")
    add_engine_args(e)
    e.set_defaults(func=cmd_exact)


def _after_restart(llm, prompts, batch):
    """The prompts' KV written to a disk tier by one engine, then restored by a new one (a restart)."""
    import shutil
    import tempfile

    from kvinfer.sampling_params import SamplingParams

    directory = tempfile.mkdtemp(prefix="kvinfer-exact-")
    try:
        first = llm(kv_cache_dir=directory)
        first.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        first.engine.close()
        second = llm(kv_cache_dir=directory)
        got = batch(second)
        return got, second.engine.kv_tiers.counters()["disk"]["hits"]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def cmd_exact(args) -> int:
    from kvinfer.cli import engine_config_from_args
    from kvinfer.engine.llm import LLM
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.loaders.model_loader import load_model
    from kvinfer.sampling_params import SamplingParams

    base = engine_config_from_args(args)
    loaded = load_model(base)
    vocab = loaded.config.vocab_size
    rng = random.Random(0)
    lo = min(1000, vocab // 4)
    prompts = [[rng.randrange(lo, vocab) for _ in range(rng.randrange(20, 200))] for _ in range(args.prompts)]
    others = [[rng.randrange(lo, vocab) for _ in range(rng.randrange(20, 200))] for _ in range(24 - args.prompts)]
    params = [SamplingParams(temperature=args.temperature, seed=1000 + i, max_tokens=args.tokens, ignore_eos=True,
                             logprobs=0) for i in range(args.prompts)]
    kv_per_token = None

    def llm(**kw):
        nonlocal kv_per_token
        obj = LLM.__new__(LLM)
        obj.engine = LLMEngine(base.replace(**kw), loaded=loaded)
        kv_per_token = obj.engine.kv_bytes_per_token
        return obj

    def key(out):
        c = out.outputs[0]
        return list(c.token_ids), [lp.logprob for lp in c.logprobs]

    t0 = time.perf_counter()
    ref_llm = llm()
    alone = [key(ref_llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
    filler = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    results = {}

    def batch(obj, order=None):
        idx = list(range(len(prompts))) if order is None else order
        outs = obj.generate([prompts[i] for i in idx] + others, [params[i] for i in idx] + [filler] * len(others),
                            use_tqdm=False)
        got = [None] * len(prompts)
        for j, i in enumerate(idx):
            got[i] = key(outs[j])
        return got

    longest = max(len(p) for p in prompts + others) + args.tokens
    results[WAYS[0]] = batch(llm())
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    results[WAYS[1]] = batch(llm(), order)
    results[WAYS[2]] = batch(llm(max_num_batched_tokens=64))
    warm = llm()
    warm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # fill the prefix cache
    results[WAYS[3]] = batch(warm)
    small = llm(kv_cache_memory=kv_per_token * longest * 3, block_size=16)
    results[WAYS[4]] = batch(small)
    preempted = small.engine.scheduler.num_preemptions
    results[WAYS[5]] = batch(llm(kv_cache="contiguous", max_num_seqs=8, max_model_len=longest + 16,
                                 kv_cache_memory=kv_per_token * (longest + 16) * 8))
    results[WAYS[6]] = batch(llm(kv_cache="none"))
    results[WAYS[7]] = batch(llm(num_scheduler_steps=1))
    results[WAYS[8]], restored = _after_restart(llm, prompts, batch)
    n = len(prompts)
    print(f"kvinfer bench exact: {n} requests x {args.tokens} tokens "
          f"({'greedy' if args.temperature == 0 else f'sampled at T={args.temperature}, seeded'}), "
          f"each compared with itself served alone; {time.perf_counter() - t0:.0f} s")
    print(machine_line())
    print(f"{'way of serving':<36}{'bitwise identical':>18}{'same tokens':>13}")
    total = same_total = 0
    for way in WAYS:
        got = results[way]
        bit = sum(g == a for g, a in zip(got, alone))
        tok = sum(g[0] == a[0] for g, a in zip(got, alone))
        total, same_total = total + bit, same_total + tok
        note = f"  ({preempted} preemptions)" if way == WAYS[4] else ""
        note = f"  ({restored} blocks restored)" if way == WAYS[8] else note
        print(f"{way:<36}{f'{bit}/{n}':>18}{f'{tok}/{n}':>13}{note}")
    print(f"{'all':<36}{f'{total}/{n * len(WAYS)}':>18}{f'{same_total}/{n * len(WAYS)}':>13}")
    return 0
