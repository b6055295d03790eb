"""Scheduling simulator: the engine's Scheduler and KV managers over a request trace on a virtual clock."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from kvinfer.config import ModelConfig, kv_element_bytes
from kvinfer.errors import KvinferError, RequestTooLargeError, ValidationError
from kvinfer.kv.factory import kv_layout, make_manager
from kvinfer.core.request import Request
from kvinfer.sampling_params import SamplingParams
from kvinfer.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvinfer.utils import format_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class SimulationError(KvinferError):
    """The simulated engine can make no progress (a scheduler bug: the scheduler's tests say it never stalls)."""


# ---- the step-time cost model -------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """Seconds of one engine step. A step the scheduler plans (prefill chunks, mixed, lone decode steps):
    a + b*num_batched_tokens + c*num_decode_seqs + d*sum_context_tokens. A step of a fused multi-step decode call
    (every running request decoding, none waiting: the engine's --num-scheduler-steps path): e + f*num_decode_seqs +
    g*sum_context_tokens; with e, f and g all 0 such a step is charged as a planned one."""

    a: float
    b: float
    c: float
    d: float
    e: float = 0.0
    f: float = 0.0
    g: float = 0.0
    source: str = "given"
    # Shapes of the model the coefficients were measured on, to scale them to other shapes (0: do not scale).
    fitted_parameters: int = 0
    fitted_attention_width: int = 0  # num_layers * num_heads * head_dim

    @staticmethod
    def features(out: SchedulerOutput) -> tuple[float, int, int, int]:
        decode = sum(1 for s in out.scheduled if s.num_new_tokens == 1 and s.start > 0)
        return 1.0, out.num_batched_tokens, decode, sum(s.end for s in out.scheduled)

    @property
    def has_fused(self) -> bool:
        return bool(self.e or self.f or self.g)

    def step_time(self, out: SchedulerOutput, fused: bool = False) -> float:
        one, n, dec, ctx = self.features(out)
        if fused and self.has_fused:
            return self.e * one + self.f * n + self.g * ctx
        return self.a * one + self.b * n + self.c * dec + self.d * ctx

    def step_time_of(self, sample: dict) -> float:
        """The step time of a timed step as StepRecorder records it."""
        if sample["kind"] == "fused" and self.has_fused:
            return self.e + self.f * sample["num_decode_seqs"] + self.g * sample["sum_context_tokens"]
        return (self.a + self.b * sample["num_batched_tokens"] + self.c * sample["num_decode_seqs"]
                + self.d * sample["sum_context_tokens"])

    @property
    def coefficients(self) -> tuple[float, ...]:
        return self.a, self.b, self.c, self.d, self.e, self.f, self.g

    def scaled_to(self, cfg: ModelConfig) -> "CostModel":
        """Per-token work (b, f) scales with parameters, attention work (d, g) with layers x heads x head_dim."""
        if not self.fitted_parameters:
            return self
        params = cfg.num_parameters()
        width = cfg.num_layers * cfg.num_heads * cfg.head_dim
        if params == self.fitted_parameters and width == self.fitted_attention_width:
            return self
        rp, rw = params / self.fitted_parameters, width / self.fitted_attention_width
        return replace(self, b=self.b * rp, d=self.d * rw, f=self.f * rp, g=self.g * rw, fitted_parameters=0,
                       fitted_attention_width=0,
                       source=f"{self.source}; b, f scaled x{rp:.2f} (parameters), d, g x{rw:.2f} (attention width) "
                              f"to this model's shapes")


# Calibrated by `kvinfer simulate --bench --synthetic 64` (two short calibrations around bench throughput's run of the
# same workload) on the project's 2-core AMD EPYC (AVX-512, no AMX) with the fused decode calls; its error against
# that run is in docs/BENCHMARKS.md ("Simulator against bench throughput"). Re-fit on another machine with --fit,
# or check it there with --bench.
FITTED = CostModel(
    a=0.00257152, b=0.00058455, c=0.0, d=4.53816e-07, e=0.00247995, f=0.000690372, g=1.89577e-07,
    source="fitted 2026-12-06 on AMD EPYC, 2 CPUs, 2 torch threads, load average 2.0, wall clock, built-in "
           "SmolLM2-135M-Instruct Q4_1 as float32, 50 of 56 timed steps and calls",
    fitted_parameters=134515008, fitted_attention_width=30 * 9 * 64,
)


# Gloo on loopback, measured by `python -m kvinfer.parallel.measure 3` on the 2-core EPYC, load ~8 (docs/BENCHMARKS.md): the
# start-up cost of one collective and the bytes/s beyond it. NCCL over NVLink is ~10 us and ~100+ GB/s.
GLOO_LOOPBACK_LATENCY_S = 1.1e-3
GLOO_LOOPBACK_BANDWIDTH = 0.32e9


@dataclass(frozen=True)
class TPCost:
    """A TP 1 cost model under tensor parallelism N: per-token, per-sequence and attention work (b, c, d) split N
    ways (the per-step overhead a is not), plus the step's collectives at `latency_s` each and `bandwidth` bytes/s
    per rank, counted as the engine runs them: per layer 4 all-gathers (exact, the default) or 2 all-reduces
    (KVINFER_TP_EXACT=0), then one gather of the sampled rows' vocabulary slices to rank 0."""

    base: CostModel
    tp: int
    cfg: ModelConfig
    latency_s: float = GLOO_LOOPBACK_LATENCY_S
    bandwidth: float = GLOO_LOOPBACK_BANDWIDTH  # bytes/s
    exact: bool = True
    dtype_bytes: int = 4  # activations: float32 on CPU

    @property
    def a(self) -> float:
        return self.base.a

    @property
    def b(self) -> float:
        return self.base.b / self.tp

    @property
    def c(self) -> float:
        return self.base.c / self.tp

    @property
    def d(self) -> float:
        return self.base.d / self.tp

    @property
    def source(self) -> str:
        route = "4 all-gathers" if self.exact else "2 all-reduces"
        return (f"{self.base.source}; tensor parallel {self.tp}: b, c, d / {self.tp}, plus {route} per layer and a "
                f"logits gather at {self.latency_s * 1e6:.0f} us + bytes / {self.bandwidth / 1e9:.3g} GB/s each")

    def comm_time(self, out: SchedulerOutput) -> float:
        """Seconds of one step's collectives (ring algorithms: each rank moves (N-1)/N of an all-gather's result,
        twice that for an all-reduce)."""
        if self.tp == 1:
            return 0.0
        c, n = self.cfg, out.num_batched_tokens
        share = (self.tp - 1) / self.tp
        if self.exact:
            per_layer = [c.q_size, c.hidden_size, c.intermediate_size, c.hidden_size]
            moved = sum(per_layer) * share
        else:
            per_layer = [c.hidden_size, c.hidden_size]
            moved = sum(per_layer) * 2 * share
        rows = sum(1 for s in out.scheduled if s.end >= s.request.num_tokens)  # sampled rows
        calls = len(per_layer) * c.num_layers + (1 if rows else 0)
        nbytes = (moved * n * c.num_layers + rows * c.vocab_size * share) * self.dtype_bytes
        return calls * self.latency_s + nbytes / self.bandwidth

    def step_time(self, out: SchedulerOutput, fused: bool = False) -> float:
        """The engine under tensor parallelism takes no fused multi-step decode path: every step is planned."""
        one, n, dec, ctx = CostModel.features(out)
        return self.a * one + self.b * n + self.c * dec + self.d * ctx + self.comm_time(out)


def parse_cost_model(text: str) -> CostModel:
    """'fitted' or 'a,b,c,d[,e,f,g]' (seconds; missing trailing coefficients are 0)."""
    if text == "fitted":
        return FITTED
    expected = "expected 'fitted' or up to seven numbers a,b,c,d,e,f,g"
    parts = [p.strip() for p in text.split(",")]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise ValidationError("cost_model", text, expected) from None
    if not 1 <= len(vals) <= 7 or any(not math.isfinite(v) or v < 0 for v in vals):
        raise ValidationError("cost_model", text, f"{expected}, each >= 0")
    if not any(vals[:4]):
        raise ValidationError("cost_model", text, "at least one of a, b, c, d must be > 0 (time must advance)")
    vals += [0.0] * (7 - len(vals))
    return CostModel(*vals, source=f"given: {text}")


def _nonneg_lstsq(x, y, w):
    """Weighted least squares with every coefficient >= 0: the best feasible fit over the subsets of columns."""
    import itertools

    import numpy as np

    xw, yw = x * w[:, None], y * w
    best = None
    k = x.shape[1]
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(k)
            full[list(cols)] = coef
            err = float(((xw @ full - yw) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, full)
    return best[1]


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# (requests, shared prompt tokens, own prompt tokens, new tokens) of the calibration runs: prefill steps like the
# throughput workload's (up to max_num_batched_tokens, one to many prompts each), then decode batches of 1 to 32 at
# short and long contexts (the long one from a prefix the requests share, computed once, through the prefix cache);
# the first PLANNED_DECODES decode steps of each run go through the scheduler, the rest through fused calls.
CALIBRATION = ((1, 0, 64, 17), (4, 0, 512, 17), (32, 0, 16, 17), (32, 512, 16, 17))
PLANNED_DECODES = 3


def fit_samples(samples: list[dict], drop_outliers: bool = True) -> tuple[list[float], list[float], list[bool]]:
    """The planned-step coefficients (a, b, c, d) and the fused-step ones (e, f, g) that fit timed steps best in
    relative error (a 20 ms decode step counts as much as a 1 s prefill), every coefficient >= 0; steps that
    another process stalled (far off the others' fit) are dropped, worst first, up to a quarter of them. Each sample:
    kind ("planned" or "fused"), seconds (one step's), num_batched_tokens, num_decode_seqs, sum_context_tokens."""
    import numpy as np

    keep = [True] * len(samples)
    coefs = []
    for kind, cols in (("planned", ("num_batched_tokens", "num_decode_seqs", "sum_context_tokens")),
                       ("fused", ("num_decode_seqs", "sum_context_tokens"))):
        idx = [i for i, s in enumerate(samples) if s["kind"] == kind]
        if not idx:
            coefs.append([0.0] * (1 + len(cols)))
            continue
        x = np.array([[1.0] + [float(samples[i][c]) for c in cols] for i in idx])
        y = np.array([float(samples[i]["seconds"]) for i in idx])
        ok = np.ones(len(idx), dtype=bool)
        coef = _nonneg_lstsq(x, y, 1.0 / y)
        # Drop the worst step while it is far off the others' fit (a quarter of the steps at most), refitting each time.
        while drop_outliers and ok.sum() > max(len(cols) + 2, 3 * len(idx) // 4):
            rel = np.abs(x @ coef - y) / y
            worst = int(np.argmax(np.where(ok, rel, -1.0)))
            if rel[worst] <= max(3 * float(np.median(rel[ok])), 0.05):
                break
            ok[worst] = False
            coef = _nonneg_lstsq(x[ok], y[ok], 1.0 / y[ok])
        for i, k in zip(idx, ok):
            keep[i] = bool(k)
        coefs.append([float(c) for c in coef])
    return coefs[0], coefs[1], keep


class StepRecorder:
    """While active, times every engine.step(): a planned step (one the scheduler plans) with its features, or a
    fused multi-step decode call as its mean step, in the samples fit_samples() takes."""

    def __init__(self, engine, timer: Optional[Callable[[], float]] = None):
        import time

        self.engine, self.timer = engine, timer or time.perf_counter
        self.samples: list[dict] = []

    def __enter__(self) -> "StepRecorder":
        eng = self.engine
        sched = eng.scheduler
        orig_schedule, orig_step = sched.schedule, eng.step
        captured: list[SchedulerOutput] = []

        def schedule(*args):
            out = orig_schedule(*args)
            captured.append(out)
            return out

        def step():
            batch = len(sched.running)
            ctx = sum(r.num_tokens for r in sched.running)
            steps0 = eng.stats["steps"]
            captured.clear()
            t0 = self.timer()
            outs = orig_step()
            dt = self.timer() - t0
            steps = eng.stats["steps"] - steps0
            if steps < 1 or (captured and captured[0].is_empty):
                return outs
            if captured and not captured[0].decode_steps:
                _, n, dec, c = CostModel.features(captured[0])
                self.samples.append(dict(kind="planned", seconds=dt, steps=1, num_batched_tokens=n,
                                         num_decode_seqs=dec, sum_context_tokens=c))
            else:  # a fused call of `steps` decode steps: its mean step
                self.samples.append(dict(kind="fused", seconds=dt / steps, steps=steps, num_batched_tokens=batch,
                                         num_decode_seqs=batch, sum_context_tokens=ctx + batch * (steps - 1) / 2))
            return outs

        sched.schedule, eng.step = schedule, step
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.scheduler.schedule, self.engine.step

    def seconds(self, kind: str) -> float:
        return sum(s["seconds"] * s["steps"] for s in self.samples if s["kind"] == kind)

    def steps(self, kind: str) -> int:
        return sum(s["steps"] for s in self.samples if s["kind"] == kind)


def cost_model_from_samples(samples: list[dict], source: str, mc: Optional[ModelConfig] = None,
                            drop_outliers: bool = True) -> CostModel:
    """fit_samples() as a CostModel (its shapes recorded from `mc` for scaled_to); marks each sample's `outlier`
    and `predicted` seconds."""
    planned, fused, keep = fit_samples(samples, drop_outliers)
    for s, k in zip(samples, keep):
        s["outlier"] = not k
        s["predicted"] = (planned[0] + planned[1] * s["num_batched_tokens"] + planned[2] * s["num_decode_seqs"]
                          + planned[3] * s["sum_context_tokens"]) if s["kind"] == "planned" else (
                          fused[0] + fused[1] * s["num_decode_seqs"] + fused[2] * s["sum_context_tokens"])
    seconds = sum(s["seconds"] * s["steps"] for s in samples)
    return CostModel(*planned, *fused, source=f"{source}, {sum(keep)} of {len(samples)} timed steps and calls "
                                              f"({seconds:.1f} s)",
                     fitted_parameters=mc.num_parameters() if mc else 0,
                     fitted_attention_width=mc.num_layers * mc.num_heads * mc.head_dim if mc else 0)


def calibrate(engine, progress: Optional[Callable[[str], None]] = None, clock: str = "wall",
              plan: Sequence[tuple[int, int, int, int]] = CALIBRATION,
              earlier: Sequence[dict] = ()) -> tuple[CostModel, list[dict]]:
    """Time a few seconds of the engine's own steps (`plan`'s runs, clipped to its limits) and fit the cost model.

    clock "wall" times what a user waits for; "cpu" counts this process's CPU time, which other processes on a
    shared machine cannot inflate (use it with one torch thread, where CPU time is the uncontended wall time).
    Seeded random prompts, greedy, ignore_eos: they share no block with the throughput workload or with one
    another, except a prefix shared on purpose (without prefix caching it is computed for each request).
    Returns the cost model, fitted on the timed steps and `earlier` ones (an earlier calibration's), and the timed
    steps."""
    import datetime
    import os
    import platform
    import time

    import torch

    if clock not in ("wall", "cpu"):
        raise ValidationError("fit_clock", clock, "must be wall or cpu")
    cfg = engine.config
    vocab = engine.model_config.vocab_size
    rng = random.Random(0x5eed)
    sched = engine.scheduler

    def add(prefix: list[int], own: int, out_tokens: int) -> None:
        ids = prefix + [rng.randrange(min(100, vocab - 1), vocab) for _ in range(own)]
        engine.add_request(None, ids, SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True))

    def step(plain: bool) -> None:
        if plain:  # through the scheduler: the step the engine takes when a call cannot be fused
            engine._multi_step = lambda spec: None
        try:
            engine.step()
        finally:
            if plain:
                del engine._multi_step

    def run(batch: int, shared: int, own: int, out_tokens: int) -> None:
        batch = min(batch, cfg.max_num_seqs, 32 if cfg.enable_prefix_caching or not shared else 4)
        shared = min(shared, max(0, engine.max_model_len - out_tokens - own))
        own = max(1, min(own, engine.max_model_len - out_tokens - shared))
        prefix = [rng.randrange(min(100, vocab - 1), vocab) for _ in range(shared)]
        if shared and cfg.enable_prefix_caching and batch > 1:  # the prefix computed once, then shared
            add(prefix, own, out_tokens)
            while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
                step(False)
            batch -= 1
        for _ in range(batch):
            add(prefix if cfg.enable_prefix_caching else
                [rng.randrange(min(100, vocab - 1), vocab) for _ in range(shared)], own, out_tokens)
        planned_decodes = 0
        while engine.has_unfinished_requests():
            plain = (not sched.waiting and all(r.num_output_tokens > 0 for r in sched.running)
                     and planned_decodes < PLANNED_DECODES)
            planned_decodes += plain
            step(plain)

    run(2, 0, 32, 12)  # warm-up: first calls of each kernel, the fused path
    with StepRecorder(engine, time.perf_counter if clock == "wall" else time.process_time) as rec:
        for b, shared, own, o in plan:
            if progress:
                what = f"{shared} shared + {own}" if shared else f"{own}"
                progress(f"calibrating: {b} request(s) of {what} prompt tokens, {o} new tokens each")
            run(b, shared, own, o)
    src = engine.loaded.source
    name = src.path.name if src.path is not None else str(cfg.model)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine = (f"{_cpu_name() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"{torch.get_num_threads()} torch thread(s), load average {load:.1f}, {clock} clock")
    model = cost_model_from_samples(
        list(earlier) + rec.samples, f"fitted {datetime.date.today().isoformat()} on {machine}, {name} "
                     f"{str(engine.loaded.dtype).replace('torch.', '')}", engine.model_config)
    return model, rec.samples


def fit_cost_model(engine_config, progress: Optional[Callable[[str], None]] = None,
                   clock: str = "wall") -> tuple[CostModel, list[dict]]:
    """Load the model with `engine_config` (paged KV cache) and calibrate() the cost model on it."""
    from kvinfer.engine.llm_engine import LLMEngine

    if clock not in ("wall", "cpu"):
        raise ValidationError("fit_clock", clock, "must be wall or cpu")
    engine = LLMEngine(engine_config.replace(kv_cache="paged"))
    try:
        return calibrate(engine, progress, clock)
    finally:
        engine.close()


# ---- traces ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    prompt_token_ids: Optional[tuple[int, ...]] = None


def load_trace(path: str) -> list[TraceRequest]:
    """JSONL lines {"arrival": s, "prompt_tokens": n, "output_tokens": m}; errors name the line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValidationError("trace", path, f"cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValidationError("trace", path, "is not a text (JSONL) file") from None
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValidationError("trace", where, f"not JSON: {e.msg}") from None
        if not isinstance(d, dict):
            raise ValidationError("trace", where, "each line must be a JSON object")
        for key in ("prompt_tokens", "output_tokens"):
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValidationError("trace", where, f"{key} must be an integer >= 1, got {v!r}")
        a = d.get("arrival", 0.0)
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a) or a < 0:
            raise ValidationError("trace", where, f"arrival must be a number of seconds >= 0, got {a!r}")
        out.append(TraceRequest(float(a), d["prompt_tokens"], d["output_tokens"]))
    if not out:
        raise ValidationError("trace", path, "has no requests")
    return out


def synthetic_trace(num_requests: int = 64, seed: int = 0, vocab_size: int = 49152) -> list[TraceRequest]:
    """The `bench throughput` workload: prompt 16-512, output 16-256 uniform, all arriving at t=0."""
    from kvinfer.bench.workload import throughput_workload

    if num_requests < 1:
        raise ValidationError("synthetic", num_requests, "must be >= 1")
    work = throughput_workload(num_requests, seed, vocab_size=vocab_size)
    return [TraceRequest(0.0, len(w.prompt_token_ids), w.output_tokens, tuple(w.prompt_token_ids)) for w in work]


# ---- the simulation --------------------------------------------------------------------------------
@dataclass
class SimConfig:
    kv_cache_memory: int
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # auto (dtype) | int8 | fp8 (8 bits + float32 group scales) | bfloat16
    kv_cache: str = "paged"
    block_size: int = 16
    max_model_len: Optional[int] = None  # None: the model's
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    tp: int = 1  # tensor parallel: kv_cache_memory is per rank, each rank holds its share of the KV heads
    num_scheduler_steps: int = 8  # the engine's fused multi-step decode calls (TP 1 only; 1: none)


@dataclass
class RequestResult:
    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token: Optional[float] = None
    finish: Optional[float] = None
    generated: int = 0
    preemptions: int = 0
    rejected: Optional[str] = None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> Optional[float]:
        if self.first_token is None or self.finish is None or self.generated < 2:
            return None
        return (self.finish - self.first_token) / (self.generated - 1)


@dataclass
class SimResult:
    kv_cache: str
    requests: list[RequestResult]
    num_steps: int
    makespan: float
    num_preemptions: int
    capacity: str
    token_capacity: int
    kv_util_mean: float  # time-weighted share of KV memory (blocks or slots) held by requests
    kv_util_peak: float
    token_util_mean: float  # time-weighted tokens stored / capacity of what is held
    timeline: list[tuple[float, float, int]] = field(default_factory=list)  # (time, kv use, running seqs)
    num_units: int = 0  # blocks (paged) or slots (contiguous) in the pool
    fused_seconds: float = 0.0  # virtual time in steps of fused decode calls (the rest: planned steps)
    num_fused_steps: int = 0


def engine_kv_cache_dtype(model: Optional[str], dtype: str, kv_cache_dtype: str) -> str:
    """What the engine stores K/V in for this model (its resolve_kv_cache_dtype), without loading the weights:
    `auto` is bfloat16 where a GGUF's quantised weights run on the CPU kernels with float32 activations (the
    built-in model), else the activations' dtype; anything else as given."""
    if kv_cache_dtype != "auto" or dtype != "float32":
        return kv_cache_dtype
    from kvinfer import kernels
    from kvinfer.config import PRESETS
    from kvinfer.loaders.model_loader import resolve_device, resolve_source

    if resolve_device("auto").type != "cpu" or not kernels.available():
        return kv_cache_dtype
    if model is not None and (model in PRESETS or model.endswith(".json")):
        return kv_cache_dtype  # shapes only: dummy float weights, no quantised kernels
    return "bfloat16" if resolve_source(model, "auto").kind == "gguf" else kv_cache_dtype


def engine_fuses_decode(model: Optional[str], dtype: str) -> bool:
    """Whether the engine takes fused multi-step decode calls for this model without loading it: a GGUF's quantised
    weights on the CPU kernels with float32 activations (the built-in model); for the model families FusedDecode
    does not cover, `simulate --bench` asks the loaded engine."""
    return engine_kv_cache_dtype(model, dtype, "auto") == "bfloat16"


def _build_manager(cfg: SimConfig, mc: ModelConfig, max_len: int):
    if cfg.tp > 1:  # the engine's rule (kvinfer.parallel): KV heads split, or one replicated when fewer than ranks
        mc = mc.replace(num_kv_heads=max(1, mc.num_kv_heads // cfg.tp))
    bpt = mc.kv_bytes_per_token(*kv_element_bytes(cfg.kv_cache_dtype, mc.head_dim, DTYPE_BYTES[cfg.dtype]))
    # The engine's rule (as many blocks, or max-length slots up to max_num_seqs, as the budget holds), except
    # that a contiguous cache without a single slot is shown rejecting every request.
    count, _ = kv_layout(cfg.kv_cache, bpt, cfg.block_size, max_len, cfg.max_num_seqs, cfg.kv_cache_memory,
                         allow_no_slot=True)
    m = make_manager(cfg.kv_cache, count, cfg.block_size, max_len, cfg.enable_prefix_caching)
    if not m.keeps_kv:
        raise ValidationError("kv_cache", cfg.kv_cache, "the simulator runs paged or contiguous")
    return m, f"{m.num_units} {m.unit_name}s of {m.unit_tokens} tokens"


def _fused_call_steps(sched: Scheduler, manager, most: int, max_len: int) -> int:
    """How many decode steps the engine would make in its next fused call (Scheduler._decode_steps and
    _schedule_decode_steps's slot reservation): while no request waits and every running one decodes, up to `most`, no more than
    any request still may make; 0 (a planned step) if that is under 2 or the pool cannot hold as many more tokens
    for each."""
    if most < 2 or sched.waiting or not sched.running:
        return 0
    n = most
    for r in sched.running:
        if r.num_tokens - r.num_computed_tokens != 1 or r.num_computed_tokens < r.num_prompt_tokens:
            return 0
        n = min(n, r.params.max_tokens - r.num_output_tokens, max_len - r.num_tokens)
    if n < 2:
        return 0
    reqs = list(sched.running)
    ok = True
    for i, r in enumerate(reqs):
        if not manager.allocate_slots(r, n):
            ok = False
            reqs = reqs[:i]
            break
    for r in reqs:  # the scheduler allocates step by step; this only asked whether the pool holds them
        manager.trim(r, r.num_computed_tokens)
    return n if ok else 0


def simulate(trace: Sequence[TraceRequest], mc: ModelConfig, cfg: SimConfig, cost: CostModel) -> SimResult:
    """Run the engine's Scheduler over the trace; time advances by the cost model, never by the wall clock."""
    max_len = cfg.max_model_len or mc.max_position_embeddings
    if cfg.dtype not in DTYPE_BYTES:
        raise ValidationError("dtype", cfg.dtype, f"must be one of {', '.join(DTYPE_BYTES)}")
    manager, capacity = _build_manager(cfg, mc, max_len)
    sched = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_len,
                                      cfg.enable_chunked_prefill), manager)
    rng = random.Random(cfg.seed)
    low, vocab = min(100, mc.vocab_size - 1), mc.vocab_size
    order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival, i))
    results = [RequestResult(i, t.arrival, t.prompt_tokens, t.output_tokens) for i, t in enumerate(trace)]
    by_id: dict[str, RequestResult] = {}
    now, nxt, steps = 0.0, 0, 0
    timeline: list[tuple[float, float, int]] = []
    busy = util_area = tok_area = 0.0
    util_peak = 0.0
    total = manager.num_units

    fused_left = 0  # steps left in the current fused call: arrivals wait for its end, as in the engine
    fused_seconds, fused_steps = 0.0, 0
    most = cfg.num_scheduler_steps if cfg.tp == 1 else 1

    while nxt < len(order) or sched.num_unfinished:
        while not fused_left and nxt < len(order) and trace[order[nxt]].arrival <= now:
            i = order[nxt]
            t = trace[i]
            ids = list(t.prompt_token_ids) if t.prompt_token_ids else [rng.randrange(low, vocab)
                                                                      for _ in range(t.prompt_tokens)]
            req = Request(str(i), ids, SamplingParams(max_tokens=t.output_tokens, temperature=0.0, ignore_eos=True),
                          arrival_time=t.arrival)
            try:
                sched.check_fits(req.num_prompt_tokens, req.params.max_tokens)
                sched.add_request(req)
                by_id[req.request_id] = results[i]
            except RequestTooLargeError as e:
                results[i].rejected = str(e)
            nxt += 1
        if not sched.num_unfinished:
            if nxt < len(order):
                now = max(now, trace[order[nxt]].arrival)
            continue
        if not fused_left:
            fused_left = _fused_call_steps(sched, manager, most, max_len)
        out = sched.schedule()
        if out.is_empty:
            if nxt < len(order) and not sched.running:
                now = max(now, trace[order[nxt]].arrival)
                continue
            raise SimulationError(
                f"the scheduler can make no progress at t={now:.3f} s with {len(sched.waiting)} waiting and "
                f"{len(sched.running)} running requests (a scheduler bug: please report the trace)")
        dt = cost.step_time(out, fused=fused_left > 0)
        if fused_left:
            fused_seconds += dt
            fused_steps += 1
            fused_left -= 1
        used = total - manager.num_free_units
        in_step = {s.request.request_id for s in out.scheduled}
        stored = sum(s.end for s in out.scheduled) + sum(
            r.num_computed_tokens for r in sched.running if r.request_id not in in_step)
        held_tokens = used * manager.unit_tokens
        util = used / total if total else 0.0
        busy += dt
        util_area += util * dt
        tok_area += (stored / held_tokens if held_tokens else 0.0) * dt
        util_peak = max(util_peak, util)
        now += dt
        steps += 1
        sched.update_after_step(out)
        for s in out.scheduled:
            req = s.request
            if s.end != req.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            res = by_id[req.request_id]
            req.output_token_ids.append(rng.randrange(low, vocab))
            res.generated = req.num_output_tokens
            if res.first_token is None:
                res.first_token = now
            if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_len:
                res.finish = now
                res.preemptions = req.num_preemptions
                sched.finish(req, "length")
        timeline.append((now, util, len(sched.running)))

    done = [r for r in results if r.finish is not None]
    start = min((r.arrival for r in results), default=0.0)
    makespan = (max(r.finish for r in done) - start) if done else 0.0
    return SimResult(cfg.kv_cache, results, steps, makespan, sched.num_preemptions, capacity,
                     manager.token_capacity, util_area / busy if busy else 0.0, util_peak,
                     tok_area / busy if busy else 0.0, timeline, total, fused_seconds, fused_steps)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    from kvinfer.bench.workload import percentile as nearest_rank

    v = nearest_rank(values, q)
    return None if math.isnan(v) else v


def summarize(res: SimResult) -> dict:
    done = [r for r in res.requests if r.finish is not None]
    gen = sum(r.generated for r in done)
    ttft = [r.ttft for r in done]
    tpot = [r.tpot for r in done if r.tpot is not None]
    pct = lambda xs: {f"p{q}": percentile(xs, q) for q in (50, 90, 99)}  # noqa: E731
    return dict(
        kv_cache=res.kv_cache, capacity=res.capacity, token_capacity=res.token_capacity,
        requests=len(res.requests), completed=len(done), generated_tokens=gen, steps=res.num_steps,
        makespan_s=res.makespan, throughput_tok_s=gen / res.makespan if res.makespan else None,
        ttft_s=pct(ttft), tpot_s=pct(tpot), kv_utilisation_mean=res.kv_util_mean,
        kv_utilisation_peak=res.kv_util_peak, token_utilisation_mean=res.token_util_mean,
        preemptions=res.num_preemptions,
        rejected=[dict(index=r.index, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens, reason=r.rejected)
                  for r in res.requests if r.rejected],
    )


def run_simulation(trace: Sequence[TraceRequest], mc: ModelConfig, cfg: SimConfig, cost: CostModel,
                   compare_contiguous: bool = True) -> dict[str, SimResult]:
    """The paged run, plus the same trace under a contiguous max-length reservation of the same memory."""
    out = dict(paged=simulate(trace, mc, replace(cfg, kv_cache="paged"), cost))
    if compare_contiguous:
        out["contiguous"] = simulate(trace, mc, replace(cfg, kv_cache="contiguous"), cost)
    return out


def format_summary(report: dict) -> str:
    def ms(x):
        return "n/a" if x is None else f"{x * 1000:.1f}"

    cols = [k for k in ("paged", "contiguous") if k in report["results"]]
    rs = [report["results"][k] for k in cols]
    lines = [
        f"Model shapes {report['model']}, KV {report['dtype']}, {format_bytes(report['kv_cache_memory'])} of KV cache, "
        f"max_model_len {report['max_model_len']}",
        f"Trace        {report['trace']}",
        f"Cost model   step = {report['cost_model']['a']:.4g} + {report['cost_model']['b']:.4g}*tokens + "
        f"{report['cost_model']['c']:.4g}*decode_seqs + {report['cost_model']['d']:.4g}*context_tokens s",
        *([f"             fused decode step = {report['cost_model']['e']:.4g} + {report['cost_model']['f']:.4g}*decode_seqs"
           f" + {report['cost_model']['g']:.4g}*context_tokens s"]
          if any(report["cost_model"].get(k) for k in "efg") else []),
        f"             ({report['cost_model']['source']})",
        "",
        f"{'':<28}" + "".join(f"{c + ' (same memory)' if c == 'contiguous' else c:>26}" for c in cols),
    ]

    def row(label, fn):
        lines.append(f"{label:<28}" + "".join(f"{fn(r):>26}" for r in rs))

    row("KV capacity", lambda r: r["capacity"])
    row("completed / requests", lambda r: f"{r['completed']} / {r['requests']}")
    row("throughput (gen tok/s)", lambda r: "n/a" if r["throughput_tok_s"] is None else f"{r['throughput_tok_s']:.1f}")
    row("makespan (s)", lambda r: f"{r['makespan_s']:.2f}")
    for q in ("p50", "p90", "p99"):
        row(f"TTFT {q} (ms)", lambda r, q=q: ms(r["ttft_s"][q]))
    for q in ("p50", "p90", "p99"):
        row(f"TPOT {q} (ms)", lambda r, q=q: ms(r["tpot_s"][q]))
    row("KV held, mean / peak",
        lambda r: f"{r['kv_utilisation_mean'] * 100:.1f}% / {r['kv_utilisation_peak'] * 100:.1f}%")
    row("held KV holding tokens", lambda r: f"{r['token_utilisation_mean'] * 100:.1f}%")
    row("preemptions", lambda r: str(r["preemptions"]))
    row("never fit (rejected)", lambda r: str(len(r["rejected"])))
    for c, r in zip(cols, rs):
        if r["rejected"]:
            idx = ", ".join(str(x["index"]) for x in r["rejected"][:20])
            more = f" and {len(r['rejected']) - 20} more" if len(r["rejected"]) > 20 else ""
            lines.append(f"{c}: requests that never fit: {idx}{more} — {r['rejected'][0]['reason']}")
    return "\n".join(lines)


def format_bench(bench: dict) -> str:
    """`simulate --bench`: the prediction against bench throughput's measurement of the same workload."""
    err = bench["error"]
    err_text = "n/a" if err is None else f"{err * 100:+.1f}%"
    pred = bench["predicted_tok_s"]
    own = bench.get("own_predicted_tok_s")
    own_err = "n/a" if bench.get("own_error") is None else f"{bench['own_error'] * 100:+.1f}%"
    same = "same" if bench["engine_blocks"] == bench["simulated_blocks"] else "DIFFERENT"
    return "\n".join([
        "",
        f"Against bench throughput ({bench['requests']} requests, workload seed {bench['workload_seed']}, "
        f"{bench['threads']} thread(s), measured in this run "
        + (f"between two calibrations, {bench['calibration_s']:.1f} s in all)" if bench["calibration_s"]
           else "with the given cost model)"),
        bench["machine"],
        f"  measured   {bench['measured_tok_s']:8.1f} gen tok/s   ({bench['generated_tokens']} tokens in "
        f"{bench['seconds']:.2f} s, {bench['engine_preemptions']} preemptions)",
        f"  simulated  {'n/a' if pred is None else f'{pred:8.1f}'} gen tok/s   "
        f"({bench['simulated_preemptions']} preemptions)",
        f"  error      {err_text} (simulated / measured - 1)",
        f"  KV blocks  {bench['engine_blocks']} engine, {bench['simulated_blocks']} simulated ({same})",
        f"  planned steps  measured {bench['planned_steps']} in {bench['planned_s']:.2f} s, simulated "
        f"{bench['simulated_planned_steps']} in {bench['simulated_planned_s']:.2f} s",
        f"  fused steps    measured {bench['fused_steps']} in {bench['fused_s']:.2f} s, simulated "
        f"{bench['simulated_fused_steps']} in {bench['simulated_fused_s']:.2f} s",
        f"  stalled    {bench['stalled_steps']} of {bench['planned_steps'] + bench['fused_steps']} measured steps "
        f"took over 3x the calibrated model's time: {bench['stalled_s']:.2f} s of the "
        f"{bench['seconds']:.2f} s (another process had the CPU; not the engine's cost)",
        f"  with a cost model fitted on the measured run's own steps: simulated "
        f"{'n/a' if own is None else f'{own:.1f}'} gen tok/s, error {own_err} (what the model's form leaves; the "
        f"rest is the machine's speed moving between the calibration and the run)",
    ])


def write_plot(report: dict, timelines: dict[str, list], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, tl in timelines.items():
        ts = [t for t, _, _ in tl]
        ax1.step(ts, [u * 100 for _, u, _ in tl], where="post", label=name)
        ax2.step(ts, [n for _, _, n in tl], where="post", label=name)
    ax1.set_ylabel("KV held (%)")
    ax2.set_ylabel("running sequences")
    ax2.set_xlabel("virtual time (s)")
    ax1.set_title(f"Simulated schedule: {report['trace'].split(',')[0]}", fontsize=10)
    ax1.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
