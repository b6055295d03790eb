"""GGUF files: our own parser, metadata -> ModelConfig, and dequantised tensors under Hugging Face names.

What llama.cpp writes differently per family (names, metadata) is the family's GGUFNames (kvinfer/models/families/)."""
from __future__ import annotations

import logging
import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import KvinferError, ModelLoadError, UnsupportedError
from kvinfer.loaders.dequant import SUPPORTED_GGUF_TYPES, dequantize, nbytes_for, type_name
from kvinfer.loaders.gguf_plan import expected_shape, fusion_order, lazy_names, widening_note
from kvinfer.models.families import GGUF_FAMILIES, model_config_from_hf
from kvinfer.models.families.llama import (GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, rope_scaling_from_freqs,
                                           unpermute_rows)
from kvinfer.models.families.moe import gguf_experts

log = logging.getLogger("kvinfer")

# The families with GGUFNames (kvinfer/models/families/); llama covers Mixtral too (llama with expert tensors).
SUPPORTED_ARCHITECTURES = tuple(GGUF_FAMILIES)
_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (little-endian).
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_STRUCT = {k: struct.Struct(v) for k, v in _SCALAR_FMT.items()}
_ARRAY_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\w+)\.weight")
_EXPERT_RE = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.\d+\.(\w+)\.weight")  # one expert's matrix
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
_INT_KEYS = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count",
             "attention.head_count_kv", "context_length", "vocab_size", "attention.key_length", "expert_count",
             "expert_used_count", "expert_feed_forward_length")


@dataclass
class GGUFCheckpoint:
    """A GGUF file decoded: config, float32 tensors under HF names, and every metadata key-value."""

    config: ModelConfig
    # Tensors of one GGML type are views into one shared float32 buffer (see read_gguf).
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    tensor_types: dict[str, str]  # HF name -> GGML type name
    # HF name -> (undequantised bytes as uint8 [rows, row_bytes] (1-D for vectors), type name, torch shape);
    # q/k rows are already put back in HF order. Filled only with keep_raw=True.
    raw: dict[str, tuple[np.ndarray, str, tuple]] = field(default_factory=dict)
    # [start, end) addresses of the file's mapping where raw entries view it (read_gguf's mapped_types), else empty.
    mapped_span: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order
    type_id: int
    offset: int  # from the start of the data section


class _Truncated(Exception):
    pass


class _Parser:
    """Reads the header, key-values and tensor infos from a buffer, checking every read against its end."""

    def __init__(self, buf):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(f"needs {n} bytes at offset {self.pos}, the file has {self.size}")

    def scalar(self, st: struct.Struct):
        self._need(st.size)
        v = st.unpack_from(self.buf, self.pos)[0]
        self.pos += st.size
        return v

    def u32(self) -> int:
        return self.scalar(_U32)

    def u64(self) -> int:
        return self.scalar(_U64)

    def string(self) -> str:
        n = self.u64()
        self._need(n)
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            # Keep the exact bytes recoverable (str.encode('utf-8', 'surrogateescape')).
            return b.decode("utf-8", "surrogateescape")

    def _strings(self, count: int) -> list[str]:
        # Vocabularies hold ~10^5 strings; a tight loop on locals keeps this well under 0.1 s.
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self._need(8)
            n = unpack(buf, pos)[0]
            pos += 8
            end = pos + n
            if end > size:
                self.pos = pos
                self._need(n)
            b = buf[pos:end]
            pos = end
            try:
                append(b.decode("utf-8"))
            except UnicodeDecodeError:
                append(b.decode("utf-8", "surrogateescape"))
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        st = _SCALAR_STRUCT.get(vtype)
        if st is None:
            raise _Truncated(f"unknown metadata value type {vtype} at offset {self.pos}")
        v = self.scalar(st)
        if vtype == _FLOAT32:
            # float32 values such as 1e-5 would otherwise come back as 9.999999747378752e-06.
            v = float(str(np.float32(v)))
        return v

    def array(self) -> list:
        etype = self.u32()
        count = self.u64()
        if etype in _ARRAY_DTYPE:
            dt = np.dtype(_ARRAY_DTYPE[etype])
            self._need(count * dt.itemsize)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += count * dt.itemsize
            return arr.tolist()
        if etype == _STRING:
            return self._strings(count)
        if etype == _ARRAY:
            return [self.array() for _ in range(count)]
        raise _Truncated(f"unknown array element type {etype} at offset {self.pos}")

    def magic_and_version(self) -> int:
        self._need(4)
        magic = bytes(self.buf[0:4])
        if magic != _MAGIC:
            raise _NotGGUF(f"starts with {magic!r}, not {_MAGIC!r}")
        self.pos = 4
        return self.u32()

    def metadata(self, kv_count: int) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self.string()
            meta[key] = self.value(self.u32())
        return meta

    def tensor_infos(self, count: int) -> list[_TensorInfo]:
        infos = []
        for _ in range(count):
            name = self.string()
            n_dims = self.u32()
            if n_dims > 8:
                raise _Truncated(f"tensor {name!r} claims {n_dims} dims")
            dims = [self.u64() for _ in range(n_dims)]
            type_id = self.u32()
            offset = self.u64()
            # GGUF lists dims fastest-first (ggml's ne[]); torch wants them slowest-first.
            infos.append(_TensorInfo(name, tuple(reversed(dims)), type_id, offset))
        return infos


