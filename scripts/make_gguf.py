#!/usr/bin/env python3
"""Random-weight GGUF files at real model shapes, for benchmarking and tests (no real 1B+ model can be downloaded).

    python scripts/make_gguf.py --shape llama-3.2-1b --type Q4_K_M --out /tmp/llama1b-q4km.gguf

The tokenizer section (vocabulary, merges, special ids, chat template) is copied from the built-in model's file,
so the result loads and chats like any GGUF; the vocabulary is therefore the built-in one (49152 tokens), not the
real model's. Weights are normal * 0.02 (norms 1), small enough that activations stay finite at any depth.
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are written directly with the gguf package; any other type
(Q4_K_M, Q6_K, IQ4_XS, ...) is written as F16 (Q8_0 above 2B parameters) and converted by llama.cpp's
llama-quantize (--llama-quantize, $LLAMA_QUANTIZE or /work/llama/build/bin/llama-quantize).
Mixture-of-experts shapes (qwen3moe) are written as llama.cpp's converter writes Qwen3-MoE: the router
ffn_gate_inp [experts, hidden] in F32 (llama-quantize leaves it so), and each projection of every expert stacked
in one 3-D tensor ffn_gate_exps / ffn_up_exps [experts, ffn, hidden], ffn_down_exps [experts, hidden, ffn].
Qwen2-MoE shapes (qwen2moe) add, as that converter writes them, q/k/v biases and a shared expert in every layer:
ffn_gate_shexp / ffn_up_shexp [shared, hidden], ffn_down_shexp [hidden, shared], and its gate ffn_gate_inp_shexp
[1, hidden] in F32 (llama-quantize leaves it so, written 1-D).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPES = {
    # arch, hidden, layers, heads, kv heads, head_dim, ffn, tied, rope theta, q/k/v bias
    "tiny": ("llama", 64, 2, 4, 2, 16, 128, True, 10000.0, False),
    "tiny-256": ("llama", 256, 2, 4, 2, 64, 512, True, 10000.0, False),  # rows of whole K-quant blocks
    "tiny-qwen3": ("qwen3", 64, 2, 4, 2, 32, 128, True, 1000000.0, False),
    "tiny-qwen2": ("qwen2", 64, 2, 4, 2, 16, 128, True, 1000000.0, True),
    "tiny-256-qwen2": ("qwen2", 256, 2, 4, 2, 64, 512, True, 1000000.0, True),  # K-quant blocks (Q4_K_M)
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 64, 8192, True, 500000.0, False),
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 128, 3072, True, 1000000.0, False),
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 64, 4864, True, 1000000.0, True),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 128, 14336, False, 500000.0, False),
    # Qwen3-MoE (arch qwen3moe): ffn is each expert's width; MOE gives the expert count and top-k.
    "tiny-qwen3moe": ("qwen3moe", 64, 2, 4, 2, 32, 32, True, 1000000.0, False),
    "tiny-256-qwen3moe": ("qwen3moe", 256, 2, 4, 2, 64, 256, True, 1000000.0, False),  # K-quant blocks
    "qwen3moe-small": ("qwen3moe", 1024, 16, 16, 4, 128, 768, True, 1000000.0, False),
    # Qwen3-30B-A3B's experts (128 of width 768, top-8) at hidden 1024 and 16 layers: about 3 GiB at Q4_K_M
    "qwen3moe-128e": ("qwen3moe", 1024, 16, 16, 4, 128, 768, True, 1000000.0, False),
    # Qwen2-MoE (arch qwen2moe): as Qwen3-MoE, plus the shared expert of width SHARED.
    "tiny-qwen2moe": ("qwen2moe", 64, 2, 4, 2, 16, 32, True, 1000000.0, True),
    "tiny-256-qwen2moe": ("qwen2moe", 256, 2, 4, 2, 64, 256, True, 1000000.0, True),  # K-quant blocks
}
# experts, experts used per token
MOE = {"tiny-qwen3moe": (8, 2), "tiny-256-qwen3moe": (8, 2), "qwen3moe-small": (64, 8), "qwen3moe-128e": (128, 8),
       "tiny-qwen2moe": (8, 2), "tiny-256-qwen2moe": (8, 2)}
# the shared expert's width (qwen2moe)
SHARED = {"tiny-qwen2moe": 64, "tiny-256-qwen2moe": 256}
DIRECT = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
DEFAULT_QUANTIZE = "/work/llama/build/bin/llama-quantize"


class MakeGGUFError(Exception):
    pass


def builtin_gguf() -> Path:
    from kvinfer.utils import builtin_model_path

    return Path(builtin_model_path())


def tokenizer_entries(src: Path) -> dict:
    """Every tokenizer.* key-value of a GGUF file, as plain Python values."""
    from kvinfer.loaders.gguf_loader import read_metadata

    return {k: v for k, v in read_metadata(src).items() if k.startswith("tokenizer.")}


def add_entries(w, entries: dict) -> None:
    for k, v in entries.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, list(v))


def tensor_shapes(shape: str, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and torch-order shapes, in the order llama.cpp's converter writes them."""
    arch, h, n, heads, kv, hd, ffn, tied, _, bias = SHAPES[shape]
    out = [("token_embd.weight", (vocab, h))]
    for i in range(n):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (heads * hd, h)),
                (b + "attn_k.weight", (kv * hd, h)), (b + "attn_v.weight", (kv * hd, h))]
        if bias:
            out += [(b + "attn_q.bias", (heads * hd,)), (b + "attn_k.bias", (kv * hd,)),
                    (b + "attn_v.bias", (kv * hd,))]
        if arch in ("qwen3", "qwen3moe"):
            out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        out += [(b + "attn_output.weight", (h, heads * hd)), (b + "ffn_norm.weight", (h,))]
        if shape in MOE:
            e = MOE[shape][0]
            out += [(b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_exps.weight", (e, ffn, h)),
                    (b + "ffn_up_exps.weight", (e, ffn, h)), (b + "ffn_down_exps.weight", (e, h, ffn))]
            if shape in SHARED:
                s = SHARED[shape]
                out += [(b + "ffn_gate_inp_shexp.weight", (1, h)), (b + "ffn_gate_shexp.weight", (s, h)),
                        (b + "ffn_up_shexp.weight", (s, h)), (b + "ffn_down_shexp.weight", (h, s))]
        else:
            out += [(b + "ffn_gate.weight", (ffn, h)), (b + "ffn_up.weight", (ffn, h)),
                    (b + "ffn_down.weight", (h, ffn))]
    out.append(("output_norm.weight", (h,)))
    if not tied:
        out.append(("output.weight", (vocab, h)))
    return out


def name_is_router(name: str) -> bool:
    """The experts' router and the shared expert's gate: F32 in the converter's files whatever the type."""
    return name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))


