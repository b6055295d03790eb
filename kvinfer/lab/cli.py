"""`kvinfer lab kvcache`, `kvinfer plan` and `kvinfer simulate`: the laboratory's command lines."""
from __future__ import annotations

import argparse
import json
import sys

from kvinfer.cli import int_at_least as _positive_int
from kvinfer.cli import THREADS_MAX, float_above, seed_int
from kvinfer.config import MAX_SCHEDULER_STEPS

_DTYPES = ("float32", "bfloat16", "float16")


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in ("none", "contiguous", "paged")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown backend {bad[0] if bad else text!r}; "
                                         f"choose from none, contiguous, paged")
    return names


def register(sub) -> None:
    from kvinfer.cli import add_engine_args, add_scheduler_args

    lab = sub.add_parser("lab", help="laboratory experiments (kvcache: no cache vs contiguous vs paged)",
                         description="Experiments that measure what the textbook asserts.")
    ls = lab.add_subparsers(dest="lab_command", metavar="EXPERIMENT")
    lab.set_defaults(func=lambda a: (lab.print_help(), 2)[1])

    k = ls.add_parser(
        "kvcache", help="the same prompt with no cache, a contiguous and a paged cache: latency, K/V work, memory",
        description="Generate --tokens tokens greedily (ignore_eos) for one prompt with each KV backend (none, "
                    "contiguous, paged), timing every engine step. Reports per-token latency by position, total "
                    "time, K/V projections computed (measured and by formula), peak KV memory and the speedup over "
                    "no cache; fails if the greedy outputs differ. Writes a CSV, PNG plots and a Markdown table "
                    "into --out. Every backend in --backends runs (there is no --kv-cache here).")
    from kvinfer.lab.kvcache import DEFAULT_TOKENS

    k.add_argument("--tokens", type=_positive_int("--tokens"), default=DEFAULT_TOKENS,
                   help=f"tokens to generate (default {DEFAULT_TOKENS}: about two minutes on the built-in model "
                        f"on 2 CPU cores; 1024 or more shows the no-cache line's growth clearly, at the cost of "
                        f"an hour or more)")
    k.add_argument("--prompt", default=None, help="prompt text (the chat template is applied)")
    k.add_argument("--prompt-tokens", type=_positive_int("--prompt-tokens"), default=None,
                   help="use this many seeded random token ids instead of text (automatic for models "
                        "without a tokenizer: 16)")
    k.add_argument("--backends", type=_backends, default=["none", "contiguous", "paged"],
                   help="comma-separated subset of none,contiguous,paged (default: all three)")
    k.add_argument("--out", default="lab-out", help="directory for the CSV, plots and table (default ./lab-out)")
    k.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_engine_args(k, with_kv_cache=False)
    k.set_defaults(func=cmd_lab_kvcache, kv_cache="paged")

    p = sub.add_parser(
        "plan", help="KV memory planner: bytes per token, weights, concurrent requests contiguous vs paged",
        description="Plan KV-cache memory for a model: KV bytes per token and per max-length request, weight "
                    "bytes, memory left for KV, and how many requests fit concurrently with a contiguous "
                    "max-length reservation versus paged blocks for a length distribution. Numbers are per "
                    "device; --tp divides weights and KV heads.")
    p.add_argument("--model", "-m", default=None,
                   help="preset (e.g. llama-2-7b), HF directory, config.json or GGUF file (default: the built-in "
                        "model)")
    p.add_argument("--memory", required=True, help="accelerator memory per device, e.g. 40GiB, 80GB")
    p.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None,
                   help="context window each request may reach (default: the model's)")
    p.add_argument("--dtype", default="float16", choices=_DTYPES, help="weights and KV dtype (default float16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8", "bfloat16"),
                   help="KV cache element type: auto (--dtype), int8 or fp8 (8 bits + a float32 scale per 32 "
                        "values), bfloat16")
    p.add_argument("--block-size", type=_positive_int("--block-size"), default=16, help="tokens per block (16)")
    p.add_argument("--tensor-parallel-size", "--tp", "-tp", dest="tp", type=_positive_int("--tensor-parallel-size"),
                   default=1, help="tensor-parallel size: KV heads, KV budget and blocks are per rank (default 1)")
    p.add_argument("--workload", default=None,
                   help="request lengths (prompt + output): uniform:A-B, mean:L or mix:W@A-B,...; default a mix "
                        "of 60%% 128-1024, 30%% 1025-4096, 10%% 4097-8192 clipped to max_model_len")
    p.add_argument("--concurrent", type=_positive_int("--concurrent"), default=8,
                   help="also size this many concurrent requests, contiguous vs paged (default 8: the "
                        "40 GB / 8-request example)")
    p.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="also size a RAM tier of this many bytes below the pool (docs/kv_tiers.md)")
    p.add_argument("--kv-cache-dir-size", default=None, metavar="SIZE", help="also size a disk tier of this quota")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser(
        "simulate", help="the engine's scheduler and paged KV manager over a trace, on a virtual clock",
        description="Run the engine's Scheduler with its PagedKVManager (and, for comparison, a contiguous "
                    "max-length reservation of the same memory) over a request trace without model weights. "
                    "Time advances by a step-time cost model: a + b*batched_tokens + c*decode_seqs + "
                    "d*context_tokens per planned step, e + f*decode_seqs + g*context_tokens per fused decode "
                    "step, fitted on real engine steps (--fit: a few seconds on this machine). Deterministic for "
                    "a trace and seed. --bench checks the prediction against bench throughput's measurement of "
                    "the same workload.")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None,
                     help='JSONL file, one request a line: {"arrival": s, "prompt_tokens": n, "output_tokens": m}')
    src.add_argument("--synthetic", type=_positive_int("--synthetic"), default=None,
                     help="N seeded requests like bench throughput: prompt 16-512, output 16-256, all at t=0 "
                          "(default: 64)")
    s.add_argument("--seed", type=seed_int("--seed"), default=0,
                   help="seed of the synthetic trace and of token ids (default 0)")
    s.add_argument("--model", "-m", default=None,
                   help="shapes for KV sizing: preset, HF directory, config.json or GGUF (default: built-in)")
    s.add_argument("--dtype", default="auto", choices=("auto",) + _DTYPES,
                   help="KV dtype (default auto: what the engine picks on this machine)")
    s.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8", "bfloat16"),
                   help="KV cache element type: auto (--dtype), int8 or fp8 (8 bits + a float32 scale per 32 "
                        "values), bfloat16")
    s.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 1GiB (default: the engine's 1GiB)")
    s.add_argument("--block-size", type=_positive_int("--block-size"), default=16, help="tokens per block (16)")
    s.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None,
                   help="context window (default: the model's)")
    add_scheduler_args(s)
    s.add_argument("--no-chunked-prefill", action="store_true",
                   help="schedule a prompt only when all of it fits in one step's token budget")
    s.add_argument("--num-scheduler-steps", type=_positive_int("--num-scheduler-steps", 1, MAX_SCHEDULER_STEPS),
                   default=8, help="the engine's fused decode steps per call (default 8, as the engine's; 1: none)")
    s.add_argument("--cost-model", default=None,
                   help="'fitted' (stored coefficients, scaled to --model's shapes; the default) or a,b,c,d[,e,f,g] "
                        "in seconds (e, f, g: a fused decode step)")
    s.add_argument("--fit", action="store_true",
                   help="calibrate the cost model first on a few seconds of real engine steps with --model "
                        "(built-in by default) on this machine")
    s.add_argument("--bench", action="store_true",
                   help="also run bench throughput's measurement of the same workload (--synthetic N, --seed) with "
                        "the same engine settings, and print the predicted throughput against it with the error "
                        "and both KV block counts; calibrates the cost model on that engine first unless "
                        "--cost-model is given")
    s.add_argument("--threads", type=_positive_int("--threads", 1, THREADS_MAX), default=None,
                   help="torch threads for --fit and --bench")
    s.add_argument("--fit-clock", default="wall", choices=("wall", "cpu"),
                   help="--fit times steps by wall clock (default) or by this process's CPU time, which other "
                        "processes cannot inflate (use with --threads 1 on a shared machine)")
    s.add_argument("--tensor-parallel-size", "--tp", "-tp", dest="tp", type=_positive_int("--tensor-parallel-size"),
                   default=1, help="simulate N tensor-parallel ranks: b, c, d split N ways plus each step's "
                                   "collectives; --kv-cache-memory is per rank (default 1)")
    s.add_argument("--tp-latency", type=float_above("--tp-latency", inclusive=True), default=None,
                   help="microseconds per collective under -tp (default: gloo on loopback as measured here)")
    s.add_argument("--tp-bandwidth", type=float_above("--tp-bandwidth"), default=None,
                   help="GB/s per rank under -tp (default: gloo on loopback as measured here)")
    s.add_argument("--tp-allreduce", action="store_true",
                   help="-tp with 2 all-reduces per layer (KVINFER_TP_EXACT=0) instead of the exact 4 all-gathers")
    s.add_argument("--no-compare", action="store_true", help="skip the contiguous comparison run")
    s.add_argument("--out", default=None, help="directory for a per-request CSV and a KV-use plot (default: none)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_simulate)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- lab kvcache -------------------------------------------------------------------------------
def cmd_lab_kvcache(args) -> int:
    from kvinfer.cli import engine_config_from_args
    from kvinfer.lab.kvcache import LabMismatchError, markdown_table, run_lab, summary, write_outputs

    from kvinfer.utils import output_dir

    cfg = engine_config_from_args(args)
    output_dir(args.out)  # before minutes of measuring
    result = run_lab(cfg, num_tokens=args.tokens, prompt=args.prompt, prompt_tokens=args.prompt_tokens,
                     backends=args.backends, progress=None if args.json else _progress)
    files = write_outputs(result, args.out)
    if args.json:
        out = summary(result)
        out["files"] = {k: str(v) for k, v in files.items()}
        print(json.dumps(out, indent=2))
    else:
        print(markdown_table(result))
        print("Files: " + ", ".join(str(v) for v in files.values()))
    if not result.identical:
        raise LabMismatchError(f"{result.mismatch} (results written to {args.out})")
    return 0


# ---- plan --------------------------------------------------------------------------------------
def cmd_plan(args) -> int:
    from kvinfer.lab.plan import format_plan, make_plan, parse_workload, resolve_model_config
    from kvinfer.utils import format_bytes, parse_size

    memory = parse_size(args.memory, "memory")
    cfg, label = resolve_model_config(args.model)
    max_len = args.max_model_len or cfg.max_position_embeddings
    workload = parse_workload(args.workload, max_len)
    plan = make_plan(cfg, memory, max_len, args.dtype, args.block_size, args.tp, workload, label, args.concurrent,
                     args.kv_cache_dtype)
    tiers = {name: parse_size(size, flag) for name, size, flag in
             (("ram", args.kv_offload_memory, "kv_offload_memory"), ("disk", args.kv_cache_dir_size,
                                                                     "kv_cache_dir_size")) if size}
    if tiers:
        from kvinfer.kv.tiers import plan_tiers

        plan["kv_tiers"] = plan_tiers(plan["kv_bytes_per_token"], args.block_size, tiers)
    text = format_plan(plan)
    for name, t in plan.get("kv_tiers", {}).items():
        text += (f"\nKV {name} tier {format_bytes(t['bytes']):>10}: {t['blocks']:,} blocks of {args.block_size} tokens "
                 f"({t['tokens']:,} tokens, {t['prefixes']:,} prefixes of {t['prefix_tokens']:,} tokens)")
    print(json.dumps(plan, indent=2) if args.json else text)
    return 0


# ---- simulate ----------------------------------------------------------------------------------
def _tp_cost(sim, cost, mc, args):
    from kvinfer.errors import ValidationError
    from kvinfer.lab.plan import kv_heads_per_device

    kv_heads_per_device(mc, args.tp)  # the engine's head-count rule: a one-line error naming the sizes that work
    latency = sim.GLOO_LOOPBACK_LATENCY_S if args.tp_latency is None else args.tp_latency * 1e-6
    bandwidth = sim.GLOO_LOOPBACK_BANDWIDTH if args.tp_bandwidth is None else args.tp_bandwidth * 1e9
    if not latency >= 0 or latency == float("inf"):
        raise ValidationError("tp_latency", args.tp_latency, "must be a finite number of microseconds >= 0")
    if not 0 < bandwidth < float("inf"):
        raise ValidationError("tp_bandwidth", args.tp_bandwidth, "must be a finite number of GB/s > 0")
    return sim.TPCost(cost, args.tp, mc, latency, bandwidth, exact=not args.tp_allreduce)


def cmd_simulate(args) -> int:
    from dataclasses import replace

    from kvinfer.config import PRESETS, EngineConfig
    from kvinfer.errors import ValidationError
    from kvinfer.lab import simulate as sim
    from kvinfer.lab.plan import resolve_model_config
    from kvinfer.utils import output_dir, parse_size

    memory = parse_size(args.kv_cache_memory, "kv_cache_memory")
    if args.fit and args.cost_model is not None:
        raise ValidationError("cost_model", args.cost_model, "--fit measures the cost model: give one or the other")
    if args.bench and args.trace:
        raise ValidationError("trace", args.trace, "--bench measures bench throughput's workload: use --synthetic N")
    if args.bench and args.tp > 1:
        raise ValidationError("tensor_parallel_size", args.tp, "--bench measures one process: leave it at 1")
    cost = sim.parse_cost_model(args.cost_model) if args.cost_model is not None else None
    if args.out:
        output_dir(args.out)  # before the simulation (and any measurement) runs
    mc, label = resolve_model_config(args.model)
    if args.dtype == "auto":
        from kvinfer.loaders.model_loader import resolve_device, resolve_dtype

        args.dtype = str(resolve_dtype("auto", resolve_device("auto"))).replace("torch.", "")
    dummy = args.model is not None and (args.model in PRESETS or args.model.endswith(".json"))
    # The engine these settings make: what --fit calibrates and --bench measures.
    ecfg = EngineConfig(model=args.model, dtype=args.dtype, load_format="dummy" if dummy else "auto",
                        kv_cache="paged", kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                        kv_cache_memory=memory, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching,
                        enable_chunked_prefill=not args.no_chunked_prefill,
                        num_scheduler_steps=args.num_scheduler_steps, num_threads=args.threads)
    progress = None if args.json else _progress
    samples = bench = None
    max_len = args.max_model_len or mc.max_position_embeddings
    n = args.synthetic or 64
    if args.bench:
        bench, cost, samples, max_len = _measure_bench(sim, ecfg, cost, n, args, progress)
    elif args.fit:
        cost, samples = sim.fit_cost_model(ecfg, progress=progress, clock=args.fit_clock)
    if cost is None:
        cost = sim.FITTED.scaled_to(mc)
    elif samples is not None and not args.json:
        _progress(f"fitted cost model: --cost-model {','.join(f'{c:.6g}' for c in cost.coefficients)} "
                  f"({cost.source})")
    if args.tp > 1:
        cost = _tp_cost(sim, cost, mc, args)
    if args.trace:
        trace = sim.load_trace(args.trace)
        trace_label = f"{args.trace} ({len(trace)} requests, seed {args.seed})"
    else:
        trace = sim.synthetic_trace(n, args.seed, mc.vocab_size)
        trace_label = f"synthetic: {n} requests, prompt 16-512, output 16-256, all at t=0, seed {args.seed}"
    # the engine's KV element type, so that the pool has the engine's block count
    kv_dtype = sim.engine_kv_cache_dtype(args.model, args.dtype, args.kv_cache_dtype)
    fuses = bench.pop("fuses") if bench is not None else sim.engine_fuses_decode(args.model, args.dtype)
    cfg = sim.SimConfig(kv_cache_memory=memory, dtype=args.dtype, kv_cache_dtype=kv_dtype,
                        block_size=args.block_size, max_model_len=max_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching,
                        enable_chunked_prefill=not args.no_chunked_prefill, seed=args.seed, tp=args.tp,
                        num_scheduler_steps=args.num_scheduler_steps if fuses else 1)
    runs = sim.run_simulation(trace, mc, cfg, cost, compare_contiguous=not args.no_compare)
    report = dict(model=label, dtype=args.dtype if kv_dtype == "auto" else kv_dtype,
                  kv_cache_memory=memory, max_model_len=max_len, trace=trace_label,
                  cost_model=dict(zip("abcdefg", (getattr(cost, k, 0.0) for k in "abcdefg")), source=cost.source),
                  results={k: sim.summarize(r) for k, r in runs.items()})
    if samples is not None:
        report["fit_samples"] = samples
    if bench is not None:
        paged = report["results"]["paged"]
        predicted = paged["throughput_tok_s"]
        r = runs["paged"]
        bench.update(predicted_tok_s=predicted, simulated_blocks=r.num_units,
                     simulated_preemptions=paged["preemptions"],
                     error=(predicted - bench["measured_tok_s"]) / bench["measured_tok_s"] if predicted else None,
                     simulated_planned_steps=r.num_steps - r.num_fused_steps,
                     simulated_planned_s=r.makespan - r.fused_seconds, simulated_fused_steps=r.num_fused_steps,
                     simulated_fused_s=r.fused_seconds)
        # The same simulation on a cost model fitted to the measured run's own steps: what is left of the error
        # when the machine's speed during the calibration is taken out (the model's form, not its coefficients).
        stalled = [x for x in bench.pop("run_samples")
                   if x["seconds"] > 3 * cost.step_time_of(x)]
        bench.update(stalled_steps=sum(x["steps"] for x in stalled),
                     stalled_s=sum(x["seconds"] * x["steps"] for x in stalled))
        own = bench.pop("own_cost_model")
        own_tps = sim.summarize(sim.simulate(trace, mc, replace(cfg, kv_cache="paged"), own))["throughput_tok_s"]
        bench.update(own_cost_model=dict(zip("abcdefg", own.coefficients), source=own.source),
                     own_predicted_tok_s=own_tps,
                     own_error=(own_tps - bench["measured_tok_s"]) / bench["measured_tok_s"] if own_tps else None)
        report["bench"] = bench
    if args.out:
        import csv

        out = output_dir(args.out)
        csv_path = out / "simulate_requests.csv"
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kv_cache", "index", "arrival", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s",
                        "finish_s", "preemptions", "rejected"])
            for name, r in runs.items():
                for q in r.requests:
                    w.writerow([name, q.index, q.arrival, q.prompt_tokens, q.output_tokens, q.ttft, q.tpot,
                                q.finish, q.preemptions, q.rejected or ""])
        plot = sim.write_plot(report, {k: r.timeline for k, r in runs.items()}, out / "simulate_kv_use.png")
        report["files"] = dict(csv=str(csv_path), plot=str(plot))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(sim.format_summary(report))
        if bench is not None:
            print(sim.format_bench(bench))
        if args.out:
            print(f"Files: {report['files']['csv']}, {report['files']['plot']}")
    return 0


