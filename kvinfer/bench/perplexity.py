"""`kvinfer perplexity`: a text's perplexity under the engine, chunked and scored as llama.cpp's llama-perplexity
does it, so the two can be compared on the same GGUF and text.

The text is tokenized once and cut into chunks of --context tokens (a partial last chunk is dropped); with a
tokenizer that adds BOS, each chunk's first token becomes BOS. Each chunk is one request with prompt logprobs, all
of them batched through the engine (so the figure covers whatever the engine runs: KV cache dtype and backend,
quantization, kernels); the second half of each chunk is scored, the first half being its context. Perplexity is
exp(mean negative log-likelihood) over the scored tokens; the +/- is its standard error (that of the mean NLL,
times the perplexity).
"""
from __future__ import annotations

import json
import math
import sys
import time
from typing import Optional, Sequence


def chunk_tokens(ids: Sequence[int], context: int, bos: Optional[int]) -> list[list[int]]:
    """Whole chunks of `context` tokens, each starting with `bos` when given."""
    chunks = [list(ids[i:i + context]) for i in range(0, len(ids) - context + 1, context)]
    if bos is not None:
        for c in chunks:
            c[0] = bos
    return chunks


def scored_nll(prompt_logprobs: Sequence, context: int) -> list[float]:
    """Negative log-likelihoods of a chunk's scored tokens: those after its first half (llama.cpp's `first`,
    context / 2, is the last position whose logits are not scored)."""
    first = context // 2
    return [-prompt_logprobs[j].logprob for j in range(first + 1, context)]


def perplexity(nll: Sequence[float]) -> tuple[float, float]:
    """(perplexity, its standard error) from per-token negative log-likelihoods."""
    n = len(nll)
    mean = sum(nll) / n
    var = sum((x - mean) ** 2 for x in nll) / (n - 1) if n > 1 else 0.0
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(var / n)


def evaluate(engine, chunks: list[list[int]], context: int) -> tuple[list[float], list[int]]:
    """All chunks through the engine at once; the scored NLLs in chunk order and how many each chunk has."""
    from kvinfer.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ids = [engine.add_request(None, c, sp) for c in chunks]
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = scored_nll(o.prompt_logprobs, context)
    per = [got[i] for i in ids]
    return [x for p in per for x in p], [len(p) for p in per]


def cmd_perplexity(args) -> int:
    from kvinfer.bench import machine, machine_line
    from kvinfer.bench.cli import _bits_note, _model_label, _threads
    from kvinfer.cli import engine_config_from_args
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.errors import ValidationError

    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
    except OSError as e:
        raise ValidationError("file", args.file, f"cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValidationError("file", args.file, "is not UTF-8 text") from None
    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    if tok is None:
        raise ValidationError("model", args.model, "has no tokenizer; perplexity is of a text (--tokenizer DIR)")
    if args.context > engine.max_model_len:
        raise ValidationError("context", args.context, f"must be <= the context window ({engine.max_model_len})")
    ids = tok.encode(text)
    chunks = chunk_tokens(ids, args.context, tok.bos_token_id if tok.add_bos_token else None)
    if args.chunks is not None:
        chunks = chunks[:args.chunks]
    if not chunks:
        raise ValidationError("file", args.file, f"has {len(ids)} tokens; --context {args.context} needs at least "
                                                 f"{args.context}")
    t0 = time.perf_counter()
    nll, counts = evaluate(engine, chunks, args.context)
    secs = time.perf_counter() - t0
    ppl, err = perplexity(nll)
    evaluated = len(chunks) * args.context
    if args.json:
        print(json.dumps(dict(model=_model_label(engine), machine=machine(), threads=_threads(),
                              kv_cache_dtype=engine.kv_dtype, context=args.context, chunks=len(chunks),
                              scored_tokens=len(nll), text_tokens=len(ids), perplexity=ppl, stderr=err,
                              mean_nll=sum(nll) / len(nll), seconds=secs, tokens_per_second=evaluated / secs),
                         indent=2))
        return 0
    print(f"kvinfer perplexity: {_model_label(engine)}, {_threads()} threads, KV cache {engine.kv_dtype}"
          f"{_bits_note(engine)}; "
          f"{args.file}: {len(ids)} tokens, {len(chunks)} chunks of {args.context} (the second half of each scored)")
    print(machine_line())
    running, start = [], 0
    for i, c in enumerate(counts):  # llama-perplexity's running estimate after each chunk
        start += c
        running.append(f"[{i + 1}]{math.exp(sum(nll[:start]) / start):.4f}")
    print(",".join(running))
    print(f"perplexity {ppl:.4f} +/- {err:.4f} over {len(nll)} scored tokens (mean NLL {sum(nll) / len(nll):.4f}); "
          f"{evaluated} tokens evaluated in {secs:.2f} s ({evaluated / secs:.1f} tok/s)")
    return 0


def register(sub) -> None:
    from kvinfer.cli import add_engine_args, int_at_least

    p = sub.add_parser("perplexity", help="perplexity of a text file, chunked as llama.cpp's llama-perplexity",
                       description="Perplexity of a UTF-8 text under the model and engine settings given: the text "
                                   "in chunks of --context tokens (BOS first when the tokenizer adds one), all "
                                   "chunks batched, the second half of each chunk scored (llama.cpp's "
                                   "llama-perplexity method, so the two compare on the same GGUF).")
    p.add_argument("file", help="the text file ('-' reads standard input)")
    p.add_argument("--context", type=int_at_least("--context", 4), default=512,
                   help="tokens per chunk (default 512, at least 4)")
    p.add_argument("--chunks", type=int_at_least("--chunks"), default=None, help="score only the first N chunks")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_engine_args(p)
    p.set_defaults(func=cmd_perplexity)
