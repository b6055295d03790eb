"""Start-up: the checks that refuse, from the flags and the model's metadata, what would fail or exhaust memory
later (weights, KV budget, context window, threads), then the construction of an engine's parts: the model, the KV
cache and its manager, the scheduler, the input and output processors, the model runner, the KV tiers and the
speculator."""
from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvinfer.config import EngineConfig, ModelConfig
from kvinfer.engine.model_runner import ModelRunner
from kvinfer.engine.processing import InputProcessor, OutputProcessor
from kvinfer.errors import ModelLoadError, ValidationError
from kvinfer.kv.factory import kv_bytes_per_token, kv_layout, make_kv, spec_for
from kvinfer.kv.tier_io import make_tiers
from kvinfer.loaders.model_loader import (LoadedModel, ModelSource, check_source, load_model, resolve_device,
                                          resolve_dtype, resolve_source)
from kvinfer.core.scheduler import Scheduler, SchedulerConfig
from kvinfer.utils import format_bytes

log = logging.getLogger("kvinfer")

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device` without swapping or the kernel's OOM killer."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def keep_tiles(model) -> None:
    """Where the kernels read quantised weights in tile layout (the avx512 level), unpack each quantised linear's
    weight into it now (kernels.Kernels.keep_tiles), rather than at its first forward: the copy is part of the
    weights' memory. Unless KVINFER_DROP_SOURCE=0, where the copy holds every byte of the GGML rows, their pages are
    given back as they are packed, so the process holds each weight once (QuantLinear.source() brings them back
    for other readers)."""
    from kvinfer import kernels
    from kvinfer.layers.quant_linear import QuantLinear

    if model is None or not (kernels.available() and kernels.active().keeps_tiles and kernels.keep_tiles_enabled()):
        return
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.raw.is_cpu:
            m.prepare_kernel(drop_source=kernels.drop_source_enabled())


def resolve_kv_cache_dtype(config: EngineConfig, loaded: LoadedModel) -> EngineConfig:
    """--kv-cache-dtype auto: bfloat16 where quantised weights run on the CPU kernels with float32 activations
    (half the bytes per token; decode attention reads the whole cache each step, so throughput gains:
    docs/BENCHMARKS.md, "Figures behind code decisions"), else the model's dtype. The rounding (2^-9 relative) is
    well below the weights' 4-bit quantisation error, and llama.cpp keeps such models' caches in fp16 by default.
    Every backend rounds alike (none included), so a request's result still does not depend on the backend."""
    from kvinfer import kernels
    from kvinfer.layers.quant_linear import QuantLinear

    if config.kv_cache_dtype != "auto" or loaded.device.type != "cpu" or loaded.dtype != torch.float32:
        return config
    if not kernels.available() or not any(isinstance(m, QuantLinear) for m in loaded.model.modules()):
        return config
    return dataclasses.replace(config, kv_cache_dtype="bfloat16")


def kv_budget(config: EngineConfig, weight_bytes: int = 0) -> int:
    """The KV budget in bytes; --kv-cache-fraction is a share of the memory available once the weights are in
    (weight_bytes: the weights still to load; 0 once they are)."""
    if config.kv_cache_memory:
        return config.kv_cache_memory
    if config.kv_cache_fraction:
        import psutil

        return int(max(0, psutil.virtual_memory().available - weight_bytes) * config.kv_cache_fraction)
    return DEFAULT_KV_CACHE_MEMORY


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """The context window: the model's unless given, never beyond the positions the model has tables for."""
    n = config.max_model_len or mc.max_position_embeddings
    # RoPE tables and learned position embeddings stop at max_position_embeddings (already scaled by any
    # rope_scaling in the config); ALiBi has no table to outgrow.
    if n > mc.max_position_embeddings and mc.position != "alibi":
        raise ValidationError("max_model_len", n, f"must be <= {mc.max_position_embeddings}, the positions this "
                                                  f"model supports ({mc.position} max_position_embeddings)")
    return n


def _weight_bytes(config: EngineConfig, src: ModelSource, device: torch.device, dtype: torch.dtype) -> int:
    """About the peak bytes of loading the weights."""
    if src.kind == "gguf" and config.quantization != "none" and device.type == "cpu" and dtype == torch.float32:
        return src.path.stat().st_size  # the kernels' matrices stay GGUF blocks; never dequantized
    # Other loaders materialise the decoder in float32 before casting it: that is the peak.
    return src.config.num_parameters() * 4


def check_startup(config: EngineConfig) -> ModelSource:
    """Refuse, from the flags and the model's metadata alone, what would fail or exhaust memory later: the
    weights and the KV cache must fit in the memory available now ("never an OOM" starts here)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    src = resolve_source(config.model, config.load_format)
    check_source(config, src)
    mc = src.config
    max_len = resolve_max_model_len(config, mc)
    weight_bytes = _weight_bytes(config, src, device, dtype)
    _, kv_bytes = kv_layout(config.kv_cache, kv_bytes_per_token(config, mc, dtype), config.block_size, max_len,
                            config.max_num_seqs, kv_budget(config, weight_bytes))
    free = available_memory(device)
    where = "GPU memory free" if device.type == "cuda" else "memory available"
    if config.kv_cache_fraction and not config.kv_cache_memory:
        log.warning("--kv-cache-fraction %g: a KV cache of %s fits (%g of the %s of %s once the weights, about %s, "
                    "are in); %s stay free for activations and everything else", config.kv_cache_fraction,
                    format_bytes(kv_bytes), config.kv_cache_fraction, format_bytes(max(0, free - weight_bytes)),
                    where, format_bytes(weight_bytes), format_bytes(max(0, free - weight_bytes - kv_bytes)))
    if weight_bytes > free:
        raise ModelLoadError(f"the weights of {config.model or 'the built-in model'} need about "
                             f"{format_bytes(weight_bytes)} to load, more than the {format_bytes(free)} of {where}")
    if weight_bytes + kv_bytes > free:
        raise ValidationError("kv_cache_memory", format_bytes(kv_bytes),
                              f"the KV cache ({format_bytes(kv_bytes)}) plus the weights (about "
                              f"{format_bytes(weight_bytes)}) need more than the {format_bytes(free)} of {where}; "
                              f"lower --kv-cache-memory")
    return src


def usable_threads(requested: int) -> int:
    """The threads to run: `requested`, or this machine's core count when it asks for more (oversubscribed cores
    only slow every step down), saying so in one line."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested > cores:
        log.warning("--threads %d is more than the %d core%s this process may use; running %d", requested, cores,
                    "s" if cores > 1 else "", cores)
        return cores
    return requested



def eos_token_ids(tokenizer, mc: ModelConfig) -> tuple[int, ...]:
    """The ids that end a sequence: the tokenizer's where it names them, else the model config's."""
    if tokenizer is not None and tokenizer.eos_token_ids:
        return tuple(tokenizer.eos_token_ids)
    return tuple(mc.eos_token_ids)


@dataclass
class EngineParts:
    """What an LLMEngine is made of, built by `build`."""

    config: EngineConfig  # with --kv-cache-dtype auto resolved
    loaded: LoadedModel
    model_config: ModelConfig
    tokenizer: Any
    max_model_len: int
    tp: Any  # TensorParallel on rank 0 when tensor_parallel_size > 1, else None
    kv_bytes_per_token: int
    kv_dtype: str
    kv_manager: Any
    kv_cache: Any
    scheduler: Scheduler
    processor: InputProcessor
    output_processor: OutputProcessor
    runner: ModelRunner
    kv_tiers: Any
    speculator: Any


def build(config: EngineConfig, loaded: Optional[LoadedModel] = None) -> EngineParts:
    """Check, then build every part; `loaded` reuses weights already loaded (and skips the checks on them)."""
    if config.tensor_parallel_size > 1:  # a script without a main guard stops here, in the worker or before
        from kvinfer.parallel import refuse_spawn_bootstrap, refuse_unguarded_main

        refuse_spawn_bootstrap()
        refuse_unguarded_main(config)
    source = None if loaded is not None else check_startup(config)  # refuse before allocating anything
    if config.speculative_model:  # a missing draft model fails before the target is loaded
        try:
            resolve_source(config.speculative_model, "dummy" if config.load_format == "dummy" else "auto")
        except ModelLoadError as e:
            raise ValidationError("speculative_model", config.speculative_model, str(e)) from None
    if config.num_threads:
        torch.set_num_threads(usable_threads(config.num_threads))
    claim_activation_bits(config.activation_bits)
    if config.tensor_parallel_size > 1 and loaded is None:  # a bad size fails before any weight is read
        from kvinfer.parallel import check_tp_size

        check_tp_size(resolve_source(config.model, config.load_format).config, config.tensor_parallel_size)
    loaded = loaded or load_model(config, source=source)
    keep_tiles(loaded.model)  # before the KV budget is taken from what memory is left
    config = resolve_kv_cache_dtype(config, loaded)
    mc, tokenizer = loaded.config, loaded.tokenizer
    max_model_len = resolve_max_model_len(config, mc)
    dtype, device = loaded.dtype, loaded.device
    if device.type == "cpu" and dtype != torch.float32:
        log.warning("dtype %s on the CPU runs the eager PyTorch path: no quantised kernels or fused decode step, "
                    "and a request's output may depend on how it is batched or chunked (`kvinfer bench exact "
                    "--dtype ...` shows it); float32, the CPU default, keeps them identical",
                    str(dtype).replace("torch.", ""))
    tp = None
    kv_cfg = mc  # the shapes this process's KV cache holds: a rank's share of the KV heads under TP
    if config.tensor_parallel_size > 1:
        from kvinfer.parallel import local_config

        kv_cfg = local_config(mc, config.tensor_parallel_size)  # also checks the head counts
    bytes_per_token = kv_bytes_per_token(config, kv_cfg, dtype)
    kv_spec = spec_for(config, kv_cfg, bytes_per_token, max_model_len, kv_budget(config), dtype, device)
    kv_dtype = kv_spec.kv_dtype if kv_spec.kv_dtype != "auto" else str(dtype).replace("torch.", "")
    kv_manager, kv_cache = make_kv(kv_spec, alibi=getattr(loaded.model, "alibi", None),
                                   prompt_roles=ModelRunner.prompt_route_for(loaded.model))
    m = kv_manager
    log.info("KV cache: %s, %s, %s (%s per token, %d %ss of %d tokens, token capacity %d)", m.kind,
             kv_dtype, format_bytes(kv_cache.nbytes), format_bytes(bytes_per_token),
             m.num_units, m.unit_name, m.unit_tokens, m.token_capacity)
    scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                          max_model_len, config.enable_chunked_prefill), kv_manager)
    processor = InputProcessor(tokenizer, mc.vocab_size, max_model_len, scheduler)
    output_processor = OutputProcessor(tokenizer)
    if config.tensor_parallel_size == 1:
        runner = ModelRunner(loaded.model, kv_cache, kv_manager, device, eos_token_ids(tokenizer, mc))
    else:  # last, so that nothing above can fail with workers started; they build the cache from kv_spec
        from kvinfer.parallel import TensorParallel

        tp = TensorParallel.start(config, loaded)
        runner = tp.make_runner(loaded.model, kv_cache, kv_manager, device, kv_spec)
    # Tiers below the pool (RAM, disk, Redis) where the flags ask for them: kv/tier_io.py, docs/kv_tiers.md
    kv_tiers = make_tiers(config, loaded, kv_cache, kv_manager, runner.prompt_route,
                          tp is None)
    parts = EngineParts(config, loaded, mc, tokenizer, max_model_len, tp, bytes_per_token, kv_dtype, kv_manager,
                        kv_cache, scheduler, processor, output_processor, runner, kv_tiers, None)
    if config.speculative:
        parts.speculator = build_speculator(parts)
    _bits_users[runner] = config.activation_bits  # (the engine keeps its runner, not these parts)
    return parts


