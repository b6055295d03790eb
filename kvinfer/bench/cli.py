"""`kvinfer bench decode|throughput|serve`: ours against peers measured in the same run, with ratios."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kvinfer.bench import machine, machine_line
from kvinfer.options import override


NO_INVARIANCE = "kvinfer, KVINFER_BATCH_INVARIANT=0"


def _peers(*known: str):
    """An argparse type for --compare: comma-separated names among `known` (and none)."""
    choices = ", ".join(known + ("none",))

    def parse(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        bad = [n for n in names if n not in known + ("none",)]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown peer {bad[0] if bad else text!r}; choose from {choices}")
        return [n for n in names if n != "none"]

    parse.__name__ = "--compare"
    return parse


def _invariance_off():
    """The same build with batch invariance given up (BLAS and SDPA for prefill-sized steps): its cost."""
    return override(batch_invariant=False)


def register(sub) -> None:
    from kvinfer.cli import add_engine_args, int_at_least, seed_int

    b = sub.add_parser("bench", help="benchmarks against peers measured in the same run",
                       description="Benchmarks that print kvinfer against peers measured in the same run.")
    bs = b.add_subparsers(dest="bench_command", metavar="BENCH")
    b.set_defaults(func=lambda a: (b.print_help(), 2)[1])

    d = bs.add_parser("decode", help="TTFT, prefill and single-stream greedy decode tokens/s",
                      description="Time to first token, prefill tokens/s (prompt tokens / TTFT) and single-stream "
                                  "greedy decode tokens/s for --tokens new tokens, for kvinfer and each --compare "
                                  "peer on the same weights and dtype. Use --prompt-tokens 512 to compare prefill.")
    d.add_argument("--tokens", type=int_at_least("--tokens", 2), default=256,
                   help="new tokens, at least 2 (default 256)")
    d.add_argument("--prompt-tokens", type=int_at_least("--prompt-tokens"), default=32,
                   help="prompt length in tokens (default 32)")
    d.add_argument("--compare", type=_peers("transformers", "llama.cpp", "no-invariance"), default=None,
                   help="comma-separated peers: transformers, llama.cpp (llama-bench when --llama-bench or "
                        "$LLAMA_BENCH names it, else llama-cpp-python), no-invariance (kvinfer itself with "
                        "KVINFER_BATCH_INVARIANT=0), none (default: transformers and llama.cpp, those installed)")
    d.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="llama.cpp's llama-bench binary for --compare llama.cpp (default $LLAMA_BENCH)")
    d.add_argument("--rounds", type=int_at_least("--rounds"), default=1,
                   help="measure kvinfer and every peer this many times, taking turns, and report the medians "
                        "with every round's ratios (default 1; on a shared machine, whose runs vary by 10-20%%, "
                        "use 3-5)")
    d.add_argument("--no-roofline", action="store_true",
                   help="skip the memory roofline line (for a GGUF file: weight bytes read per token against the "
                        "read bandwidth measured here, and each engine's decode as a share of that bound)")
    d.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_engine_args(d)
    d.set_defaults(func=cmd_decode)

    t = bs.add_parser("throughput", help="offline throughput on a seeded 64-request workload",
                      description="64 requests (prompt 16-512, output 16-256 tokens, seeded, ignore_eos, greedy) "
                                  "through the engine, then the same workload through each --compare peer.")
    t.add_argument("--num-requests", type=int_at_least("--num-requests"), default=64,
                   help="requests in the workload (default 64)")
    t.add_argument("--workload-seed", type=seed_int("--workload-seed"), default=0, help="workload seed (default 0)")
    t.add_argument("--compare", type=_peers("transformers", "llama.cpp", "llama-server", "no-invariance", "kv-int8",
                                            "kv-fp8", "kv-bfloat16", "kv-float32"),
                   default=None,
                   help="comma-separated peers: transformers, llama.cpp (llama-cpp-python, one sequence at a "
                        "time), llama-server (llama.cpp's HTTP server, parallel slots), no-invariance (kvinfer "
                        "itself with KVINFER_BATCH_INVARIANT=0), kv-int8 / kv-fp8 / kv-bfloat16 / kv-float32 "
                        "(kvinfer itself with that --kv-cache-dtype at the same --kv-cache-memory), "
                        "none (default: transformers and llama.cpp, those installed)")
    t.add_argument("--llama-server", metavar="PATH", default=None,
                   help="llama.cpp server binary for --compare llama-server (default $LLAMA_SERVER, else "
                        "llama-server on PATH)")
    t.add_argument("--llama-server-slots", type=int_at_least("--llama-server-slots"), default=16,
                   help="its parallel sequences, -np (default 16)")
    t.add_argument("--hf-batch-size", type=int_at_least("--hf-batch-size"), default=16, help="transformers static batch size (default 16)")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_engine_args(t)
    t.set_defaults(func=cmd_throughput)

    from kvinfer.bench.exact import register_exact
    from kvinfer.bench.structured import register_structured

    register_exact(bs)
    from kvinfer.bench.kv_attention import register_kv_attention

    register_kv_attention(bs)
    from kvinfer.bench.spec import register_spec

    register_spec(bs)
    register_structured(bs)
    from kvinfer.bench.prefix_cache import register_prefix_cache

    register_prefix_cache(bs)
    try:
        from kvinfer.bench.serve import register_serve
    except ImportError:
        return
    register_serve(bs)


def _model_label(engine) -> str:
    src = engine.loaded.source
    name = src.path.name if src.path is not None else str(engine.config.model)
    return f"{name} ({src.kind}), {str(engine.loaded.dtype).replace('torch.', '')}"


def _bits_note(engine) -> str:
    """", 8-bit activations" in a header when the engine runs at --activation-bits 8 (nothing at the default)."""
    return ", 8-bit activations" if getattr(engine.config, "activation_bits", 16) == 8 else ""


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _tp_comm(engine, wall_s: float):
    """Rank 0's collective time per step and its share of the step, over the measured run (None without TP)."""
    tp = engine.tp
    if tp is None or not tp.stats.steps:
        return None
    s = tp.stats
    return dict(tp=tp.size, steps=s.steps, step_ms=wall_s / s.steps * 1e3, collective=s.collective,
                allreduce_ms=s.allreduce_s / s.steps * 1e3, allreduce_calls=s.allreduce_calls / s.steps,
                allreduce_bytes=s.allreduce_bytes / s.steps, allreduce_share=s.allreduce_s / wall_s,
                head_ms=s.head_s / s.steps * 1e3, head_share=s.head_s / wall_s,
                broadcast_ms=s.broadcast_s / s.steps * 1e3, broadcast_share=s.broadcast_s / wall_s)


