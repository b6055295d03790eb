"""`kvinfer bench prefix-cache`: an agent-like workload (a few long shared prefixes, many short suffixes, over a
restart) with each KV tier on and off, and a long prefix's time to first token after a restart from the disk tier."""
from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvinfer.config import EngineConfig
from kvinfer.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported where an engine is built: `kvinfer --help` builds this parser without torch
    from kvinfer.engine.llm_engine import LLMEngine


def workload(num_prefixes: int, prefix_tokens: int, suffix_tokens: int, rounds: int, vocab: int, seed: int):
    """Rounds of one request per prefix (agents taking turns), each its prefix plus a fresh suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(prefix_tokens)] for _ in range(num_prefixes)]
    return [p + [rng.randrange(100, vocab) for _ in range(suffix_tokens)] for _ in range(rounds) for p in prefixes]


def run_one(engine: LLMEngine, ids: list[int], params: SamplingParams):
    """(tokens, logprobs, TTFT seconds, prompt tokens served from a cache) of one request run alone."""
    t0 = time.perf_counter()
    rid = engine.add_request(None, ids, params)
    ttft, out = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                out = o
                if ttft is None and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
    s = out.outputs[0]
    return list(s.token_ids), [lp.logprob for lp in s.logprobs or ()], ttft, out.num_cached_tokens


def run_phase(config: EngineConfig, loaded, reqs, params) -> dict:
    from kvinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(config, loaded=loaded)
    t0 = time.perf_counter()
    results, ttfts, cached = [], [], 0
    for ids in reqs:
        toks, lps, ttft, c = run_one(engine, ids, params)
        results.append((toks, lps))
        ttfts.append(ttft)
        cached += c
    wall = time.perf_counter() - t0
    tiers = engine.kv_tiers.counters() if engine.kv_tiers is not None else {}
    engine.close()
    prompt = sum(len(r) for r in reqs)
    return dict(seconds=wall, requests_per_s=len(reqs) / wall, mean_ttft_s=sum(ttfts) / len(ttfts),
                prompt_tokens=prompt, cached_tokens=cached, results=results, tiers=tiers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path):
    """(url, process) of a private redis-server on a free loopback port, or (None, None) without one."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None
    try:
        import redis
    except ImportError:
        return None, None
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return f"redis://127.0.0.1:{port}/0", proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def cmd_prefix_cache(args) -> int:
    from kvinfer.cli import engine_config_from_args
    from kvinfer.engine.llm_engine import LLMEngine

    if args.two_servers:
        from kvinfer.bench.shared_redis import cmd_two_servers

        return cmd_two_servers(args)
    base = engine_config_from_args(args)
    probe = LLMEngine(base.replace(kv_cache_memory=1 << 20, kv_offload_memory=None, kv_cache_dir=None,
                                   kv_cache_dir_size=None, kv_cache_redis=None))
    loaded, bpt = probe.loaded, probe.kv_bytes_per_token
    vocab = probe.model_config.vocab_size
    probe.close()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    reqs = workload(args.prefixes, args.prefix_tokens, args.suffix_tokens, args.rounds, vocab, args.workload_seed)
    after = workload(args.prefixes, args.prefix_tokens, args.suffix_tokens, args.rounds, vocab,
                     args.workload_seed)  # same prefixes; the suffixes repeat too, so outputs compare across runs
    longest = args.prefix_tokens + args.suffix_tokens + args.max_tokens
    # A quarter of the distinct prefixes, plus room for the request being served.
    budget = base.kv_cache_memory or bpt * (args.prefixes * args.prefix_tokens // 4 + longest + 4 * base.block_size)
    work = Path(tempfile.mkdtemp(prefix="kvinfer-prefix-cache-"))
    redis_url, redis_proc = (args.redis, None) if args.redis else start_redis(work)
    cfgs = {"pool only": {}, "ram": dict(kv_offload_memory=bpt * args.prefixes * longest * 2),
            "disk": dict(kv_cache_dir=str(work / "disk"))}
    if redis_url:
        cfgs["redis"] = dict(kv_cache_redis=redis_url)
    rows, ref, exact = [], None, True
    try:
        for name, kw in cfgs.items():
            cfg = base.replace(kv_cache_memory=budget, **kw)
            first = run_phase(cfg, loaded, reqs, params)
            second = run_phase(cfg, loaded, after, params)  # a restart: a new engine, its pool empty
            for ph in (first, second):
                ref = ref or ph["results"]
                exact &= ph.pop("results") == ref
            rows.append((name, first, second))
        ttft = None
        if args.long_prefix:
            ttft = long_prefix_ttft(base, loaded, bpt, vocab, args.long_prefix, work / "long", params)
            exact &= ttft.pop("same_output")
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    report = dict(model=str(loaded.source.path), kv_budget_bytes=budget, prefixes=args.prefixes,
                  prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens, rounds=args.rounds,
                  runs={n: {"before_restart": a, "after_restart": b} for n, a, b in rows}, long_prefix=ttft,
                  bitwise_identical=exact)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0 if exact else 1
    pool = rows[0][1]["requests_per_s"]
    print(f"{args.prefixes} prefixes of {args.prefix_tokens} tokens, {args.rounds} rounds of one request each "
          f"(+{args.suffix_tokens} tokens, {args.max_tokens} out), KV budget {budget} bytes (a quarter of the "
          f"prefixes), then a restart")
    print(f"{'tiers':<10} {'req/s':>7} {'x pool':>7} {'TTFT ms':>8} {'cached %':>9} | after restart: "
          f"{'req/s':>7} {'TTFT ms':>8} {'cached %':>9}  tier hits")
    for name, a, b in rows:
        hits = {t: c["hits"] for t, c in b["tiers"].items()}
        print(f"{name:<10} {a['requests_per_s']:7.2f} {a['requests_per_s'] / pool:7.2f} {a['mean_ttft_s'] * 1e3:8.1f} "
              f"{100 * a['cached_tokens'] / a['prompt_tokens']:9.1f} | {'':>15}{b['requests_per_s']:7.2f} "
              f"{b['mean_ttft_s'] * 1e3:8.1f} {100 * b['cached_tokens'] / b['prompt_tokens']:9.1f}  {hits}")
    if ttft:
        print(f"{ttft['tokens']}-token prompt: TTFT cold {ttft['cold_ttft_s'] * 1e3:.1f} ms, after a restart from "
              f"the disk tier {ttft['disk_ttft_s'] * 1e3:.1f} ms ({ttft['ratio']:.3f} of cold, "
              f"{ttft['cached_tokens']} tokens restored)")
    print("outputs (tokens and logprobs) bitwise identical across every run: " + ("yes" if exact else "NO"))
    return 0 if exact else 1


def long_prefix_ttft(base, loaded, bpt, vocab, tokens, directory, params) -> dict:
    """A long prompt's TTFT computed cold, and by a new engine (a restart) from the disk tier."""
    rng = random.Random(7)
    ids = [rng.randrange(100, vocab) for _ in range(tokens)]
    budget = bpt * (tokens + 256)
    cold = run_phase(base.replace(kv_cache_memory=budget), loaded, [ids], params)
    run_phase(base.replace(kv_cache_memory=budget, kv_cache_dir=str(directory)), loaded, [ids], params)
    warm = run_phase(base.replace(kv_cache_memory=budget, kv_cache_dir=str(directory)), loaded, [ids], params)
    return dict(tokens=tokens, cold_ttft_s=cold["mean_ttft_s"], disk_ttft_s=warm["mean_ttft_s"],
                ratio=warm["mean_ttft_s"] / cold["mean_ttft_s"], cached_tokens=warm["cached_tokens"],
                same_output=cold["results"] == warm["results"])


def register_prefix_cache(bs) -> None:
    from kvinfer.cli import add_engine_args, int_at_least, seed_int

    p = bs.add_parser("prefix-cache", help="agent-like shared-prefix workload over a restart, each KV tier on/off",
                      description="A few long shared prefixes, many short suffixes, requests one at a time in "
                                  "rounds over the prefixes, with a KV budget holding a quarter of them; run with "
                                  "the pool alone, then with the RAM, disk and Redis tiers (a private redis-server "
                                  "if one is installed), each before and after a restart (a new engine). Outputs "
                                  "are compared bitwise across every run.")
    p.add_argument("--prefixes", type=int_at_least("--prefixes"), default=8, help="distinct prefixes (default 8)")
    p.add_argument("--prefix-tokens", type=int_at_least("--prefix-tokens"), default=512,
                   help="tokens per prefix (default 512)")
    p.add_argument("--suffix-tokens", type=int_at_least("--suffix-tokens"), default=16,
                   help="tokens after the prefix (default 16)")
    p.add_argument("--rounds", type=int_at_least("--rounds"), default=3, help="requests per prefix (default 3)")
    p.add_argument("--max-tokens", type=int_at_least("--max-tokens"), default=4, help="tokens out (default 4)")
    p.add_argument("--long-prefix", type=int_at_least("--long-prefix", 0), default=4000,
                   help="also a prompt of this many tokens: TTFT cold vs after a restart from the disk tier "
                        "(default 4000; 0: skip)")
    p.add_argument("--two-servers", action="store_true",
                   help="instead: two `kvinfer serve` processes on one Redis; the first computes a --long-prefix "
                        "prompt, then the second's first request on it: cached tokens and TTFT of each")
    p.add_argument("--redis", default=None, metavar="URL", help="use this Redis server instead of starting one")
    p.add_argument("--workload-seed", type=seed_int("--workload-seed"), default=0, help="workload seed (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_engine_args(p)
    p.set_defaults(func=cmd_prefix_cache)

