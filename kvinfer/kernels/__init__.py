"""CPU kernels in C, built per ISA level with gcc on first use and chosen once at start-up: matmuls over GGML
quantised or float weights, attention over the KV cache read in place, the decoder's row operations and a fused
decode step. Every level computes the same bits (see simd.h).

The package, by concern (a newcomer reads them in this order):
  build.py   the sources, each level's compiler flags, compiling and the cache directory
  levels.py  what the CPU allows, which level runs (KVINFER_ISA) and the switches the levels read
  abi.py     type ids, error codes, the ctypes mirrors of kernels.h's structs and every C prototype
  ops.py     Kernels: one level's library, each C call wrapped with its argument checks
  kept.py    KeptTiles: a quantised weight's copy laid out for the VNNI and AMX routes
  active.py  the loaded libraries, the active one, and the module-level calls that go to it
This file only re-exports their public names."""
from __future__ import annotations

# Imported before a library is loaded: torch brings its own libgomp.so.1, and our -fopenmp library then binds to
# that same runtime (same soname) instead of loading a second one, so both share one thread pool.
import torch  # noqa: F401

from .abi import (FLOAT_TYPES, KV_DTYPES, KV_SCALED, KV_STORAGE, MAX_PARTS, QTYPES, AttnJob, DecodeExpert, DecodeJob,
                  DecodeLayer, DecodePart, Sampling)
from .active import (PreparedMatmul, _reset, activation_bits, active, attention, available, decode_step, decode_steps,
                     describe, embed_rows, gelu, layer_norm, level, library, library_path, load, matmul, moe_route,
                     rms_norm, rope_pair_, sample_row, set_activation_bits, silu_mul, unavailable_reason)
from .build import CC, DISPATCH_SOURCE, HEADERS, LEVEL_FLAGS, LEVELS, SOURCES, build
from .kept import KeptTiles
from .levels import batch_invariant, best_level, cpu_features, drop_source_enabled, keep_tiles_enabled
from .ops import Kernels, role_runs

__all__ = ["LEVELS", "QTYPES", "available", "unavailable_reason", "level", "cpu_features", "library", "Kernels",
           "batch_invariant", "matmul", "PreparedMatmul", "attention", "embed_rows", "rms_norm", "layer_norm",
           "silu_mul", "moe_route", "gelu", "rope_pair_", "decode_step", "decode_steps", "sample_row", "DecodeLayer",
           "DecodeExpert", "DecodeJob", "Sampling", "library_path", "build", "load", "describe", "activation_bits",
           "set_activation_bits"]