# The engines of this process (by their runners, held weakly) and the activation bits each runs at.
_bits_users: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def claim_activation_bits(bits: int) -> None:
    """Set the kernels' activation bits (process-wide: every level's library) for an engine about to be built;
    a ValidationError while another engine of this process runs at other bits, whose results would change."""
    from kvinfer import kernels

    if kernels.activation_bits() != bits:
        others = set(_bits_users.values())
        if others - {bits}:
            gc.collect()  # an engine no longer referenced but not yet collected does not count
            others = set(_bits_users.values())
        if others - {bits}:
            raise ValidationError("activation_bits", bits, f"this process already runs an engine at "
                                  f"{others.pop()} activation bits (the setting is process-wide)")
        kernels.set_activation_bits(bits)


def build_speculator(e: EngineParts):
    """The proposer of --speculative: n-gram lookup, or a draft model with its own KV cache."""
    from kvinfer.spec.speculator import Speculator, default_tokens

    c = e.config
    draft = None
    if c.speculative == "draft":
        from kvinfer.spec.draft import DraftProposer

        dcfg = c.replace(model=c.speculative_model, tokenizer=None, speculative=None, speculative_model=None,
                         load_format="dummy" if c.load_format == "dummy" else "auto")
        dl = load_model(dcfg, max(e.max_model_len, 1))
        if dl.config.vocab_size != e.model_config.vocab_size:
            raise ValidationError("speculative_model", c.speculative_model,
                                  f"has a vocabulary of {dl.config.vocab_size} tokens; the target has "
                                  f"{e.model_config.vocab_size} (the draft needs the same tokenizer)")
        # As many tokens of draft KV as the target's cache holds, so the draft never runs out first.
        tokens = max(e.kv_manager.token_capacity, e.max_model_len)
        draft = DraftProposer(dl, -(-tokens // c.block_size) + 1, c.block_size)
        log.info("draft model %s: KV cache %s", c.speculative_model, format_bytes(draft.cache.nbytes))
    k = c.num_speculative_tokens or default_tokens(c.speculative, e.loaded.device)
    return Speculator(c.speculative, k, c.ngram_min, c.ngram_max, draft)
