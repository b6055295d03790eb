"""`kvinfer bench structured`: decode tokens/s of concurrent JSON-Schema-constrained requests vs unconstrained ones."""
from __future__ import annotations

import json
import sys
import time

from kvinfer.bench import machine, machine_line

# Long by construction (at least 20 items), so every constrained sequence runs to --tokens like the
# unconstrained ones with ignore_eos, and both runs decode the same batch for the same number of steps.
BENCH_SCHEMA = {"type": "array", "minItems": 20, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99},
                   "city": {"enum": ["Paris", "London", "Berlin", "Madrid", "Rome"]}}}}


def register_structured(bs) -> None:
    from kvinfer.cli import add_engine_args, int_at_least

    p = bs.add_parser("structured", help="constrained (JSON Schema) vs unconstrained decode tokens/s",
                      description="--requests concurrent requests decode --tokens tokens each, sampled, without "
                                  "and then with a JSON Schema (llguidance token masks); decode tokens/s over the "
                                  "steps where the whole batch decodes, best of --rounds alternating runs.")
    p.add_argument("--requests", type=int_at_least("--requests"), default=16, help="concurrent requests (default 16)")
    p.add_argument("--tokens", type=int_at_least("--tokens", 2), default=64, help="new tokens each (default 64)")
    p.add_argument("--rounds", type=int_at_least("--rounds"), default=2, help="runs of each kind (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_engine_args(p)
    p.set_defaults(func=cmd_structured)


def _run(engine, prompt, params, n: int, timer: dict) -> dict:
    """Decode tokens/s over the steps where all n sequences decode (no prefill in the step; a fused multi-step call,
    which unconstrained sampled requests may take, counts with all its tokens)."""
    for _ in range(n):
        engine.add_request(None, prompt, params)
    tokens = 0
    secs = 0.0
    timer.update(mask=0.0, calls=0)
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        waiting = len(engine.scheduler.waiting)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = sum(len(o.delta_token_ids) for out in outs for o in out.outputs)
        if running == n and waiting == 0 and new and new % n == 0:
            tokens += new
            secs += dt
    return dict(decode_tps=tokens / secs if secs else 0.0, decode_tokens=tokens, decode_seconds=secs,
                mask_seconds=timer["mask"], mask_calls=timer["calls"])


def cmd_structured(args) -> int:
    from kvinfer.cli import engine_config_from_args
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.sampling_params import SamplingParams, StructuredOutput

    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    if tok is None:
        print("error: kvinfer bench structured needs a model with a tokenizer", file=sys.stderr)
        return 2
    text = tok.apply_chat_template([{"role": "user", "content": "List people with their age and city as JSON."}])
    prompt = tok.encode(text, add_special_tokens=False)
    spec = StructuredOutput(json=BENCH_SCHEMA)
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, structured_output=spec)
    # Warm-up: model, llguidance's tokenizer index and the compiled grammar stay out of the timings.
    engine.add_request(None, prompt, SamplingParams(max_tokens=2, structured_output=spec))
    while engine.has_unfinished_requests():
        engine.step()
    timer = {"mask": 0.0, "calls": 0}
    grammars = engine.sampler.grammars
    bitmask = grammars.bitmask  # (allowed, the unpacked form, computes its masks through it too)

    def timed_bitmask(matchers, out=None):
        t0 = time.perf_counter()
        try:
            return bitmask(matchers, out)
        finally:
            timer["mask"] += time.perf_counter() - t0
            timer["calls"] += 1

    grammars.bitmask = timed_bitmask
    runs = {"unconstrained": [], "json_schema": []}
    for _ in range(args.rounds):
        runs["unconstrained"].append(_run(engine, prompt, free, args.requests, timer))
        runs["json_schema"].append(_run(engine, prompt, constrained, args.requests, timer))
    best = {k: max(v, key=lambda r: r["decode_tps"]) for k, v in runs.items()}
    ratio = best["json_schema"]["decode_tps"] / max(best["unconstrained"]["decode_tps"], 1e-9)
    res = dict(requests=args.requests, tokens=args.tokens, rounds=args.rounds, best=best, runs=runs,
               constrained_vs_unconstrained=ratio, machine=machine())
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"kvinfer bench structured: {args.requests} concurrent requests x {args.tokens} tokens, "
          f"best of {args.rounds} runs each")
    print(machine_line())
    for name, r in best.items():
        mask = f", masks {r['mask_seconds'] * 1000 / max(1, r['mask_calls']):.2f} ms/step" \
            if name == "json_schema" else ""
        print(f"  {name:14s} decode {r['decode_tps']:8.1f} tokens/s ({r['decode_tokens']} tokens over "
              f"{r['decode_seconds']:.2f} s{mask})")
    print(f"  constrained / unconstrained: {ratio:.2f}x")
    return 0
