"""Compiling the kernel libraries: the sources, each ISA level's flags, the compiler, and the cache directory.

Libraries are cached in $KVINFER_CACHE/kernels/<hash>/ ($KVINFER_CACHE defaults to ~/.cache/kvinfer, or
$XDG_CACHE_HOME/kvinfer), keyed by level, sources, compiler and flags. $CC picks the compiler (default gcc)."""
from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from kvinfer.options import options

HERE = Path(__file__).parent
DISPATCH_SOURCE = HERE / "dispatch.c"
# Every level's library: each concern's source (abi.c: the table of struct layouts tests check abi.py's mirrors
# against), the AMX routes in amx/ (empty below the avx512 level); dispatch.c is built on its own, without arch flags.
SOURCES = [p for p in sorted(HERE.glob("*.c")) + sorted(HERE.glob("amx/*.c")) if p != DISPATCH_SOURCE]
HEADERS = sorted(HERE.glob("*.h")) + sorted(HERE.glob("amx/*.h"))
CC = os.environ.get("CC") or "gcc"
LEVELS = ("generic", "avx2", "avx512")
_COMMON = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
LEVEL_FLAGS = {
    "generic": _COMMON + ["-DKVQ_LEVEL=0"],
    "avx2": _COMMON + _AVX2 + ["-DKVQ_LEVEL=1"],
    # 256-bit vectors on purpose: a reduction's lane count is part of its result (and wide vectors cost clock).
    "avx512": _COMMON + _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                                 "-mamx-tile", "-mamx-int8", "-mprefer-vector-width=256", "-DKVQ_LEVEL=2"],
}


def _cache_root() -> Path:
    root = options().cache
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvinfer"


def build(cc: Optional[str] = None, flags: Optional[list[str]] = None, cache_dir: Optional[Path] = None,
          sources: Optional[list[Path]] = None, name: str = "libkvinfer.so") -> Path:
    """Compile a library (unless already cached) and return its path; raises RuntimeError on failure.

    Defaults: the kernel sources with the avx2 level's flags. The .so goes to cache_dir, by default
    <cache>/kernels/<hash of sources, compiler and flags>/ (under the system temp dir when the cache cannot be
    created). It is compiled to a temporary name and renamed into place, so concurrent processes never load a
    half-written file; a finished file is reused without needing a compiler.
    """
    cc = cc or CC
    flags = list(LEVEL_FLAGS["avx2"] if flags is None else flags)
    sources = list(SOURCES if sources is None else sources)
    h = hashlib.sha256(b"".join(p.read_bytes() for p in sources + HEADERS))
    h.update("\0".join([cc, *flags, platform.machine()]).encode())
    digest = h.hexdigest()[:16]
    user = os.getuid() if hasattr(os, "getuid") else "user"
    spare = Path(tempfile.gettempdir()) / f"kvinfer-{user}" / "kernels" / digest
    out_dir = Path(cache_dir) if cache_dir is not None else _cache_root() / "kernels" / digest
    if cache_dir is None and not (out_dir / name).exists() and (spare / name).exists():
        out_dir = spare
    target = out_dir / name
    if target.exists():
        return target
    argv = shlex.split(cc)  # CC may carry a wrapper or options ("ccache gcc")
    exe = shutil.which(argv[0]) if argv else None
    if exe is None:
        raise RuntimeError(f"C compiler {cc!r} not found on PATH")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        if cache_dir is not None:
            raise
        out_dir, target = spare, spare / name  # an unwritable home should not cost us the kernels
        out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([exe, *argv[1:], *flags, "-o", tmp, *map(str, sources), "-lm"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{cc} could not run: {e}") from e
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target

