"""Every KVINFER_* environment switch, read once into a frozen Options (options()).

The process reads the environment the first time options() is called and keeps that object; code asks it instead
of os.environ, so a switch means the same thing everywhere and a bad value fails with one line that names it.
Tests change switches with override() (in this process), or set the variable and call reload(). Child processes
that kvinfer starts (tensor-parallel workers) get the parent's object handed over (use()); processes started
apart (torchrun, other nodes, subprocesses) read their own environment, as before.

Switches (default first):
  KVINFER_ISA                 best level the CPU allows | generic | avx2 | avx512 (a lower level than the best)
  KVINFER_KERNELS             1 | 0: the C kernels off (the eager PyTorch path, not batch-invariant)
  KVINFER_AMX                 1 | 0: quantised matmuls never on AMX tiles (the same bits either way)
  KVINFER_AMX_KEEP            1 | 0: quantised weights not kept in the VNNI/tile layout (unpacked per call)
  KVINFER_PROMPT_BF16         1 | 0: prompt rows not on the AMX bfloat16 route
  KVINFER_BATCH_INVARIANT     1 | 0: prefill-sized steps may take BLAS and SDPA (faster, not batch-invariant)
  KVINFER_DROP_SOURCE         1 | 0: keep a kept weight's GGUF rows beside its copy
  KVINFER_CACHE               ~/.cache/kvinfer (or $XDG_CACHE_HOME/kvinfer) | a directory for built kernels
  KVINFER_TP_EXACT            1 | 0: tensor parallelism with all-reduces (half the collectives, other last bits)
  KVINFER_TP_START_TIMEOUT    300 | seconds for the ranks to meet and load
  KVINFER_TP_STEP_TIMEOUT     120 | seconds a step's collective may take before the engine fails
  KVINFER_MEASURE_REPS        30 | repetitions of `python -m kvinfer.parallel.measure`
Booleans take 1/0, true/false, yes/no, on/off (any case); empty means the default."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from kvinfer.errors import ValidationError

__all__ = ["Options", "OptionError", "options", "reload", "override", "use", "ISA_LEVELS", "NAMES"]

# The kernels' levels, lowest first (kvinfer.kernels.LEVELS; a test keeps the two alike).
ISA_LEVELS = ("generic", "avx2", "avx512")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class OptionError(ValidationError):
    """A KVINFER_* variable holds a value its switch does not take."""

    def __init__(self, name: str, value: str, reason: str):
        super().__init__(name, value, reason)
        self.args = (f"{name} {reason}, not {value!r}",)


@dataclass(frozen=True)
class Options:
    isa: str = ""                   # "" = the best level the CPU allows
    kernels: bool = True
    amx: bool = True
    amx_keep: bool = True
    prompt_bf16: bool = True
    batch_invariant: bool = True
    drop_source: bool = True
    cache: Optional[str] = None     # None = the default cache directory
    tp_exact: bool = True
    tp_start_timeout: float = 300.0
    tp_step_timeout: float = 120.0
    measure_reps: int = 30
    # The variables as they were set ("" where unset), for what must record the environment itself (a persisted
    # KV block's fingerprint).
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Options":
        """The switches as environ (default os.environ) sets them; OptionError for a bad value."""
        e = os.environ if environ is None else environ
        raw = {name: e.get(name, "") for name in NAMES}
        isa = raw["KVINFER_ISA"].strip().lower()
        if isa and isa not in ISA_LEVELS:
            raise OptionError("KVINFER_ISA", raw["KVINFER_ISA"], f"must be one of {', '.join(ISA_LEVELS)}")
        return cls(isa=isa, kernels=_flag(raw, "KVINFER_KERNELS"), amx=_flag(raw, "KVINFER_AMX"),
                   amx_keep=_flag(raw, "KVINFER_AMX_KEEP"), prompt_bf16=_flag(raw, "KVINFER_PROMPT_BF16"),
                   batch_invariant=_flag(raw, "KVINFER_BATCH_INVARIANT"),
                   drop_source=_flag(raw, "KVINFER_DROP_SOURCE"), cache=raw["KVINFER_CACHE"] or None,
                   tp_exact=_flag(raw, "KVINFER_TP_EXACT"),
                   tp_start_timeout=_seconds(raw, "KVINFER_TP_START_TIMEOUT", 300.0),
                   tp_step_timeout=_seconds(raw, "KVINFER_TP_STEP_TIMEOUT", 120.0),
                   measure_reps=_count(raw, "KVINFER_MEASURE_REPS", 30), env=tuple(raw.items()))

    def raw(self, name: str) -> str:
        """What the environment held for name when these options were read ("" if unset)."""
        return dict(self.env).get(name, "")


NAMES = ("KVINFER_ISA", "KVINFER_KERNELS", "KVINFER_AMX", "KVINFER_AMX_KEEP", "KVINFER_PROMPT_BF16",
         "KVINFER_BATCH_INVARIANT", "KVINFER_DROP_SOURCE", "KVINFER_CACHE", "KVINFER_TP_EXACT",
         "KVINFER_TP_START_TIMEOUT", "KVINFER_TP_STEP_TIMEOUT", "KVINFER_MEASURE_REPS")


def _flag(raw: Mapping[str, str], name: str) -> bool:
    v = raw[name].strip().lower()
    if not v:
        return True  # every boolean switch is on unless set off
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise OptionError(name, raw[name], "must be 1 or 0 (true/false, yes/no, on/off)")


def _seconds(raw: Mapping[str, str], name: str, default: float) -> float:
    v = raw[name].strip()
    if not v:
        return default
    try:
        s = float(v)
    except ValueError:
        s = -1.0
    if not s > 0 or s == float("inf"):
        raise OptionError(name, raw[name], "must be a positive number of seconds")
    return s


def _count(raw: Mapping[str, str], name: str, default: int) -> int:
    v = raw[name].strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise OptionError(name, raw[name], "must be a whole number of at least 1")
    return n


_lock = threading.Lock()
_current: Optional[Options] = None


def options() -> Options:
    """This process's switches, read from the environment on the first call."""
    cur = _current
    if cur is None:
        with _lock:
            if _current is None:
                use(Options.from_env())
            cur = _current
    return cur


def reload() -> Options:
    """Read the environment again (after a test changed it). On a bad value this raises, and the next options()
    tries again."""
    global _current
    with _lock:
        _current = None
    return options()


def use(opts: Options) -> None:
    """Make opts this process's switches (a spawned worker takes its parent's)."""
    global _current
    _current = opts


@contextlib.contextmanager
def override(**changes) -> Iterator[Options]:
    """Within the block, options() has these fields changed (e.g. batch_invariant=False); restored after. For tests
    and tools that compare a switch's two settings in one process; the environment is not touched."""
    before = options()
    use(dataclasses.replace(before, **changes))
    try:
        yield options()
    finally:
        use(before)