# A collective between GPUs of one node over NVLink with NCCL: ~10 us for the few KiB of a decode step.
NVLINK_LATENCY_S = 10e-6


def _print_tp(c) -> None:
    if not c:
        return
    print(f"  tensor parallel {c['tp']}: {c.get('collective', 'all-reduce')} {c['allreduce_ms']:.2f} ms per step "
          f"({c['allreduce_calls']:.0f} calls, {c['allreduce_bytes'] / 1024:.1f} KiB) of {c['step_ms']:.2f} ms "
          f"= {c['allreduce_share'] * 100:.1f}% of the step; logits gather {c.get('head_ms', 0.0):.2f} ms "
          f"({c.get('head_share', 0.0) * 100:.1f}%); plan broadcast {c['broadcast_ms']:.2f} ms "
          f"({c['broadcast_share'] * 100:.1f}%); {c['steps']} steps")
    # The rest of the step is the ranks' compute (here: N ranks taking turns on the machine's cores). With a core
    # set or a GPU per rank that compute runs side by side, and the collectives cost what the link costs.
    calls = c["allreduce_calls"] + 2  # + the logits gather and the plan broadcast
    comm_ms = c["allreduce_ms"] + c.get("head_ms", 0.0) + c["broadcast_ms"]
    compute_ms = max(c["step_ms"] - comm_ms, 0.0)
    link_ms = calls * NVLINK_LATENCY_S * 1e3
    print(f"  outlook: {comm_ms / c['step_ms'] * 100:.1f}% of this step is communication ({calls:.0f} collectives, "
          f"{comm_ms / calls:.2f} ms each); the same step over a {NVLINK_LATENCY_S * 1e6:.0f} us link "
          f"(NCCL, NVLink) would spend {link_ms:.2f} ms in them: {compute_ms + link_ms:.2f} ms instead of "
          f"{c['step_ms']:.2f} ms, and less again where each rank has its own cores or GPU")