class _NotGGUF(Exception):
    pass


# The last file's parsed header: a model load opens the same file twice (config, then tensors), and parsing a
# vocabulary's ~10^5 strings is a good part of start-up. Keyed by path, size, mtime and inode.
_HEADER_CACHE: dict[tuple, tuple] = {}


class _File:
    """An open, memory-mapped GGUF file with its parsed header; close() releases the mapping if it can."""

    def __init__(self, path: Union[str, Path], with_tensors: bool):
        self.path = Path(path)
        self._fh = None
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < 24:
                    raise ModelLoadError(f"{self.path} is not a GGUF file (only {size} bytes)")
                # Copy-on-write keeps the arrays writable, so torch.from_numpy needs no copy or warning.
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {e.strerror or e}") from None
        key = self._header_key()
        cached = _HEADER_CACHE.get(key)
        if cached is not None and (cached[1] is not None or not with_tensors):
            self.metadata = dict(cached[0])
            self.infos = list(cached[1] or []) if with_tensors else []
            self.data_start = cached[2] if with_tensors else 0
            return
        try:
            p = _Parser(self.mm)
            version = p.magic_and_version()
            if version not in (2, 3):
                if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
                    raise UnsupportedError(f"{self.path} is a big-endian GGUF file; only little-endian is supported")
                raise UnsupportedError(f"{self.path} has GGUF version {version}; supported versions: 2, 3")
            n_tensors, n_kv = p.u64(), p.u64()
            self.metadata = p.metadata(n_kv)
            self.infos: list[_TensorInfo] = []
            self.data_start = 0
            if with_tensors:
                self.infos = p.tensor_infos(n_tensors)
                align = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
                if not isinstance(align, int) or align <= 0:
                    raise _Truncated(f"general.alignment={align!r}")
                self.data_start = -(-p.pos // align) * align
        except _NotGGUF as e:
            self.close()
            raise ModelLoadError(f"{self.path} is not a GGUF file ({e})") from None
        except KvinferError:
            self.close()
            raise
        except (_Truncated, struct.error, ValueError, OverflowError, MemoryError) as e:
            self.close()
            raise ModelLoadError(f"GGUF file {self.path} is truncated or corrupt: {e}") from None
        _HEADER_CACHE.clear()
        _HEADER_CACHE[key] = (dict(self.metadata), list(self.infos) if with_tensors else None, self.data_start)

    def _header_key(self) -> tuple:
        st = self.path.stat()
        return (str(self.path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)

    def _span(self, info: _TensorInfo) -> tuple[int, int]:
        """(start, bytes) of a tensor's data, checked against the file's size."""
        try:
            n = nbytes_for(info.type_id, info.shape)
        except ModelLoadError as e:
            raise ModelLoadError(f"GGUF file {self.path}: tensor {info.name}: {e}") from None
        start = self.data_start + info.offset
        if start + n > len(self.mm):
            raise ModelLoadError(
                f"GGUF file {self.path} is truncated: tensor {info.name} ends at byte {start + n}, "
                f"the file has {len(self.mm)}"
            )
        return start, n

    def tensor_bytes(self, info: _TensorInfo) -> np.ndarray:
        """A view of the tensor's bytes in the mapping (pages touched stay resident while it lives)."""
        start, n = self._span(info)
        return np.frombuffer(self.mm, dtype=np.uint8, count=n, offset=start)

    def read_tensor(self, info: _TensorInfo, order: Optional[np.ndarray] = None,
                    out: Optional[np.ndarray] = None) -> np.ndarray:
        """The tensor's bytes read into `out` (or a new array) with plain reads, rows put in `order` if given.

        Read rather than viewed in the mapping: the process then holds each byte once, in memory it owns, and
        the page cache (not counted against it) holds the file."""
        start, n = self._span(info)
        if out is None:
            out = np.empty(n, dtype=np.uint8)
        if self._fh is None:
            try:
                self._fh = open(self.path, "rb", buffering=0)
            except OSError as e:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: {e.strerror or e}") from None
        view = memoryview(out).cast("B")
        self._fh.seek(start)
        done = 0
        while done < n:  # one read returns at most ~2 GiB on Linux
            got = self._fh.readinto(view[done:])
            if not got:
                raise ModelLoadError(f"GGUF file {self.path} is truncated: tensor {info.name} could not be read "
                                     f"past byte {start + done}")
            done += got
        if order is not None:
            # Rows are independent runs of whole blocks, so reordering the bytes reorders the rows.
            rows = out.reshape(info.shape[0], -1)
            rows[:] = rows[order]
        return out

    def close(self) -> None:
        if getattr(self, "_fh", None) is not None:
            self._fh.close()
            self._fh = None
        try:
            self.mm.close()
        except (BufferError, AttributeError):
            pass  # arrays still view the mapping (keep_raw); it goes when they do


def read_metadata(path: Union[str, Path]) -> dict[str, Any]:
    """Every GGUF key-value as plain Python values, without touching tensor data."""
    f = _File(path, with_tensors=False)
    f.close()
    return f.metadata


def _hf_name(gguf_name: str, arch: str) -> Optional[str]:
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m:
        return None
    hf = GGUF_FAMILIES[arch].gguf.layer_names.get(m.group(2)) or GGUF_LAYER_NAMES.get(m.group(2))
    return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}" if hf else None


def _unstack_experts(tensors: dict) -> dict:
    """Stacked expert tensors [experts, rows, cols] (or their raw blocks) as one entry per expert under the
    Hugging Face per-expert names (views, no copy); every other entry as it is."""
    out = {}
    for name, t in tensors.items():
        m = _STACKED_EXPERTS.fullmatch(name)
        if not m:
            out[name] = t
            continue
        if isinstance(t, tuple):  # raw: (uint8 [experts * rows, row_bytes], type, (experts, rows, cols))
            data, tname, shape = t
            n, rows = shape[0], shape[1]
            for e in range(n):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = (data[e * rows:(e + 1) * rows], tname, shape[1:])
        else:
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e]
    return out


