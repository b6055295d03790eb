"""Benchmarks: each prints ours against a peer measured in the same run, with ratios."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Optional

# The cpuinfo flags that decide which kernels can run and how fast (x86-64); others are left out of the line.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[Optional[str], list[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo-style file; (None, []) when unreadable."""
    model, flags = None, []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value.split()
        if model is not None and flags:
            break
    return model, flags


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """What a benchmark figure was measured on: CPU model, cores, the ISA flags that matter, the kernel level."""
    from kvinfer import kernels

    model, flags = _cpuinfo(cpuinfo)
    feats = kernels.cpu_features()
    amx = ("granted" if feats["amx_granted"] else "listed, not granted by the OS" if feats["amx_listed"]
           else "none")
    gpu = None
    import torch

    if torch.cuda.is_available():  # what --device auto runs on
        gpu = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}"
    return dict(cpu=model or platform.processor() or platform.machine() or "unknown CPU",
                cores=os.cpu_count(), isa=[f for f in ISA_FLAGS if f in flags], amx=amx,
                kernels=kernels.level() or "off", gpu=gpu)


def machine_line(m: Optional[dict] = None) -> str:
    """One line for a benchmark's header, e.g. `machine: AMD EPYC, 2 cores; avx2 fma f16c; AMX none; kernels avx2`."""
    m = machine() if m is None else m
    isa = " ".join(m["isa"]) or "no AVX2"
    gpu = f"; GPU {m['gpu']}" if m.get("gpu") else ""
    return f"machine: {m['cpu']}, {m['cores']} cores; {isa}; AMX {m['amx']}; kernels {m['kernels']}{gpu}"
