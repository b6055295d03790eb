"""The memory roofline of single-stream decode: at one token per step every weight a step multiplies is read from
memory once, so tokens/s can be no more than (read bandwidth) / (weight bytes read per token). `bench decode`
prints each engine's decode as a share of that bound.

Bytes per token are counted from the GGUF file, the same for every engine: every tensor but the token embedding
(a step gathers one of its rows), which is counted too where the file has no output.weight (the head is the
embedding then, read whole). Stacked expert tensors (`*_exps`) count for the experts a token uses: expert_used_count
of expert_count of their bytes. The read bandwidth is measured here: the best of a few passes summing a buffer far
larger than the caches, with the benchmark's threads, before the rounds and after each (a shared machine's
bandwidth moves with its neighbours' load)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

# Buffer for the bandwidth pass: well beyond any last-level cache of these machines.
BANDWIDTH_BUFFER_BYTES = 1 << 30
BANDWIDTH_PASSES = 5


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the file's tensors a one-token decode step reads (see the module's docstring)."""
    from kvinfer.loaders.dequant import nbytes_for
    from kvinfer.loaders.gguf_loader import _File, read_metadata

    meta = read_metadata(path)
    arch = meta.get("general.architecture", "")
    experts, used = meta.get(f"{arch}.expert_count"), meta.get(f"{arch}.expert_used_count")
    f = _File(path, with_tensors=True)
    try:
        infos = list(f.infos)
    finally:
        f.close()
    names = {i.name for i in infos}
    tied = "output.weight" not in names
    total = 0
    for i in infos:
        if i.name == "token_embd.weight" and not tied:
            continue
        n = nbytes_for(i.type_id, i.shape)
        total += n * used // experts if experts and used and "_exps." in i.name else n
    return total


def read_bandwidth(threads: int, nbytes: Optional[int] = None, passes: Optional[int] = None) -> float:
    """Bytes/s of the best of `passes` summing an nbytes float32 buffer with `threads` threads (torch's vectorised
    reduction: one read of every byte, nothing written back)."""
    nbytes = BANDWIDTH_BUFFER_BYTES if nbytes is None else nbytes
    passes = BANDWIDTH_PASSES if passes is None else passes
    if nbytes < 4 or passes < 1:
        raise ValueError("read_bandwidth needs a buffer of at least 4 bytes and at least one pass")
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        buf.sum()  # pages faulted in, threads started
        best = float("inf")
        for _ in range(passes):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        del buf
    finally:
        torch.set_num_threads(before)
    return (nbytes // 4 * 4) / best


def roofline_line(bytes_per_token: int, bandwidth: float, threads: int, rows: list[dict], samples: int = 1) -> str:
    """One paragraph: the bound and each row's decode as a share of it (bandwidth: the best of `samples`
    measurements of read_bandwidth)."""
    bound = bandwidth / bytes_per_token
    shares = ", ".join(f"{r['name']} {r['decode_tps']:.1f} tok/s = {100 * r['decode_tps'] / bound:.0f}%"
                       for r in rows)
    return (f"memory roofline: {bytes_per_token / 2**20:.1f} MiB of weights read per token, read bandwidth "
            f"{bandwidth / 1e9:.1f} GB/s (best of {samples} x {BANDWIDTH_PASSES} sums of "
            f"{BANDWIDTH_BUFFER_BYTES >> 20} MiB, {threads} threads, before and after each round) -> at most "
            f"{bound:.1f} tok/s; {shares}")
