"""`kvinfer bench kv-attention`: decode attention over a long context, float32 vs int8, fp8 and bfloat16 caches, same
run."""
from __future__ import annotations

import json
import statistics
import time

from kvinfer.bench import machine, machine_line

# The built-in model's attention shapes (SmolLM2-135M: 9 query heads sharing 3 KV heads of 64 values).
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPES = ("float32", "int8", "fp8", "bfloat16")


def register_kv_attention(bs) -> None:
    from kvinfer.cli import int_at_least

    p = bs.add_parser("kv-attention", help="decode attention per KV cache dtype (float32, int8, fp8, bfloat16)",
                      description="One decode query over --context positions of a paged cache (the built-in "
                                  "model's shapes: 9 heads, 3 KV heads, head dim 64, block 16, shuffled blocks), "
                                  "through the attention kernel with a float32, an int8, an fp8 and a bfloat16 "
                                  "pool holding the same keys and values; the dtypes take turns within each round, and each "
                                  "reports its best round (us per call) and its speed relative to float32.")
    p.add_argument("--context", type=int_at_least("--context", 16, 1 << 20), default=4096,
                   help="positions attended to, 16 to 1048576 (default 4096)")
    p.add_argument("--calls", type=int_at_least("--calls", 1, 100000), default=30,
                   help="calls timed per dtype and round (default 30)")
    p.add_argument("--rounds", type=int_at_least("--rounds", 1, 1000), default=5, help="rounds (default 5)")
    p.add_argument("--threads", type=int_at_least("--threads", 1, 1024), default=None,
                   help="kernel threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_kv_attention)


def measure(context: int, calls: int, rounds: int, threads: int | None = None, seed: int = 0) -> dict:
    """us per call of each dtype (best round), the ratio to float32's, and the median of per-round ratios."""
    import torch

    from kvinfer import kernels

    lib = kernels.active()
    g = torch.Generator().manual_seed(seed)
    nb = -(-context // BLOCK)
    shape = (nb, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(nb * BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(nb * BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=g)
    tables = torch.randperm(nb, generator=g).view(1, -1).contiguous()
    tok_seq, tok_pos = torch.tensor([0]), torch.tensor([context - 1])
    kw = dict(num_kv_heads=KV_HEADS, block_size=BLOCK, num_blocks=nb, scale=HEAD_DIM ** -0.5,
              strides=(BLOCK * KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HEAD_DIM), num_threads=threads)
    args = {"float32": dict(k=k.view(shape), v=v.view(shape))}
    for dt in DTYPES[1:]:
        pool = {}
        for name, x in (("k", k), ("v", v)):
            codes = torch.zeros(nb * BLOCK, KV_HEADS, HEAD_DIM, dtype=kernels.KV_STORAGE[dt])
            scales = torch.zeros(nb * BLOCK, KV_HEADS, HEAD_DIM // 32) if dt in kernels.KV_SCALED else None
            lib.kv_store(x, codes, scales, torch.arange(nb * BLOCK) * KV_HEADS * HEAD_DIM, HEAD_DIM, dt)
            pool[name] = codes.view(shape)
            if scales is not None:
                pool[f"{name}_scale"] = scales.view(*shape[:-1], -1)
        args[dt] = dict(kv_dtype=dt, **pool)
    outs = {}

    def call(dt):
        a = dict(args[dt])
        return lib.attention(q, a.pop("k"), a.pop("v"), tables, tok_seq, tok_pos, **kw, **a)

    times = {dt: [] for dt in DTYPES}
    for dt in DTYPES:
        outs[dt] = call(dt)  # warm-up (and the outputs compared below)
    for r in range(rounds):
        turn = r % len(DTYPES)
        for dt in DTYPES[turn:] + DTYPES[:turn]:  # take turns, so a burst of load hits every dtype alike
            t0 = time.perf_counter()
            for _ in range(calls):
                call(dt)
            times[dt].append((time.perf_counter() - t0) / calls)
    ref = outs["float32"]
    rows = []
    for dt in DTYPES:
        best = min(times[dt])
        rows.append(dict(kv_dtype=dt, us_per_call=best * 1e6, speed_vs_float32=min(times["float32"]) / best,
                         median_round_ratio=statistics.median(f / t for f, t in zip(times["float32"], times[dt])),
                         max_abs_diff_vs_float32=float((outs[dt] - ref).abs().max()),
                         kv_bytes_per_position={"float32": 4, "bfloat16": 2}.get(dt, 1 + 4 / 32)
                         * 2 * KV_HEADS * HEAD_DIM))
    return dict(context=context, calls=calls, rounds=rounds, threads=threads or torch.get_num_threads(),
                level=kernels.level(), rows=rows)


def cmd_kv_attention(args) -> int:
    from kvinfer import kernels

    if not kernels.available():
        raise RuntimeError(f"the attention kernel is unavailable: {kernels.unavailable_reason()}")
    res = measure(args.context, args.calls, args.rounds, args.threads)
    res["machine"] = machine()
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"kvinfer bench kv-attention: one decode query over {res['context']} positions, {HEADS} heads / "
          f"{KV_HEADS} KV heads x {HEAD_DIM}, {res['threads']} threads, kernels {res['level']}, best of "
          f"{res['rounds']} rounds x {res['calls']} calls")
    print(machine_line())
    print(f"{'KV dtype':<10}{'us/call':>10}{'vs float32':>12}{'median round':>14}{'bytes/position':>16}"
          f"{'max |out diff|':>16}")
    for r in res["rows"]:
        print(f"{r['kv_dtype']:<10}{r['us_per_call']:>10.1f}{r['speed_vs_float32']:>11.2f}x"
              f"{r['median_round_ratio']:>13.2f}x{r['kv_bytes_per_position']:>16.0f}{r['max_abs_diff_vs_float32']:>16.4f}")
    return 0