def _default_peers(args, path, llama_bench_ok: bool = True) -> list[str]:
    """--compare as given; without it, the optional peers (transformers, llama.cpp) that are installed here, naming
    the missing ones and how to get them (a missing optional peer never fails the run)."""
    if args.compare is not None:
        return args.compare
    from kvinfer.bench.peers import pick_peers

    present, missing = pick_peers(["transformers", "llama.cpp"], gguf=path is not None and path.is_file(),
                                llama_bench_ok=llama_bench_ok)
    for line in missing:
        print(f"peer skipped: {line}", file=sys.stderr)
    return present


def cmd_decode(args) -> int:
    import random

    from kvinfer.cli import engine_config_from_args
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.engine.startup import check_startup
    from kvinfer.loaders.model_loader import load_model
    from kvinfer.sampling_params import SamplingParams

    cfg = engine_config_from_args(args)
    # First load warms the page cache; the second is the figure we report. Both only after the start-up checks.
    load_model(cfg, source=check_startup(cfg))
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    startup = time.perf_counter() - t0
    rng = random.Random(0)
    # A prompt per round: a later round must not find the prompt in the prefix cache.
    prompts = [[rng.randrange(100, engine.model_config.vocab_size) for _ in range(args.prompt_tokens)]
               for _ in range(args.rounds)]
    prompt = prompts[0]

    def ours(engine=engine, prompt=prompt):
        rid = engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
        if engine.tp is not None:
            engine.tp.stats.reset()
        t0 = time.perf_counter()
        times, counts = [], []  # when outputs came, and their tokens (several per call in multi-step decode)
        cached = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and o.outputs[0].delta_token_ids:
                    times.append(time.perf_counter())
                    counts.append(len(o.outputs[0].delta_token_ids))
                    cached = o.num_cached_tokens
        return dict(ttft=times[0] - t0, decode_tps=(sum(counts) - counts[0]) / (times[-1] - times[0]),
                    tokens=sum(counts), cached_prompt_tokens=cached, tp_comm=_tp_comm(engine, times[-1] - t0))

    # Warm-up: the first steps pay one-off costs (allocator, kernel selection). Another prompt of the same
    # length, so the measured prefill is not served from the prefix cache.
    warm = [rng.randrange(100, engine.model_config.vocab_size) for _ in range(args.prompt_tokens)]

    def warm_up(engine):
        engine.add_request(None, warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    warm_up(engine)
    path = engine.loaded.source.path
    # Each peer as a function measuring one round (set up once); kvinfer and the peers take turns, round after
    # round, so slow spells of a shared machine fall on all of them.
    peers: dict = {}
    for peer in _default_peers(args, path):
        if peer == "no-invariance":
            def star(prompt):
                with _invariance_off():
                    other = LLMEngine(cfg)
                    warm_up(other)
                    row = dict(load_s=other.loaded.load_seconds, **ours(other, prompt))
                other.close()
                return row
            peers["kvinfer*"] = star
        elif peer == "transformers":
            from kvinfer.bench.peers import load_transformers, transformers_decode

            t0 = time.perf_counter()
            m = load_transformers(engine.loaded.source, engine.loaded.dtype, engine.loaded.device, cfg.model)
            load_s = time.perf_counter() - t0
            if m is None:
                print("transformers is not installed: pip install 'kvinfer[bench]'", file=sys.stderr)
                continue
            transformers_decode(m, prompt, 8)
            peers["transformers"] = lambda prompt, m=m, load_s=load_s: dict(
                load_s=load_s, **transformers_decode(m, prompt, args.tokens))
        elif peer == "llama.cpp":
            import os

            from kvinfer.bench.peers import find_binary, llama_bench_decode, llama_cpp_decode, load_llama_cpp

            if path is None or not path.is_file():
                print("llama.cpp needs a GGUF model; skipped", file=sys.stderr)
                continue
            if args.llama_bench or os.environ.get("LLAMA_BENCH"):
                binary = find_binary(args.llama_bench, "LLAMA_BENCH", "llama-bench")
                if binary is None:
                    print(f"llama-bench not found or not executable: {args.llama_bench or os.environ['LLAMA_BENCH']}",
                          file=sys.stderr)
                    continue
                peers["llama-bench"] = lambda prompt, binary=binary: dict(  # its own prompt
                    load_s=float("nan"), **llama_bench_decode(binary, path, args.prompt_tokens, args.tokens,
                                                              _threads()))
                continue
            t0 = time.perf_counter()
            llm = load_llama_cpp(path, args.prompt_tokens + args.tokens + 16, _threads())
            load_s = time.perf_counter() - t0
            if llm is None:
                print("llama-cpp-python is not installed: pip install llama-cpp-python", file=sys.stderr)
                continue
            llama_cpp_decode(llm, prompt, 8)
            peers["llama.cpp"] = lambda prompt, llm=llm, load_s=load_s: dict(
                load_s=load_s, **llama_cpp_decode(llm, prompt, args.tokens))
        else:
            print(f"peer {peer} is measured by bench throughput only; skipped", file=sys.stderr)
    samples: dict[str, list[dict]] = {"kvinfer": [], **{name: [] for name in peers}}
    # The memory roofline's read bandwidth, measured before the rounds and after each (a shared machine's bandwidth
    # moves with its neighbours): the best of them.
    roofline_on = not args.no_roofline and path is not None and path.is_file() and path.suffix.lower() == ".gguf"
    bandwidths = []
    if roofline_on:
        from kvinfer.bench.roofline import read_bandwidth

        bandwidths.append(read_bandwidth(_threads()))
    for prompt in prompts:
        samples["kvinfer"].append(dict(load_s=engine.loaded.load_seconds, startup_s=startup, **ours(engine, prompt)))
        for name, measure in list(peers.items()):
            try:
                samples[name].append(measure(prompt))
            except RuntimeError as e:  # llama-bench failing: one line, the other rows still count
                print(f"{name} skipped: {e}", file=sys.stderr)
                del peers[name]
        if roofline_on:
            bandwidths.append(read_bandwidth(_threads()))
    engine.close()
    rows = []
    for name, got in samples.items():
        if not got:
            continue
        row = dict(got[-1], name=name, rounds=len(got))
        for key in ("ttft", "decode_tps"):
            row[key] = statistics.median(g[key] for g in got)
        rows.append(row)
    mine = samples["kvinfer"]
    for r in rows[1:]:  # per-round ratios: each round's kvinfer against the same round's peer
        theirs = samples[r["name"]]
        r["round_decode_ratios"] = [a["decode_tps"] / b["decode_tps"] for a, b in zip(mine, theirs)]
        r["round_prefill_ratios"] = [b["ttft"] / a["ttft"] for a, b in zip(mine, theirs)]
    ref = rows[0]["decode_tps"]
    for r in rows:
        r["prefill_tps"] = args.prompt_tokens / r["ttft"]  # TTFT = prefill of the prompt + the first token
        r["kvinfer_vs_this"] = ref / r["decode_tps"]
        r["kvinfer_prefill_vs_this"] = rows[0]["prefill_tps"] / r["prefill_tps"]
    roofline = None
    if roofline_on:
        from kvinfer.bench.roofline import weight_bytes_per_token

        roofline = dict(bytes_per_token=weight_bytes_per_token(path), read_bandwidth=max(bandwidths),
                        bandwidth_samples=bandwidths)
        roofline["bound_tps"] = roofline["read_bandwidth"] / roofline["bytes_per_token"]
        for r in rows:
            r["roofline_share"] = r["decode_tps"] / roofline["bound_tps"]
    if args.json:
        print(json.dumps(dict(model=_model_label(engine), machine=machine(), threads=_threads(),
                              prompt_tokens=args.prompt_tokens,
                              new_tokens=args.tokens, rows=rows, roofline=roofline), indent=2))
        return 0
    print(f"kvinfer bench decode: {_model_label(engine)}, {_threads()} threads, prompt {args.prompt_tokens} tokens, "
          f"{args.tokens} new tokens, greedy, single stream{_bits_note(engine)}")
    print(machine_line())
    print(f"{'engine':<14}{'load s':>8}{'TTFT ms':>10}{'prefill tok/s':>15}{'decode tok/s':>14}"
          f"{'kvinfer speedup (decode, prefill)':>36}")
    for r in rows:
        print(f"{r['name']:<14}{r['load_s']:>8.2f}{r['ttft'] * 1000:>10.1f}{r['prefill_tps']:>15.1f}"
              f"{r['decode_tps']:>14.1f}{r['kvinfer_vs_this']:>28.2f}x, {r['kvinfer_prefill_vs_this']:.2f}x")
    if args.rounds > 1:
        per_round = "; per-round kvinfer speedups (decode / prefill):" if rows[1:] else ""
        print(f"medians of {args.rounds} rounds{per_round}")
        for r in rows[1:]:
            dr, pr = r["round_decode_ratios"], r["round_prefill_ratios"]
            print(f"  vs {r['name']}: " + ", ".join(f"{a:.2f}x / {b:.2f}x" for a, b in zip(dr, pr)))
    for r in rows:
        if r.get("command"):
            print(f"{r['name']}: {r['command']} (TTFT = prompt / its pp rate)")
        if r["name"] == "kvinfer*":
            print(f"kvinfer*: {NO_INVARIANCE} (BLAS and SDPA for prefill-sized steps; not batch-invariant)")
    if roofline is not None:
        from kvinfer.bench.roofline import roofline_line

        print(roofline_line(roofline["bytes_per_token"], roofline["read_bandwidth"], _threads(), rows,
                            len(bandwidths)))
    _print_tp(rows[0]["tp_comm"])
    return 0


def run_throughput_workload(llm, num_requests: int, seed: int, before=None):
    """`bench throughput`'s measurement (also `simulate --bench`'s): a warm-up request outside the workload, then
    the seeded workload in one generate call (`before()` called just ahead of it). Returns (workload, outputs, wall
    seconds)."""
    from kvinfer.bench.workload import throughput_workload
    from kvinfer.sampling_params import SamplingParams

    eng = llm.engine
    work = throughput_workload(num_requests, seed, vocab_size=eng.model_config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=w.output_tokens, ignore_eos=True) for w in work]
    # Warm-up on a prompt outside the workload (the workload's own would be served from the prefix cache).
    warm = throughput_workload(1, seed + 1, vocab_size=eng.model_config.vocab_size)[0]
    llm.generate([warm.prompt_token_ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    eng.stats.update(peak_blocks=0, util_stored=0, util_capacity=0)
    if eng.tp is not None:
        eng.tp.stats.reset()
    if before is not None:
        before()
    t0 = time.perf_counter()
    outs = llm.generate([w.prompt_token_ids for w in work], params, use_tqdm=False)
    return work, outs, time.perf_counter() - t0


def cmd_throughput(args) -> int:
    import resource

    from kvinfer.bench.workload import percentile
    from kvinfer.cli import engine_config_from_args
    from kvinfer.engine.llm import LLM
    from kvinfer.utils import format_bytes

    cfg = engine_config_from_args(args)

    def run(llm):
        return run_throughput_workload(llm, args.num_requests, args.workload_seed)

    llm = LLM(config=cfg)
    eng = llm.engine
    work, outs, secs = run(llm)
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(w.prompt_token_ids) for w in work)
    ttft = [o.ttft for o in outs]
    tpot = [o.tpot for o in outs]
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = eng.loaded.model.weight_bytes()
    kv_budget = eng.kv_cache.nbytes
    util = eng.stats["util_stored"] / max(1, eng.stats["util_capacity"])
    ours = dict(name="kvinfer", seconds=secs, tps=gen / secs, rps=len(work) / secs, generated=gen,
                prompt_tokens=prompt_tokens, ttft_mean=sum(ttft) / len(ttft), ttft_p99=percentile(ttft, 99),
                tpot_mean=sum(t for t in tpot if t) / max(1, sum(1 for t in tpot if t)), tpot_p99=percentile(tpot, 99),
                peak_blocks=eng.stats["peak_blocks"], total_blocks=eng.kv_manager.num_units,
                kv_dtype=eng.kv_dtype, kv_bytes_per_token=eng.kv_bytes_per_token,
                kv_utilisation=util, preemptions=eng.scheduler.num_preemptions,
                peak_rss=rss_peak, weights_bytes=weights, kv_bytes=kv_budget,
                tp_comm=_tp_comm(eng, secs))
    dtype = eng.loaded.dtype
    if not args.json:  # ours first, so a long peer run never hides them
        print(f"kvinfer bench throughput: {len(work)} requests, {prompt_tokens} prompt + {gen} generated tokens, "
              f"{_threads()} threads, dtype {str(dtype).replace('torch.', '')}, KV cache {eng.kv_dtype} "
              f"({format_bytes(eng.kv_bytes_per_token)} per token){_bits_note(eng)}")
        print(machine_line())
        print(f"  generated tokens/s   {ours['tps']:.1f}   requests/s {ours['rps']:.2f}   wall {secs:.1f} s")
        print(f"  TTFT mean/p99        {ours['ttft_mean'] * 1000:.0f} / {ours['ttft_p99'] * 1000:.0f} ms")
        print(f"  TPOT mean/p99        {ours['tpot_mean'] * 1000:.1f} / {ours['tpot_p99'] * 1000:.1f} ms")
        print(f"  KV blocks peak       {ours['peak_blocks']} of {ours['total_blocks']} "
              f"(block {cfg.block_size}), utilisation {util * 100:.1f}% (tokens stored / capacity of allocated blocks)")
        print(f"  preemptions          {ours['preemptions']}")
        # Not a sum: the KV budget is reserved up front but its pages count in RSS only once written.
        print(f"  peak RSS             {format_bytes(rss_peak)} (weights {format_bytes(weights)}, KV budget "
              f"{format_bytes(kv_budget)} reserved, resident only where written)")
        _print_tp(ours["tp_comm"])
        sys.stdout.flush()
    rows = [ours]
    path, source, device = eng.loaded.source.path, eng.loaded.source, eng.loaded.device
    eng.close()
    del llm, eng
    for peer in _default_peers(args, path, llama_bench_ok=False):
        if peer == "no-invariance":
            with _invariance_off():
                peer_llm = LLM(config=cfg)
                _, o2, s2 = run(peer_llm)
                peer_llm.close()
            g2 = sum(len(o.outputs[0].token_ids) for o in o2)
            rows.append(dict(name=NO_INVARIANCE, seconds=s2, tps=g2 / s2, generated=g2))
        elif peer in ("kv-int8", "kv-fp8", "kv-bfloat16", "kv-float32"):  # the same engine and budget, another KV dtype
            import dataclasses

            peer_llm = LLM(config=dataclasses.replace(cfg, kv_cache_dtype=peer[3:]))
            _, o2, s2 = run(peer_llm)
            pe = peer_llm.engine
            g2 = sum(len(o.outputs[0].token_ids) for o in o2)
            rows.append(dict(name=f"kvinfer, --kv-cache-dtype {peer[3:]}", seconds=s2, tps=g2 / s2, generated=g2,
                             kv_dtype=pe.kv_dtype, preemptions=pe.scheduler.num_preemptions,
                             peak_blocks=pe.stats["peak_blocks"], total_blocks=pe.kv_manager.num_total_blocks))
            peer_llm.close()
            del peer_llm, pe
        elif peer == "transformers":
            from kvinfer.bench.peers import load_transformers, transformers_static_batches

            m = load_transformers(source, dtype, device, cfg.model)
            if m is None:
                print("transformers is not installed: pip install 'kvinfer[bench]'", file=sys.stderr)
                continue
            r = transformers_static_batches(m, work, args.hf_batch_size)
            rows.append(dict(name=f"transformers (static batches of {args.hf_batch_size})", **r))
            del m
        elif peer == "llama.cpp":
            from kvinfer.bench.peers import llama_cpp_throughput, load_llama_cpp

            if path is None or not path.is_file():
                print("llama.cpp needs a GGUF model; skipped", file=sys.stderr)
                continue
            llm_cpp = load_llama_cpp(path, 1024, _threads())
            if llm_cpp is None:
                print("llama-cpp-python is not installed: pip install llama-cpp-python", file=sys.stderr)
                continue
            r = llama_cpp_throughput(llm_cpp, work)
            rows.append(dict(name="llama.cpp (llama-cpp-python, sequential)", **r))
            del llm_cpp
        elif peer == "llama-server":
            from kvinfer.bench.peers import find_llama_server, llama_server_throughput

            binary = find_llama_server(args.llama_server)
            if binary is None:
                print("llama-server not found: pass --llama-server PATH or set LLAMA_SERVER; skipped",
                      file=sys.stderr)
                continue
            if path is None or not path.is_file():
                print("llama-server needs a GGUF model; skipped", file=sys.stderr)
                continue
            longest = max(len(w.prompt_token_ids) + w.output_tokens for w in work)
            try:
                r = llama_server_throughput(binary, path, work, _threads(), args.llama_server_slots, longest + 16)
            except RuntimeError as e:
                print(f"llama-server: {e}; skipped", file=sys.stderr)
                continue
            rows.append(dict(name=f"llama.cpp server ({args.llama_server_slots} slots)", **r))
    for r in rows:
        r["kvinfer_vs_this"] = ours["tps"] / r["tps"]
    if args.json:
        print(json.dumps(dict(machine=machine(), threads=_threads(), requests=len(work), rows=rows), indent=2,
                         default=str))
        return 0
    print(f"{'engine':<42}{'gen tok/s':>10}{'wall s':>9}{'kvinfer speedup':>17}{'KV blocks':>11}{'preemptions':>13}")
    for r in rows:
        kv = (f"{r['total_blocks']:>11}{r['preemptions']:>13}" if "preemptions" in r else "")
        print(f"{r['name']:<42}{r['tps']:>10.1f}{r['seconds']:>9.1f}{r['kvinfer_vs_this']:>16.2f}x{kv}")
    for r in rows[1:]:
        if "preemptions" in r:
            print(f"{r['kv_dtype']} KV vs {ours['kv_dtype']} KV at {format_bytes(kv_budget)}: "
                  f"{r['tps'] / ours['tps']:.2f}x the generated tokens/s, {r['preemptions']} vs "
                  f"{ours['preemptions']} preemptions, {r['total_blocks']} vs {ours['total_blocks']} blocks")
    for r in rows:
        if r.get("command"):
            print(f"{r['name']}: {r['command']}")
    return 0
