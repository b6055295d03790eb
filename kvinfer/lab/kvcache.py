"""The KV-cache lab: one model, one prompt, greedy decode with no cache, a contiguous and a paged cache."""
from __future__ import annotations

import csv
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from kvinfer.config import EngineConfig
from kvinfer.errors import KvinferError, ValidationError
from kvinfer.utils import format_bytes

BACKENDS = ("none", "contiguous", "paged")
LABELS = {"none": "no cache", "contiguous": "contiguous cache", "paged": "paged cache"}
DEFAULT_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
# Sized so `lab kvcache` takes about two minutes on the built-in model on a 2-core CPU (the none backend,
# quadratic in length, takes most of it).
DEFAULT_TOKENS = 256


class LabMismatchError(KvinferError):
    """The backends disagreed on the greedy output: a KV cache is supposed to change speed, never tokens."""


@dataclass
class StepRecord:
    token_index: int  # which generated token this step produced (0: the prefill step)
    context_len: int  # tokens the new token attends to
    fed_tokens: int  # tokens pushed through the model this step
    seconds: float  # wall time of the step
    kv_computed: int  # K/V projections computed this step, summed over layers
    kv_bytes: int  # KV memory held during the step (see BackendRun.kv_memory_note)
    cpu_seconds: float = 0.0  # this process's CPU time in the step: other processes cannot inflate it


@dataclass
class BackendRun:
    backend: str
    token_ids: list[int]
    steps: list[StepRecord] = field(default_factory=list)
    kv_formula: int = 0
    peak_kv_bytes: int = 0
    reserved_kv_bytes: int = 0
    kv_memory_note: str = ""
    logprobs: list[float] = field(default_factory=list)  # of each generated token, compared bit for bit

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def kv_computed(self) -> int:
        return sum(s.kv_computed for s in self.steps)

    @property
    def cpu_seconds(self) -> float:
        return sum(s.cpu_seconds for s in self.steps)


@dataclass
class LabResult:
    model: str
    dtype: str
    num_layers: int
    kv_bytes_per_token: int
    prompt_len: int
    num_tokens: int
    max_model_len: int
    block_size: int
    runs: dict[str, BackendRun]
    identical: bool = True
    mismatch: str = ""
    machine: str = ""  # CPUs, torch threads and load: wall times on a busy machine read differently


