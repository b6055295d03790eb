"""Turns --model / --load-format / --dtype / --device into a ModelConfig, a loaded Decoder and a tokenizer."""
from __future__ import annotations

import contextlib
import logging
import mmap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from kvinfer import kernels
from kvinfer.config import PRESETS, EngineConfig, ModelConfig
from kvinfer.errors import ModelLoadError, ValidationError
from kvinfer.models.decoder import Decoder
from kvinfer.models.families import load_hf_config, preset_config
from kvinfer.models.weights import load_into
from kvinfer.utils import builtin_model_path, gc_paused

log = logging.getLogger("kvinfer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValidationError("device", name, "CUDA is not available on this machine (use cpu or auto)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPU: float32, the dtype of the batch-invariant kernels (quantised matmuls, paged attention, the fused
        # decode step). bfloat16 would leave the quantised kernels (much slower decode, and on AVX2 PyTorch
        # emulates bf16 matmuls: docs/BENCHMARKS.md); --dtype bfloat16 is still there, on the eager path.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class ModelSource:
    kind: str  # gguf | safetensors | dummy
    path: Optional[Path]
    config: ModelConfig


@gc_paused
def resolve_source(model: Optional[str], load_format: str) -> ModelSource:
    """Where the weights come from; errors name the path and what was expected there."""
    if model is None:
        p = builtin_model_path()
        from kvinfer.loaders.gguf_loader import read_metadata_config

        return ModelSource("gguf", p, read_metadata_config(p))
    if load_format == "dummy":
        if model in PRESETS:
            return ModelSource("dummy", None, preset_config(model))
        p = Path(model)
        cfg_path = p / "config.json" if p.is_dir() else p
        if not cfg_path.is_file():
            raise ModelLoadError(
                f"--load-format dummy needs a preset ({', '.join(PRESETS)}) or a config.json; {model!r} is neither")
        return ModelSource("dummy", p, load_hf_config(cfg_path))
    p = Path(model)
    if not p.exists():
        hint = " (a preset name needs --load-format dummy)" if model in PRESETS else ""
        raise ModelLoadError(f"model path {model!r} does not exist{hint}")
    if p.is_file():
        if load_format not in ("auto", "gguf"):
            raise ModelLoadError(f"{model!r} is a file; --load-format {load_format} expects a directory")
        from kvinfer.loaders.gguf_loader import read_metadata_config

        return ModelSource("gguf", p, read_metadata_config(p))
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1 and load_format in ("auto", "gguf"):
                return resolve_source(str(ggufs[0]), load_format)
            raise ModelLoadError(f"model directory {model!r} has no config.json")
        return ModelSource("safetensors", p, load_hf_config(p / "config.json"))
    raise ModelLoadError(f"model path {model!r} is neither a file nor a directory")


@contextlib.contextmanager
def _no_weight_init():
    """Skip nn.Linear / nn.Embedding's random init while the shape-only model is built: the weights are loaded
    afterwards, and the init on the meta device imports torch._dynamo (2-3 s of start-up)."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def build_model(cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> Decoder:
    with torch.device("meta"), _no_weight_init():
        model = Decoder(cfg, max_positions)
    # Not Module.to_empty: its empty_like on meta tensors imports torch._refs and the prims (~0.3 s idle).
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    # Buffers (RoPE tables, ALiBi slopes) are computed, not loaded: rebuild them on the real device.
    _init_buffers(model, cfg, max_positions, device)
    return model.to(dtype=dtype) if dtype != torch.float32 else model


def _init_buffers(model: Decoder, cfg: ModelConfig, max_positions: int, device) -> None:
    from kvinfer.layers.alibi import alibi_slopes
    from kvinfer.layers.rotary import RotaryEmbedding

    for rot in {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}.values():
        r = RotaryEmbedding(*rot.args).to(device)  # the global and (Gemma 3) the windowed layers' tables
        rot.cos = r.cos
        rot.sin = r.sin
    if cfg.position == "alibi":
        model.alibi = alibi_slopes(cfg.num_heads).to(device)


def _use_gguf_kernels(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    if setting == "none":
        return False
    fits = device.type == "cpu" and dtype == torch.float32
    if setting == "gguf":
        if not fits:
            raise ValidationError("quantization", setting, "GGUF kernels run on the CPU in float32 only")
        from kvinfer import kernels

        if not kernels.available():
            raise ValidationError("quantization", setting, f"kernels unavailable: {kernels.unavailable_reason()}")
        return True
    if not fits:
        return False
    from kvinfer import kernels

    return kernels.available()


def _dummy_init(model: Decoder, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: Decoder
    tokenizer: Any
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    load_seconds: float
    quantized_modules: int = 0  # linears (and embedding) running on GGUF blocks with kvinfer's kernels


def check_source(ecfg: EngineConfig, src: ModelSource) -> None:
    """What can be refused from the flags and the model's metadata alone, before any weight is read."""
    if ecfg.quantization == "gguf" and src.kind != "gguf":
        raise ValidationError("quantization", "gguf", f"needs a GGUF model; {ecfg.model} is loaded as {src.kind}")
    if ecfg.tokenizer is not None and not (Path(ecfg.tokenizer) / "tokenizer.json").is_file():
        what = "does not exist" if not Path(ecfg.tokenizer).exists() else "has no tokenizer.json"
        raise ValidationError("tokenizer", ecfg.tokenizer, f"{what} (it must be a directory with tokenizer.json)")


def _quantize_by_layer(model: Decoder, raw: dict, keep: bool = False, span: tuple[int, int] = (0, 0)) -> int:
    """quantize_from_gguf one layer at a time, dropping each layer's blocks from `raw` as soon as its layers
    hold them: fused q/k/v and gate/up are copied into one buffer, and the parts would otherwise all live until
    the end of the load (those bytes twice at the peak). keep: each layer's weights are kept in the kernels' layout
    at once, their GGUF pages given back (quantize_from_gguf's keep: the fused parts are packed, not copied; then
    keep_now). span: the file's mapping, whose pages up to a layer's last tensor are given back once the layer is
    kept (those a tensor shares with its neighbours, which dropping the tensor leaves, the pages read to reorder q
    and k rows, the float tensors' pages), rather than at the end of the load (_own_unkept): nothing writes the
    mapping, so a page read again afterwards (a tensor stored before the layers) comes back from the file."""
    from kvinfer.kernels.kept import drop_pages
    from kvinfer.models.quantize import quantize_from_gguf

    swapped = 0
    for i in range(len(model.layers)):
        prefix = f"model.layers.{i}."
        part = {k: raw.pop(k) for k in [k for k in raw if k.startswith(prefix)]}
        ends = [a.ctypes.data + a.nbytes for a, *_ in part.values() if a.nbytes and span[0] <= a.ctypes.data < span[1]]
        swapped += quantize_from_gguf(model, part, keep=keep)
        del part
        if keep:
            keep_now(model.layers[i])
            if ends:  # everything of the mapping before the layer's end (its q/k rows, read to be reordered, too)
                drop_pages(span[0], min(span[1], -(-max(ends) // mmap.PAGESIZE) * mmap.PAGESIZE) - span[0])
    swapped += quantize_from_gguf(model, raw, keep=keep)
    if keep:
        keep_now(model)
    return swapped


def keep_now(module: nn.Module) -> None:
    """Each quantised linear's kept copy made now, its GGUF pages given back (engine/startup.py keep_tiles does the
    same for every model; here it runs while the weights are loaded, so that those read from the file's mapping
    are never resident all at once)."""
    from kvinfer.layers.quant_linear import QuantLinear

    for m in module.modules():
        if isinstance(m, QuantLinear) and m.raw.is_cpu:
            m.prepare_kernel(drop_source=True)


def _own_unkept(model: Decoder, span: tuple[int, int]) -> None:
    """Where a weight still views the file's mapping (span) without a kept copy that holds its bytes (an untied
    embedding, a weight the kernels keep no copy of), reads it into memory of its own: the kernels read it, and
    must not see a file rewritten after the load. Then every page of the mapping is given back (the header's, the
    pages shared by two tensors): nothing reads them any more."""
    from kvinfer.kernels.kept import drop_pages
    from kvinfer.layers.quant_linear import QuantEmbedding, QuantLinear

    def held(m) -> bool:
        kept = m._tiles if isinstance(m, QuantLinear) else m.kept()
        return kept is not None and kept.tiles is not None and kept.dropped

    copies: dict[int, torch.Tensor] = {}  # a tied head and its embedding share one tensor: one copy for both
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)) and span[0] <= m.raw.data_ptr() < span[1] and not held(m):
            if m.raw.data_ptr() not in copies:
                copies[m.raw.data_ptr()] = m.raw.clone()
            m.raw = copies[m.raw.data_ptr()]
            if isinstance(m, QuantLinear):
                if m._tiles is not None:
                    m._tiles.release(restore=False)
                m._tiles, m._kernel, m._kernel_checked = None, None, False
    drop_pages(span[0], span[1] - span[0])


@gc_paused
def load_model(ecfg: EngineConfig, max_positions: Optional[int] = None,
               source: Optional[ModelSource] = None) -> LoadedModel:
    t0 = time.perf_counter()
    device = resolve_device(ecfg.device)
    dtype = resolve_dtype(ecfg.dtype, device)
    src = source or resolve_source(ecfg.model, ecfg.load_format)
    check_source(ecfg, src)
    cfg = src.config
    max_positions = max_positions or cfg.max_position_embeddings
    tokenizer = None
    quant = False
    quantized = 0
    if src.kind == "gguf":
        from kvinfer.loaders.gguf_loader import read_gguf
        from kvinfer.loaders.tokenizer import Tokenizer

        quant = _use_gguf_kernels(ecfg.quantization, device, dtype)
        # Batch-invariant, every batch reads the blocks: the matrices the kernels take are never dequantized.
        lazy = frozenset(kernels.QTYPES) if quant and kernels.batch_invariant() else frozenset()
        # Where every such matrix is kept in the kernels' layout with its GGUF pages given back (the default at the
        # avx512 level), the blocks are packed straight from the file's mapping, never read into a buffer first.
        keep = bool(lazy) and kernels.keep_tiles_enabled() and kernels.drop_source_enabled()
        mapped = frozenset(t for t in lazy if kernels.active().drops_kept_source(t)) if keep else frozenset()
        ckpt = read_gguf(src.path, keep_raw=quant, lazy_types=lazy, mapped_types=mapped)
        cfg = ckpt.config
        model = build_model(cfg, max_positions, torch.float32, device)
        load_into(model, cfg, ckpt.tensors.items(), from_gguf=True)
        # An explicit --tokenizer wins over the one embedded in the GGUF.
        tokenizer = Tokenizer.from_hf_dir(Path(ecfg.tokenizer)) if ecfg.tokenizer else \
            Tokenizer.from_gguf_metadata(ckpt.metadata)
        if quant:
            from kvinfer.models.quantize import quantize_from_gguf

            quantized = _quantize_by_layer(model, ckpt.raw, keep=bool(mapped), span=ckpt.mapped_span)
            if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
                # A matrix the kernels could not take (mixed types in one fused projection): load it in float.
                ckpt = read_gguf(src.path, keep_raw=True)
                model = build_model(cfg, max_positions, torch.float32, device)
                load_into(model, cfg, ckpt.tensors.items(), from_gguf=True)
                quantized = quantize_from_gguf(model, ckpt.raw)
            elif mapped:
                _own_unkept(model, ckpt.mapped_span)
            del ckpt
    elif src.kind == "safetensors":
        from kvinfer.loaders.safetensors_loader import iter_safetensors
        from kvinfer.loaders.tokenizer import Tokenizer

        model = build_model(cfg, max_positions, torch.float32, device)
        load_into(model, cfg, iter_safetensors(src.path))
        tok_dir = Path(ecfg.tokenizer) if ecfg.tokenizer else src.path
        if (tok_dir / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_hf_dir(tok_dir)
    else:
        model = build_model(cfg, max_positions, torch.float32, device)
        _dummy_init(model, ecfg.seed)
        if ecfg.tokenizer:
            from kvinfer.loaders.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_hf_dir(Path(ecfg.tokenizer))
    if ecfg.chat_template is not None:
        if tokenizer is None:
            raise ModelLoadError("--chat-template needs a tokenizer (this model has none: give --tokenizer DIR)")
        from kvinfer.loaders.chat_template import read_chat_template

        tokenizer.set_chat_template(*read_chat_template(ecfg.chat_template))
    if any(t.device != device or (t.is_floating_point() and t.dtype != dtype)
           for t in list(model.parameters()) + list(model.buffers())):
        model = model.to(device=device, dtype=dtype)  # (which would write back the kept weights' given-back pages)
    model.eval()
    if ecfg.quantization == "gguf" and not quant:
        raise ValidationError("quantization", "gguf", "needs a GGUF model on the CPU in float32")
    if device.type == "cpu" and dtype == torch.float32 and kernels.available() and kernels.batch_invariant():
        from kvinfer.models.quantize import use_kernel_linears

        use_kernel_linears(model)  # the float linears left: row-invariant kernel instead of BLAS
    log.info("%s", kernels.describe())
    secs = time.perf_counter() - t0
    log.info("loaded %s (%s) in %.2f s: %d layers, hidden %d, %s on %s", src.path or ecfg.model, src.kind, secs,
             cfg.num_layers, cfg.hidden_size, str(dtype).replace("torch.", ""), device)
    return LoadedModel(cfg, model, tokenizer, src, dtype, device, secs, quantized)