def _encode(a: np.ndarray, qtype: str, name: str = ""):
    """(array to write, raw GGML type or None) for one tensor."""
    import gguf
    from gguf.quants import quantize

    if a.ndim == 1 or qtype == "F32" or name_is_router(name):
        return a, None
    if qtype == "F16":
        return a.astype(np.float16), None
    t = gguf.GGMLQuantizationType[qtype]
    return quantize(a, t), t


def write_direct(out: Path, shape: str, qtype: str, seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """Write a file of one of the DIRECT types, one tensor in memory at a time."""
    import gguf
    from gguf.quants import quantize  # noqa: F401 (fail early when the package is too old)

    if shape not in SHAPES:
        raise MakeGGUFError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    if qtype not in DIRECT:
        raise MakeGGUFError(f"type {qtype} is not written directly (direct: {', '.join(DIRECT)})")
    arch, h, n, heads, kv, hd, ffn, tied, theta, _ = SHAPES[shape]
    tok = tokenizer_entries(tokenizer_from or builtin_gguf())
    vocab = len(tok["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"random {shape}")
    w.add_block_count(n)
    w.add_context_length(8192)
    w.add_embedding_length(h)
    # Qwen2-MoE's configs give the shared expert's width as intermediate_size (the converter's feed_forward_length)
    w.add_feed_forward_length(SHARED.get(shape, ffn))
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6 if arch.startswith("qwen") else 1e-5)
    w.add_vocab_size(vocab)
    if shape in MOE:
        w.add_expert_count(MOE[shape][0])
        w.add_expert_used_count(MOE[shape][1])
        w.add_expert_feed_forward_length(ffn)
    if shape in SHARED:
        w.add_expert_shared_feed_forward_length(SHARED[shape])
    w.add_file_type({"F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9,
                     "Q8_0": 7}[qtype])
    add_entries(w, tok)
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(shape, vocab)
    # Shapes and types first (the header), then each tensor generated, encoded and written in turn.
    for name, shp in shapes:
        probe, raw = _encode(np.zeros((1, shp[-1]) if len(shp) > 1 else shp, np.float32), qtype, name)
        if raw is None:
            nbytes = int(np.prod(shp)) * probe.dtype.itemsize
            w.add_tensor_info(name, shp, probe.dtype, nbytes)
        else:
            row = probe.nbytes
            rows = int(np.prod(shp[:-1]))
            w.add_tensor_info(name, (*shp[:-1], row), np.dtype(np.uint8), rows * row, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp in shapes:
        if len(shp) == 1:
            a = (np.ones(shp) if name.endswith("norm.weight") else 0.02 * rng.standard_normal(shp)).astype(np.float32)
        else:
            a = rng.standard_normal(shp, dtype=np.float32)
            a *= 0.02
        w.write_tensor_data(_encode(a, qtype, name)[0])
    w.close()
    return out


def find_quantize(given: str | None) -> Path:
    p = given or os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize") or DEFAULT_QUANTIZE
    if not Path(p).is_file():
        raise MakeGGUFError(f"types other than {', '.join(DIRECT)} need llama.cpp's llama-quantize, and {p} does not "
                            "exist (build target llama-quantize; give --llama-quantize PATH or $LLAMA_QUANTIZE)")
    return Path(p)


def make(out: Path, shape: str, qtype: str, seed: int = 0, llama_quantize: str | None = None) -> Path:
    qtype = qtype.upper()
    if qtype in DIRECT:
        return write_direct(out, shape, qtype, seed)
    tool = find_quantize(llama_quantize)
    if shape not in SHAPES:
        raise MakeGGUFError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    params = sum(int(np.prod(shp)) for name, shp in tensor_shapes(shape, 0) if name.startswith("blk."))
    via = "F16" if params < 2e9 else "Q8_0"
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = write_direct(Path(tmp) / "src.gguf", shape, via, seed)
        r = subprocess.run([str(tool), "--allow-requantize", str(src), str(out), qtype, str(os.cpu_count() or 1)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise MakeGGUFError(f"{tool} {qtype} failed (exit {r.returncode}): {tail[0]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q4_0", help=f"GGML type or llama-quantize name (direct: {', '.join(DIRECT)})")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-quantize", default=None, help="path of llama.cpp's llama-quantize")
    args = ap.parse_args(argv)
    try:
        make(args.out, args.shape, args.type, args.seed, args.llama_quantize)
    except (MakeGGUFError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB ({args.shape}, {args.type})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