def kv_formula(backend: str, prompt_len: int, num_tokens: int, num_layers: int) -> int:
    """K/V projections a greedy run of num_tokens must compute (prefill unchunked).

    Without a cache, step i re-projects the whole sequence of prompt_len + i tokens; with one, every token is
    projected once, and the last generated token never is (nothing comes after it).
    """
    if backend == "none":
        return num_layers * (num_tokens * prompt_len + num_tokens * (num_tokens - 1) // 2)
    return num_layers * (prompt_len + num_tokens - 1)


def latency_trend(run: BackendRun, cpu: bool = False) -> dict:
    """Decode-step latency against position: least-squares slope and median(last tenth) / median(first tenth)."""
    dec = run.steps[1:]  # step 0 is the prefill
    if len(dec) < 2:
        return dict(slope_ms_per_1k=None, first_ms=None, last_ms=None, ratio=None)
    xs = [s.context_len for s in dec]
    ys = [(s.cpu_seconds if cpu else s.seconds) * 1000 for s in dec]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    k = max(1, len(dec) // 10)
    first = sorted(ys[:k])[k // 2]  # medians: one slow step (a page fault, a scheduler hiccup) is not a trend
    last = sorted(ys[-k:])[k // 2]
    return dict(slope_ms_per_1k=slope * 1000, first_ms=first, last_ms=last, ratio=last / first if first else None)


def _warm_up(engine, vocab: int) -> None:
    from kvinfer.sampling_params import SamplingParams

    # Other tokens than the prompt's, so nothing of the timed run is served from a cache.
    engine.add_request("warm-up", [min(7, vocab - 1)] * 4, SamplingParams(max_tokens=2, temperature=0.0,
                                                                          ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_backend(loaded, base: EngineConfig, backend: str, prompt_ids: Sequence[int], num_tokens: int,
                kv_cache_memory: int) -> BackendRun:
    """Generate num_tokens greedily for one request, timing every LLMEngine step."""
    from kvinfer.engine.llm_engine import LLMEngine
    from kvinfer.sampling_params import SamplingParams

    cfg = base.replace(kv_cache=backend, max_num_seqs=1, kv_cache_memory=kv_cache_memory,
                       enable_prefix_caching=False)
    engine = LLMEngine(cfg, loaded=loaded)
    # The same eager decoder for all three backends, so that the table compares cache layouts only (the
    # engine's fused C decode step exists for the paged backend alone).
    engine.runner.use_fused_decode = False
    mc = engine.model_config
    _warm_up(engine, mc.vocab_size)
    bpt = engine.kv_bytes_per_token
    used_blocks = [0]
    orig_schedule = engine.scheduler.schedule

    def schedule(*args):
        out = orig_schedule(*args)
        m = engine.kv_manager
        used_blocks[0] = m.num_units - m.num_free_units  # what this step's request holds
        return out

    engine.scheduler.schedule = schedule
    run = BackendRun(backend, [])
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    engine.add_request("lab", list(prompt_ids), params)
    p = len(prompt_ids)
    final = None
    while engine.has_unfinished_requests():
        i = len(run.steps)
        before = engine.kv_cache.kv_computed
        c0, t0 = time.process_time(), time.perf_counter()
        outs = engine.step()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        ctx = p + i
        fed = ctx if backend == "none" else (p if i == 0 else 1)
        if backend == "none":
            kv_bytes = ctx * bpt // mc.num_layers
        elif backend == "contiguous":
            kv_bytes = engine.kv_cache.nbytes
        else:
            kv_bytes = used_blocks[0] * engine.config.block_size * bpt
        run.steps.append(StepRecord(i, ctx, fed, dt, engine.kv_cache.kv_computed - before, kv_bytes, cpu))
        for o in outs:
            if o.finished:
                final = o
    assert final is not None and len(final.outputs[0].token_ids) == num_tokens
    run.token_ids = list(final.outputs[0].token_ids)
    run.logprobs = [lp.logprob for lp in final.outputs[0].logprobs]
    run.kv_formula = kv_formula(backend, p, num_tokens, mc.num_layers)
    run.peak_kv_bytes = max(s.kv_bytes for s in run.steps)
    run.reserved_kv_bytes = engine.kv_cache.nbytes
    bs = engine.config.block_size
    if backend == "none":
        run.kv_memory_note = (f"transient: one layer's K/V of the longest step ({p + num_tokens - 1} tokens); "
                              f"each layer drops its K/V when it returns")
    elif backend == "contiguous":
        run.kv_memory_note = f"one reserved slot of {engine.max_model_len} tokens, used or not"
    else:
        blocks = run.peak_kv_bytes // (bs * bpt)
        run.kv_memory_note = (f"{blocks} blocks x {format_bytes(bs * bpt)} ({bs} tokens) in use, "
                              f"of a {format_bytes(run.reserved_kv_bytes)} pool")
    return run


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_identical(result: LabResult) -> None:
    """Record whether every backend produced the same greedy tokens and bitwise the same logprobs."""
    names = list(result.runs)
    ref = result.runs[names[0]]
    for name in names[1:]:
        other = result.runs[name]
        if other.token_ids != ref.token_ids:
            i = _first_difference(ref.token_ids, other.token_ids)
            a = ref.token_ids[i] if i < len(ref.token_ids) else None
            b = other.token_ids[i] if i < len(other.token_ids) else None
            result.identical = False
            result.mismatch = (f"greedy outputs differ: {LABELS[ref.backend]} and {LABELS[name]} first disagree at "
                               f"generated token {i} (token id {a} vs {b})")
            return
        if other.logprobs != ref.logprobs:
            i = _first_difference(ref.logprobs, other.logprobs)
            result.identical = False
            result.mismatch = (f"logprobs differ: {LABELS[ref.backend]} and {LABELS[name]} first disagree at "
                               f"generated token {i} ({ref.logprobs[i]!r} vs {other.logprobs[i]!r})")
            return


def prompt_token_ids(engine_or_tokenizer, prompt: Optional[str], prompt_tokens: Optional[int], vocab: int,
                     seed: int = 0) -> list[int]:
    """The prompt as token ids: the chat-templated text, or prompt_tokens seeded random ids (no tokenizer)."""
    tok = engine_or_tokenizer
    if prompt_tokens is not None or tok is None:
        import random

        n = prompt_tokens if prompt_tokens is not None else 16
        if n < 1:
            raise ValidationError("prompt_tokens", n, "must be >= 1")
        rng = random.Random(seed)
        low = min(100, vocab - 1)
        return [rng.randrange(low, vocab) for _ in range(n)]
    prompt = prompt or DEFAULT_PROMPT
    try:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    except KvinferError:
        return tok.encode(prompt)  # no usable chat template: the raw text
    return tok.encode(text, add_special_tokens=False)


def run_lab(base: EngineConfig, num_tokens: int = DEFAULT_TOKENS, prompt: Optional[str] = None,
            prompt_tokens: Optional[int] = None, backends: Sequence[str] = BACKENDS, loaded=None,
            progress=None) -> LabResult:
    """Load the model once and run each backend on the same prompt; the result says whether outputs matched."""
    from kvinfer.loaders.model_loader import load_model

    if num_tokens < 1:
        raise ValidationError("tokens", num_tokens, "must be >= 1")
    for b in backends:
        if b not in BACKENDS:
            raise ValidationError("backends", b, f"must be one of {', '.join(BACKENDS)}")
    loaded = loaded or load_model(base)
    mc = loaded.config
    ids = prompt_token_ids(loaded.tokenizer, prompt, prompt_tokens, mc.vocab_size, base.seed)
    max_len = base.max_model_len or mc.max_position_embeddings
    if len(ids) + num_tokens > max_len:
        raise ValidationError("tokens", num_tokens,
                              f"prompt ({len(ids)} tokens) + tokens exceeds max_model_len={max_len}")
    import torch

    from kvinfer.config import kv_element_bytes

    bpt = mc.kv_bytes_per_token(*kv_element_bytes(base.kv_cache_dtype, mc.head_dim,
                                                  torch.empty((), dtype=loaded.dtype).element_size()))
    # One max-length slot's worth for every backend: the contiguous cache reserves exactly that, and the
    # paged pool gets the same bytes so what differs is how much of it is used.
    budget = base.kv_cache_memory or bpt * max_len
    runs = {}
    for b in backends:
        if progress:
            progress(f"{LABELS[b]}: generating {num_tokens} tokens ...")
        runs[b] = run_backend(loaded, base.replace(max_model_len=max_len), b, ids, num_tokens, budget)
        if progress:
            progress(f"{LABELS[b]}: {runs[b].total_seconds:.1f} s")
    src = loaded.source
    name = src.path.name if src.path is not None else str(base.model)
    result = LabResult(model=f"{name} ({src.kind})", dtype=str(loaded.dtype).replace("torch.", ""),
                       num_layers=mc.num_layers, kv_bytes_per_token=bpt, prompt_len=len(ids),
                       num_tokens=num_tokens, max_model_len=max_len, block_size=base.block_size, runs=runs)
    result.machine = _machine()
    check_identical(result)
    return result


def _machine() -> str:
    import os

    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    threads = torch.get_num_threads()
    return (f"{os.cpu_count()} CPUs, {threads} torch thread{'s' if threads > 1 else ''}, "
            f"load average {load:.1f} at the end")


# ---- reporting -------------------------------------------------------------------------------------
def summary(result: LabResult) -> dict:
    """Everything the table says, as plain data (the --json output)."""
    none = result.runs.get("none")
    out = dict(model=result.model, dtype=result.dtype, num_layers=result.num_layers, machine=result.machine,
               kv_bytes_per_token=result.kv_bytes_per_token, prompt_tokens=result.prompt_len,
               generated_tokens=result.num_tokens, max_model_len=result.max_model_len, block_size=result.block_size,
               outputs_identical=result.identical, mismatch=result.mismatch or None, backends={})
    n = result.prompt_len + result.num_tokens
    for name, r in result.runs.items():
        out["backends"][name] = dict(
            total_seconds=r.total_seconds, cpu_seconds=r.cpu_seconds, kv_computed=r.kv_computed,
            kv_formula=r.kv_formula,
            kv_seed_estimate=n * n // 2 if name == "none" else n,
            peak_kv_bytes=r.peak_kv_bytes, reserved_kv_bytes=r.reserved_kv_bytes, kv_memory_note=r.kv_memory_note,
            ttft_ms=r.steps[0].seconds * 1000, latency=latency_trend(r), cpu_latency=latency_trend(r, cpu=True),
            speedup_vs_none=(none.total_seconds / r.total_seconds) if none and r.total_seconds else None,
            tokens_per_second=result.num_tokens / r.total_seconds if r.total_seconds else None)
    return out


def _fmt_trend(t: dict) -> str:
    if t["ratio"] is None:
        return "n/a (fewer than 3 steps)"
    return (f"{t['first_ms']:.1f} -> {t['last_ms']:.1f} ms (last/first {t['ratio']:.2f}x; "
            f"{t['slope_ms_per_1k']:+.2f} ms per 1k context)")


def markdown_table(result: LabResult) -> str:
    s = summary(result)
    names = list(result.runs)
    head = "| | " + " | ".join(LABELS[b] for b in names) + " |"
    sep = "|---|" + "---|" * len(names)
    b = s["backends"]
    rows = [
        ("per-token latency trend (decode steps, wall)", [_fmt_trend(b[n]["latency"]) for n in names]),
        ("per-token CPU-time trend (immune to other processes)", [_fmt_trend(b[n]["cpu_latency"]) for n in names]),
        ("total K/V computations: measured (formula)",
         [f"{b[n]['kv_computed']:,} ({b[n]['kv_formula']:,})" for n in names]),
        ("textbook estimate (n²/2 without a cache, n with one; n = prompt + generated)",
         [f"{b[n]['kv_seed_estimate']:,} x {result.num_layers} layers = "
          f"{b[n]['kv_seed_estimate'] * result.num_layers:,}" for n in names]),
        ("total time (wall; this process's CPU)",
         [f"{b[n]['total_seconds']:.2f} s ({b[n]['tokens_per_second']:.1f} tok/s); CPU {b[n]['cpu_seconds']:.2f} s"
          for n in names]),
        ("speedup vs no cache", [f"{b[n]['speedup_vs_none']:.2f}x" if b[n]["speedup_vs_none"] else "n/a"
                                 for n in names]),
        ("KV memory (peak)", [f"{format_bytes(b[n]['peak_kv_bytes'])}: {b[n]['kv_memory_note']}" for n in names]),
    ]
    lines = [
        f"# KV-cache lab: {result.model}, {result.dtype}",
        "",
        f"Prompt {result.prompt_len} tokens, {result.num_tokens} tokens generated greedily (ignore_eos), "
        f"{result.num_layers} layers, {format_bytes(result.kv_bytes_per_token)} of K/V per token, "
        f"max_model_len {result.max_model_len}, block size {result.block_size}. Machine: {result.machine or '?'}.",
        f"Tokens and logprobs bitwise identical across backends: "
        f"{'yes' if result.identical else 'NO — ' + result.mismatch}.",
        "",
        head, sep,
    ]
    for label, cells in rows:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("K/V computations count one K and V projection of one token in one layer. Latency is the wall "
                 "time of each LLMEngine step; step 0 is the prefill. All three backends run the same eager decoder "
                 "(the engine's fused C decode step is off here), so the columns differ by cache layout only.")
    return "\n".join(lines) + "\n"


def write_csv(result: LabResult, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["backend", "token_index", "context_len", "fed_tokens", "step_ms", "cpu_ms", "kv_computed",
                    "kv_computed_cumulative", "kv_bytes"])
        for name, r in result.runs.items():
            cum = 0
            for s in r.steps:
                cum += s.kv_computed
                w.writerow([name, s.token_index, s.context_len, s.fed_tokens, f"{s.seconds * 1000:.3f}",
                            f"{s.cpu_seconds * 1000:.3f}", s.kv_computed, cum, s.kv_bytes])


def write_plots(result: LabResult, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colors = {"none": "tab:red", "contiguous": "tab:blue", "paged": "tab:green"}

    fig, (ax, ax_cpu) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, r in result.runs.items():
        xs = [s.context_len for s in r.steps]
        ax.plot(xs, [s.seconds * 1000 for s in r.steps], lw=1, color=colors[name], label=LABELS[name])
        ax_cpu.plot(xs, [s.cpu_seconds * 1000 for s in r.steps], lw=1, color=colors[name], label=LABELS[name])
    ax.set_ylabel("step latency, wall (ms)")
    ax_cpu.set_ylabel("step CPU time, this process (ms)")
    ax_cpu.set_xlabel("position (tokens in context)")
    title = f"Per-token latency by position (log scale): {result.model}\n{result.machine}"
    ax.set_title("\n".join(textwrap.fill(line, 100) for line in title.split("\n")), fontsize=9)
    ax.legend()
    for a in (ax, ax_cpu):
        # Log scale: the cached backends are ~50x below the no-cache line and would lie flat on a linear axis.
        a.set_yscale("log")
        a.grid(alpha=0.3, which="both")
    fig.tight_layout()
    paths.append(out / "latency_by_position.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in result.runs.items():
        cum, ys = 0, []
        for s in r.steps:
            cum += s.kv_computed
            ys.append(cum)
        ax.plot([s.token_index + 1 for s in r.steps], ys, color=colors[name], label=f"{LABELS[name]} (measured)")
    n = range(1, result.num_tokens + 1)
    p, layers = result.prompt_len, result.num_layers
    if "none" in result.runs:
        ax.plot(n, [kv_formula("none", p, k, layers) for k in n], "k--", lw=0.8, label="formula, no cache")
    ax.plot(n, [kv_formula("paged", p, k, layers) for k in n], "k:", lw=0.8, label="formula, with a cache")
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("K/V projections computed (cumulative, all layers)")
    ax.set_title("Cumulative K/V computations (log scale)")
    ax.set_yscale("log")  # n²/2 against n: on a linear axis the cached lines sit on zero
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    paths.append(out / "kv_computations.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in result.runs.items():
        ax.plot([s.context_len for s in r.steps], [s.kv_bytes / 2**20 for s in r.steps], color=colors[name],
                label=LABELS[name])
    ax.set_xlabel("position (tokens in context)")
    ax.set_ylabel("KV memory held (MiB)")
    ax.set_title("KV memory by position (no cache: one layer's transient K/V)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "kv_memory.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def write_outputs(result: LabResult, out: Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / "kvcache_lab.csv", "table": out / "kvcache_lab.md"}
    write_csv(result, files["csv"])
    files["table"].write_text(markdown_table(result))
    for p in write_plots(result, out):
        files[p.stem] = p
    return files
