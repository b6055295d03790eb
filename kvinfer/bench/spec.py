"""`kvinfer bench spec`: tokens/s with and without speculative decoding in one run, acceptance, identical outputs."""
from __future__ import annotations

import json
import statistics
import time

from kvinfer.bench import machine, machine_line
from kvinfer.spec.ngram import NgramIndex


def register_spec(bs) -> None:
    from kvinfer.cli import add_engine_args, int_at_least

    s = bs.add_parser("spec", help="speculative decoding on vs off: extractive prompts and the throughput workload",
                      description="The package's 8 extractive prompts (repeat, correct or lightly edit a given "
                                  "passage; chat template, greedy) one at a time and all at once, then the bench "
                                  "throughput workload's random-token prompts (non-extractive), each with "
                                  "speculation off and on, on the same loaded weights: generated tokens/s, the "
                                  "speed-up, acceptance rate, mean accepted length, whether the outputs are "
                                  "identical, the single stream prompt by prompt (time off and on, the share of "
                                  "output tokens the n-gram lookup would have proposed), and what the single stream "
                                  "could reach at the run's own step costs with proposals that knew the future. "
                                  "Without --speculative/--speculative-model it uses --speculative ngram.")
    s.add_argument("--max-tokens", type=int_at_least("--max-tokens"), default=128,
                   help="new tokens per extractive prompt, at most (default 128)")
    s.add_argument("--prompts", type=int_at_least("--prompts", 1, 8), default=8,
                   help="extractive prompts to use, 1-8 (default 8)")
    s.add_argument("--throughput-requests", type=int_at_least("--throughput-requests", 0), default=16,
                   help="requests of the bench throughput workload for the non-extractive check; 0 skips it "
                        "(default 16)")
    s.add_argument("--rounds", type=int_at_least("--rounds", 1, 50), default=1,
                   help="rounds; each runs every workload with speculation off and on back to back (the order "
                        "flips each round, the prefix caches start empty); medians, and the speed-up as the median "
                        "of each round's (default 1)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_engine_args(s)
    s.set_defaults(func=cmd_spec)


def _run(engine, prompts, params, steps: list | None = None) -> tuple[list[list[int]], float, float]:
    """All prompts at once through one engine; (token ids per prompt, wall seconds, seconds from each request's
    first token to its last, summed: decode time without the prefill). With `steps`, each engine step is appended
    as (seconds, tokens proposed, tokens generated, prompt tokens computed)."""
    t0 = time.perf_counter()
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done = {}
    decode_s = 0.0
    st = engine.stats
    while engine.has_unfinished_requests():
        before = (time.perf_counter(), st["spec_draft_tokens"], st["generation_tokens"], st["prompt_tokens"])
        outs = engine.step()
        if steps is not None:
            steps.append((time.perf_counter() - before[0], st["spec_draft_tokens"] - before[1],
                          st["generation_tokens"] - before[2], st["prompt_tokens"] - before[3]))
        for o in outs:
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
                decode_s += o.metrics.last_token_time - o.metrics.first_token_time
    return [done[i] for i in ids], time.perf_counter() - t0, decode_s


def _spec_stats(engine) -> tuple[int, int, int]:
    st = engine.stats
    return st["spec_drafts"], st["spec_draft_tokens"], st["spec_accepted_tokens"]


def lookup_share(prompt: list[int], output: list[int], ngram_min: int = 1, ngram_max: int = 4) -> float:
    """The share of output tokens that the n-gram prompt lookup (kvinfer.spec.ngram, as the engine runs it) would
    have proposed first, given the prompt and the output before each: what speculation could have known."""
    index, ctx, hits = NgramIndex(ngram_min, ngram_max), list(prompt), 0
    for t in output:
        hits += index.propose(ctx, 1) == [t]
        ctx.append(t)
    return hits / len(output) if output else 0.0


def step_costs(steps_on: list[tuple], steps_off: list[tuple]) -> dict | None:
    """What decoding cost in this run: a verification step of r proposed tokens took verify_ms + row_ms * r (least
    squares over the decode-only steps that verified), and plain decoding plain_ms per token (speculation off:
    every decode-only step's seconds over its tokens). None without verifications of two different lengths."""
    pts = [(p, s) for s, p, g, pr in steps_on if p > 0 and g > 0 and pr == 0]
    plain = [(s, g) for s, p, g, pr in steps_off if g > 0 and pr == 0]
    if len({p for p, _ in pts}) < 2 or not plain:
        return None
    mr = statistics.fmean(p for p, _ in pts)
    ms = statistics.fmean(s for _, s in pts)
    b = sum((p - mr) * (s - ms) for p, s in pts) / sum((p - mr) ** 2 for p, _ in pts)
    return dict(verify_ms=(ms - b * mr) * 1e3, row_ms=b * 1e3,
                plain_ms=sum(s for s, _ in plain) / sum(g for _, g in plain) * 1e3)


def decode_bound_ms(prompt: list[int], output: list[int], k: int, costs: dict, ngram_min: int = 1,
                    ngram_max: int = 4, all_accepted: bool = False) -> float:
    """Milliseconds to decode `output` after its first token at `costs` (step_costs) for a proposer that knows the
    future: it proposes exactly the n-gram lookup's tokens that will be accepted, or decodes plainly where none
    would be (all_accepted: the next min(k, left) output tokens every step, whatever the lookup says)."""
    index, ms, t, n = NgramIndex(ngram_min, ngram_max), 0.0, 1, len(output)
    ctx = list(prompt) + list(output[:1])  # everything known before output[t]
    while t < n:
        left = min(k, n - 1 - t)
        if all_accepted:
            a = left
        else:
            toks, a = index.propose(ctx, left), 0
            while a < len(toks) and toks[a] == output[t + a]:
                a += 1
        ms += costs["verify_ms"] + costs["row_ms"] * a if a else costs["plain_ms"]
        ctx += output[t:t + a + 1]
        t += a + 1
    return ms


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _measure(engine, how: str, prompts, params) -> dict:
    """One workload through one engine: one prompt at a time ("single") or all at once ("batch")."""
    before = _spec_stats(engine)
    per, per_decode, steps = [], [], []  # single stream: each prompt's seconds and decode seconds; every step
    if how == "single":
        outs, secs, dsecs = [], 0.0, 0.0
        for p, sp in zip(prompts, params):
            o, s, ds = _run(engine, [p], [sp], steps)
            outs += o
            secs += s
            dsecs += ds
            per.append(s)
            per_decode.append(ds)
    else:
        outs, secs, dsecs = _run(engine, prompts, params)
    d, p, a = (x - y for x, y in zip(_spec_stats(engine), before))
    gen = sum(len(o) for o in outs)
    return dict(tps=gen / secs, seconds=secs, generated=gen, outputs=outs, per_prompt_s=per,
                per_prompt_decode_s=per_decode, steps=steps,
                decode_tps=sum(len(o) - 1 for o in outs) / dsecs if dsecs else 0.0,
                drafts=d, draft_tokens=p, accepted_tokens=a)


def cmd_spec(args) -> int:
    from kvinfer.bench.cli import _model_label, _threads
    from kvinfer.bench.spec_workload import EXTRACTIVE_PROMPTS
    from kvinfer.bench.workload import throughput_workload
    from kvinfer.cli import engine_config_from_args
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.errors import ValidationError
    from kvinfer.loaders.model_loader import load_model
    from kvinfer.sampling_params import SamplingParams
    from kvinfer.spec.speculator import acceptance

    if args.prompts > len(EXTRACTIVE_PROMPTS):
        raise ValidationError("prompts", args.prompts, f"must be in [1, {len(EXTRACTIVE_PROMPTS)}]")
    cfg = engine_config_from_args(args)
    if not cfg.speculative:
        cfg = cfg.replace(speculative="ngram")
    loaded = load_model(cfg)
    tok = loaded.tokenizer
    if tok is None:
        raise ValidationError("model", cfg.model, "has no tokenizer; the extractive prompts are text (--tokenizer DIR)")
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
             for p in EXTRACTIVE_PROMPTS[:args.prompts]]
    extractive = [tok.encode(t, add_special_tokens=False) for t in texts]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    work = throughput_workload(args.throughput_requests, 0, vocab_size=loaded.config.vocab_size)
    phases = [("extractive, single stream", "single", extractive, [greedy] * len(extractive)),
              (f"extractive, batched ({len(extractive)})", "batch", extractive, [greedy] * len(extractive))]
    if work:
        phases.append((f"throughput prompts, batched ({len(work)})", "batch", [w.prompt_token_ids for w in work],
                       [SamplingParams(temperature=0, max_tokens=w.output_tokens, ignore_eos=True) for w in work]))
    # Both engines on the same weights, and each workload measured off and on back to back: the VM's speed drifts
    # by 10-30% over a minute, which would otherwise land on one side of a ratio.
    engines = {mode: LLMEngine(mcfg, loaded=loaded)
               for mode, mcfg in (("off", cfg.replace(speculative=None, speculative_model=None)), ("on", cfg))}
    label = _model_label(engines["on"])
    k = engines["on"].speculator.k
    for engine in engines.values():
        _run(engine, [extractive[0][:16]], [SamplingParams(temperature=0, max_tokens=8)])  # warm-up, not measured
    results: dict[str, dict] = {name: {"off": [], "on": []} for name, *_ in phases}
    for rnd in range(args.rounds):
        for engine in engines.values():
            engine.kv_manager.reset_prefix_cache()  # every round sees the same caches
        for name, how, prompts, params in phases:
            for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                results[name][mode].append(_measure(engines[mode], how, prompts, params))
    del engines
    rows = []
    for name, *_ in phases:
        offs, ons = results[name]["off"], results[name]["on"]
        d, p, a = (sum(r[k] for r in ons) for k in ("drafts", "draft_tokens", "accepted_tokens"))
        rate, length = acceptance(d, p, a)
        same = min(sum(x == y for x, y in zip(f["outputs"], o["outputs"])) for f, o in zip(offs, ons))
        ratios = [o["tps"] / f["tps"] for f, o in zip(offs, ons)]
        dec = [o["decode_tps"] / f["decode_tps"] for f, o in zip(offs, ons) if f["decode_tps"]]
        rows.append(dict(workload=name, tps_off=_median(offs, "tps"), tps_on=_median(ons, "tps"),
                         speedup=statistics.median(ratios), round_speedups=ratios, acceptance_rate=rate,
                         mean_accepted_length=length, proposed=p, accepted=a, identical=same,
                         requests=len(offs[0]["outputs"]), generated_off=offs[-1]["generated"],
                         generated_on=ons[-1]["generated"], decode_tps_off=_median(offs, "decode_tps"),
                         decode_tps_on=_median(ons, "decode_tps"),
                         decode_speedup=statistics.median(dec) if dec else 0.0))
    single_off, single_on = results[phases[0][0]]["off"], results[phases[0][0]]["on"]
    per_prompt = []
    for i, prompt in enumerate(extractive):
        off_s = statistics.median(r["per_prompt_s"][i] for r in single_off)
        on_s = statistics.median(r["per_prompt_s"][i] for r in single_on)
        out = single_on[-1]["outputs"][i]
        per_prompt.append(dict(prompt_tokens=len(prompt), generated=len(out),
                               lookup=lookup_share(prompt, out, cfg.ngram_min, cfg.ngram_max),
                               ms_off=off_s * 1e3, ms_on=on_s * 1e3, speedup=off_s / on_s))
    rows[0]["prompts"] = per_prompt
    # What the single stream could reach at this run's own step costs with a proposer that knew the future.
    costs = step_costs([x for r in single_on for x in r["steps"]], [x for r in single_off for x in r["steps"]])
    if costs is not None:
        off_ms = sum(pp["ms_off"] for pp in per_prompt)
        for key, every in (("lookup_oracle", False), ("all_accepted", True)):
            ms = 0.0
            for i, prompt in enumerate(extractive):
                pre = statistics.median(r["per_prompt_s"][i] - r["per_prompt_decode_s"][i] for r in single_on)
                ms += pre * 1e3 + decode_bound_ms(prompt, single_on[-1]["outputs"][i], k, costs, cfg.ngram_min,
                                                  cfg.ngram_max, all_accepted=every)
            costs[key] = off_ms / ms
        rows[0]["bound"] = costs
    how = (f"draft model {cfg.speculative_model}" if cfg.speculative == "draft"
           else f"n-gram {cfg.ngram_min}..{cfg.ngram_max}")
    if args.json:
        print(json.dumps(dict(model=label, machine=machine(), threads=_threads(), speculative=how,
                              num_speculative_tokens=k, max_tokens=args.max_tokens,
                              rounds=args.rounds, rows=rows), indent=2))
        return 0
    print(f"kvinfer bench spec: {label}, {_threads()} threads, speculative {how}, "
          f"k={k}, greedy; extractive prompts up to {args.max_tokens} new tokens")
    print(machine_line())
    print(f"{'workload':<36}{'off tok/s':>10}{'on tok/s':>10}{'speed-up':>10}{'accepted':>10}"
          f"{'mean len':>10}{'identical':>11}")
    for r in rows:
        print(f"{r['workload']:<36}{r['tps_off']:>10.1f}{r['tps_on']:>10.1f}{r['speedup']:>9.2f}x"
              f"{r['acceptance_rate'] * 100:>9.0f}%{r['mean_accepted_length']:>10.2f}"
              f"{r['identical']:>7}/{r['requests']}")
    print("single stream per prompt (lookup: output tokens the n-gram lookup would have proposed first):")
    for i, pp in enumerate(per_prompt):
        print(f"  prompt {i + 1}: {pp['prompt_tokens']:>4} tokens in, {pp['generated']:>4} out, lookup "
              f"{pp['lookup'] * 100:3.0f}%, {pp['ms_off']:7.1f} -> {pp['ms_on']:7.1f} ms, {pp['speedup']:.2f}x")
    single = rows[0]
    if "bound" in single:
        b = single["bound"]
        print(f"single stream bound at this run's step costs (a verification of r proposals {b['verify_ms']:.2f} + "
              f"{b['row_ms']:.2f} * r ms, a plain step {b['plain_ms']:.2f} ms): proposing exactly the lookup's "
              f"tokens that will be accepted {b['lookup_oracle']:.2f}x; every proposal accepted "
              f"{b['all_accepted']:.2f}x")
    print(f"single stream, decode only (first to last token, no prefill): {single['decode_tps_off']:.1f} -> "
          f"{single['decode_tps_on']:.1f} tok/s, {single['decode_speedup']:.2f}x")
    if args.rounds > 1:
        print(f"medians of {args.rounds} rounds (off and on back to back, order flipped each round); per-round "
              "speed-ups:")
        for r in rows:
            print(f"  {r['workload']}: " + ", ".join(f"{x:.2f}x" for x in r["round_speedups"]))
    return 0