def _measure_bench(sim, ecfg, cost, num_requests: int, args, progress):
    """--bench: load the engine, calibrate the cost model on it (unless one is given), run bench throughput's
    measurement of the workload, calibrate again and fit on both calibrations, all in this process, so that the
    calibration and the run see the same machine."""
    import time

    import torch

    from kvinfer.bench import machine_line
    from kvinfer.bench.cli import run_throughput_workload
    from kvinfer.engine.llm import LLM

    llm = LLM(config=ecfg)
    try:
        eng = llm.engine
        samples = None
        t0 = time.perf_counter()
        if cost is None:
            cost, samples = sim.calibrate(eng, progress, clock=args.fit_clock)
        calibration_s = time.perf_counter() - t0
        if progress:
            progress(f"bench throughput: {num_requests} requests, workload seed {args.seed}")
        with sim.StepRecorder(eng) as rec:  # the measured run's own steps, timed as the calibration's
            work, outs, secs = run_throughput_workload(llm, num_requests, args.seed, before=rec.samples.clear)
        if samples is not None:  # calibrated again after the run, and fitted on both: the machine's speed
            # moves on a shared machine, and this way the calibration sees it on either side of the run
            t0 = time.perf_counter()
            cost, after = sim.calibrate(eng, progress, clock=args.fit_clock, earlier=samples)
            samples = samples + after
            calibration_s += time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        bench = dict(requests=len(work), workload_seed=args.seed, seconds=secs, generated_tokens=gen,
                     measured_tok_s=gen / secs, engine_blocks=eng.kv_manager.num_units,
                     engine_preemptions=eng.scheduler.num_preemptions, calibration_s=calibration_s,
                     threads=torch.get_num_threads(), machine=machine_line(),
                     planned_steps=rec.steps("planned"), planned_s=rec.seconds("planned"),
                     fused_steps=rec.steps("fused"), fused_s=rec.seconds("fused"),
                     own_cost_model=sim.cost_model_from_samples(rec.samples, "fitted on the measured run's own steps",
                                                                eng.model_config, drop_outliers=False),
                     run_samples=rec.samples, fuses=eng.runner._fused_decode() is not None)
        return bench, cost, samples, eng.max_model_len
    finally:
        llm.close()