class _Header:
    """What a family's GGUF config hook reads (GGUFNames.config): the file, its architecture's metadata, tensors."""

    def __init__(self, f: _File, arch: str, infos: dict[str, _TensorInfo]):
        self._f, self.path, self.arch, self.infos = f, f.path, arch, infos

    def opt(self, key: str, default=None):
        full = f"{self.arch}.{key}"
        v = self._f.metadata.get(full, default)
        if key in _INT_KEYS and v is not None and (type(v) is not int or v <= 0):
            # e.g. per-layer head counts (a list), which the decoder has no notion of
            raise UnsupportedError(f"GGUF file {self.path}: metadata {full}={v!r} is not supported (need an integer "
                                   "> 0)")
        return v

    def need(self, key: str):
        if f"{self.arch}.{key}" not in self._f.metadata:
            raise ModelLoadError(f"GGUF file {self.path} lacks the metadata key {self.arch}.{key}")
        return self.opt(key)

    def values(self, name: str) -> list[float]:
        info = self.infos[name]
        return dequantize(self._f.tensor_bytes(info), info.type_id, info.shape).tolist()


def _hf_config_dict(f: _File, arch: str, infos: dict[str, _TensorInfo]) -> dict[str, Any]:
    meta = f.metadata
    h = _Header(f, arch, infos)
    opt, need = h.opt, h.need
    spec = GGUF_FAMILIES[arch]

    heads = need("attention.head_count")
    d: dict[str, Any] = {
        "model_type": spec.model_type,
        "hidden_size": need("embedding_length"),
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": opt("attention.head_count_kv", heads),
        "max_position_embeddings": opt("context_length", 2048),
        "rms_norm_eps": opt("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": opt("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in infos,
    }
    vocab = opt("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in infos:
        vocab = infos["token_embd.weight"].shape[0]
    if vocab is None:
        raise ModelLoadError(f"GGUF file {f.path} gives no vocabulary size")
    d["vocab_size"] = vocab
    if opt("attention.key_length") is not None:
        d["head_dim"] = opt("attention.key_length")
    if "blk.0.attn_q.bias" in infos:
        d["attention_bias"] = True
    if "blk.0.ffn_gate.bias" in infos or "blk.0.ffn_up.bias" in infos:
        d["mlp_bias"] = True

    scaling = opt("rope.scaling.type")
    if spec.gguf.own_rope:  # the family's config hook reads it
        pass
    elif scaling is not None and scaling != "none":
        d["rope_scaling"] = {"rope_type": scaling, "factor": float(opt("rope.scaling.factor", 1.0))}
        if opt("rope.scaling.original_context_length") is not None:
            d["rope_scaling"]["original_max_position_embeddings"] = opt("rope.scaling.original_context_length")
    elif _ROPE_FREQS in infos:
        freqs = dequantize(f.tensor_bytes(infos[_ROPE_FREQS]), infos[_ROPE_FREQS].type_id,
                           infos[_ROPE_FREQS].shape).double().numpy()
        dim = opt("rope.dimension_count") or d.get("head_dim") or d["hidden_size"] // heads
        d["rope_scaling"] = rope_scaling_from_freqs(freqs, float(d["rope_theta"]), dim, meta, arch, f.path)
    if spec.gguf.config is not None:
        spec.gguf.config(h, d)
    if opt("expert_count") is not None or "blk.0.ffn_gate_inp.weight" in infos:
        gguf_experts(h, d)

    if "tokenizer.ggml.bos_token_id" in meta:
        d["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
    # Chat GGUFs often mark the end-of-turn token separately; generation should stop on it too.
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    eos = list(dict.fromkeys(eos))
    if eos:
        d["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return d


def _architecture(f: _File) -> str:
    arch = f.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(
            f"GGUF architecture {arch!r} in {f.path} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _config(f: _File, arch: str, infos: dict[str, _TensorInfo]) -> ModelConfig:
    """The file's ModelConfig; a config the normaliser refuses is refused naming the file."""
    try:
        return model_config_from_hf(_hf_config_dict(f, arch, infos))
    except (ModelLoadError, UnsupportedError) as e:
        if str(f.path) in str(e):
            raise
        raise type(e)(f"GGUF file {f.path}: {e}") from None


def read_gguf(path: Union[str, Path], keep_raw: bool = False, lazy_types: frozenset = frozenset(),
              mapped_types: frozenset = frozenset()) -> GGUFCheckpoint:
    """Parse a GGUF file (SUPPORTED_ARCHITECTURES) into a ModelConfig and float32 tensors under Hugging Face names
    (stacked expert tensors split into one matrix per expert, as views).

    Matrices of a type in lazy_types (with keep_raw) are not dequantized: their tensors are shape-only
    placeholders on the meta device, for a caller that swaps them for layers over the raw blocks. Those of a type in
    mapped_types too (rows in file order) view the file's private mapping (mapped_span) instead of being read: for a
    caller that packs them into copies of its own at once, then gives their pages back and never reads them."""
    f = _File(path, with_tensors=True)
    try:
        arch = _architecture(f)
        infos = {i.name: i for i in f.infos}
        if len(infos) != len(f.infos):
            raise ModelLoadError(f"GGUF file {f.path} names a tensor twice")
        names: dict[str, str] = {}
        for info in f.infos:
            if info.name == _ROPE_FREQS or info.name in GGUF_FAMILIES[arch].gguf.config_tensors:
                continue  # read into the config
            hf = _hf_name(info.name, arch)
            if hf is None:
                raise UnsupportedError(
                    f"GGUF tensor {info.name} in {f.path} has no Hugging Face counterpart for architecture {arch}"
                )
            tname = type_name(info.type_id)
            if tname not in SUPPORTED_GGUF_TYPES:
                raise UnsupportedError(
                    f"GGUF tensor type {tname} is not supported (supported: {', '.join(SUPPORTED_GGUF_TYPES)}); "
                    f"tensor {info.name} in {f.path} uses it"
                )
            names[info.name] = hf

        config = _config(f, arch, infos)
        for gname, hf in names.items():
            want = expected_shape(hf, config)
            got = infos[gname].shape
            if want is not None and tuple(got) != want:
                raise ModelLoadError(
                    f"GGUF file {f.path}: tensor {gname} has shape {list(reversed(got))}, the header's metadata "
                    f"implies {list(reversed(want))} (GGUF order)"
                )
        permuted = GGUF_FAMILIES[arch].gguf.permuted
        types: dict[str, str] = {}
        raw: dict[str, tuple[np.ndarray, str, tuple]] = {}
        # type -> [(hf name, shape, bytes already read, or (info, row order) to read into the type's buffer)]
        by_type: dict[str, list[tuple[str, tuple, Any]]] = {}
        lazy: dict[str, torch.Tensor] = {}
        shapes_types = {n: (i.shape, i.type_id) for n, i in infos.items()}
        lazy_set = lazy_names(names, shapes_types, lazy_types) if keep_raw else set()
        # Without lazy types the caller may want any tensor's blocks (it keeps float copies too); with them, only
        # the lazy matrices' blocks are kept and every other tensor's bytes are dropped once widened.
        raw_all = keep_raw and not lazy_types
        widened = []
        any_mapped = False
        for gname, hf in names.items():
            info = infos[gname]
            n_head = None
            if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
                n_head = config.num_heads
            elif permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
                n_head = config.num_kv_heads
            order = unpermute_rows(n_head, info.shape[0]).numpy() if n_head is not None else None
            tname = type_name(info.type_id)
            types[hf] = tname
            rows = math.prod(info.shape[:-1])  # a stacked expert tensor's rows: every expert's, one after another
            if hf in lazy_set or raw_all:
                mapped = hf in lazy_set and tname in mapped_types and order is None
                data = f.tensor_bytes(info) if mapped else f.read_tensor(info, order)
                any_mapped |= mapped
                raw[hf] = (data.reshape(rows, -1) if len(info.shape) > 1 else data, tname, info.shape)
                if hf in lazy_set:
                    lazy[hf] = torch.empty(tuple(info.shape), device="meta")
                else:
                    by_type.setdefault(tname, []).append((hf, info.shape, data))
            else:
                if lazy_types and len(info.shape) >= 2 and tname != "F32":
                    widened.append((gname, tname, info.shape, f._span(info)[1]))
                by_type.setdefault(tname, []).append((hf, info.shape, (info, order)))

        if widened:
            log.warning("%s", widening_note(f.path, widened))
        # One dequantize call per type rather than per tensor: a few hundred small torch ops cost more in
        # dispatch and thread wake-ups (badly so on a busy machine) than the arithmetic itself.
        decoded: dict[str, torch.Tensor] = dict(lazy)
        for tname in list(by_type):
            items = by_type.pop(tname)
            # q, k, v and gate, up side by side: the decoder fuses them, and adjacent pieces fuse as a view.
            items.sort(key=lambda it: fusion_order(it[0]))
            if isinstance(items[0][2], np.ndarray):
                flat = items[0][2] if len(items) == 1 else np.concatenate([d for _, _, d in items])
            else:  # read each tensor straight into its place in one buffer
                spans = [f._span(info)[1] for _, _, (info, _) in items]
                flat = np.empty(sum(spans), dtype=np.uint8)
                at = 0
                for (_, _, (info, order)), n in zip(items, spans):
                    f.read_tensor(info, order, out=flat[at:at + n])
                    at += n
            sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape, _ in items]
            out = dequantize(flat, tname, (sum(sizes),))
            del flat
            for (hf, shape, _), piece in zip(items, torch.split(out, sizes)):
                decoded[hf] = piece.view(shape)
        del by_type
        tensors = _unstack_experts({hf: decoded[hf] for hf in names.values()})
        raw = _unstack_experts(raw)
        types = {n: types[n] if n in types else types[_EXPERT_RE.sub(r"\1.\2.weight", n)] for n in tensors}
        if any_mapped:  # the header is parsed: its pages can go (the caller gives the tensors' back as it packs)
            f.mm.madvise(mmap.MADV_DONTNEED, 0, f.data_start // mmap.PAGESIZE * mmap.PAGESIZE)
        at = np.frombuffer(f.mm, dtype=np.uint8).ctypes.data if any_mapped else 0
        return GGUFCheckpoint(config=config, tensors=tensors, metadata=f.metadata, tensor_types=types, raw=raw,
                              mapped_span=(at, at + len(f.mm)) if any_mapped else (0, 0))
    finally:
        f.close()


def read_metadata_config(path: Union[str, Path]) -> ModelConfig:
    """The ModelConfig of a GGUF file from its header alone (no tensor data is read)."""
    f = _File(path, with_tensors=True)
    try:
        return _config(f, _architecture(f), {i.name: i for i in f.infos})
    finally:
        f.close()
