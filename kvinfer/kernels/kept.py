"""A quantised weight's kept copy (KeptTiles): laid out once for the VNNI and AMX routes, passed to the library
beside the weight in every call that reads it, and able to give the weight's own pages back (and restore them)."""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Optional

import torch

from .abi import QTYPES, _check

if TYPE_CHECKING:
    from .ops import Kernels

# Types whose kept copy holds every byte of the GGUF rows (kvq_kept_rows reads them back), so the rows themselves
# need not stay resident; and the source bytes packed at a time when they are dropped (the peak above the copy: a
# large weight's source pages are faulted in one run at a time, beside its whole copy).
_DROPPABLE = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                        "IQ4_XS"})
_DROP_CHUNK_BYTES = 8 << 20
_MADV_DONTNEED = 4


def drop_pages(addr: int, nbytes: int) -> None:
    """Gives the whole pages of [addr, addr + nbytes) back to the OS (private memory: they read as zeros, or as the
    file's bytes for a private file mapping, until written again). The caller restores them before any read."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    a, b = -(-addr // page) * page, (addr + nbytes) // page * page
    if b > a:
        _libc().madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC.madvise.restype = ctypes.c_int
    return _LIBC


class KeptTiles:
    """A weight's copy in tile layout (made by Kernels.keep_tiles), which the C calls that read the weight take
    beside it: the owner (a QuantLinear, the fused decode job) passes `ptr` as the calls' kept argument, as it passes
    the bias; C keeps no table of copies. It holds the weight too, whose bytes must not change while it is kept.

    With dropped set, the weight's own pages were given back once packed, so every kernel call that reads the
    weight must be passed the copy (matmuls and embedding rows read it instead); restore_source() writes the GGUF
    bytes back from the copy for readers outside the kernels (dequantization, sharding), and release() does so
    before dropping the copy."""

    __slots__ = ("_lib", "weight", "tiles", "qtype", "n", "k", "dropped", "__weakref__")

    def __init__(self, lib: "Kernels", w: torch.Tensor, tiles: torch.Tensor, qtype: str = "", n: int = 0,
                 k: int = 0, dropped: bool = False):
        self._lib, self.weight, self.tiles = lib, w, tiles
        self.qtype, self.n, self.k, self.dropped = qtype, n, k, dropped

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    @property
    def ptr(self) -> Optional[int]:
        """The copy's address for a C call's kept argument (None once released)."""
        return None if self.tiles is None else self.tiles.data_ptr()

    def ptr_for(self, lib: "Kernels", w: torch.Tensor, n: int, k: int, qtype: str) -> Optional[int]:
        """ptr, after checking that this is the copy of w (n rows of k qtype values) laid out for lib's level: a
        copy's layout is its level's, and C trusts the pointer it is given. ValueError otherwise."""
        if (lib.level != self._lib.level or w.data_ptr() != self.weight.data_ptr()
                or (n, k, qtype) != (self.n, self.k, self.qtype)):
            raise ValueError(f"this kept copy ({self.n}x{self.k} {self.qtype}, level {self._lib.level}) is not the "
                             f"copy of a {n}x{k} {qtype} weight at {w.data_ptr():#x} for level {lib.level}")
        return self.ptr

    def restore_source(self) -> None:
        """Makes the weight's GGUF bytes resident again (if they were dropped), from the copy."""
        if self.dropped and self.tiles is not None:
            _restore(self._lib, self.tiles, self.weight, self.n, self.k, self.qtype)
            self.dropped = False

    def drop_source(self) -> bool:
        """Gives the weight's pages back now (a type whose copy holds every byte). Returns whether they are."""
        if not self.dropped and self.tiles is not None and self.qtype in _DROPPABLE and self.weight.is_contiguous():
            drop_pages(self.weight.data_ptr(), self.weight.numel())
            self.dropped = True
        return self.dropped

    def release(self, restore: bool = True) -> None:
        """Drops this object's reference to the copy (calls made without it unpack the weight per call), first
        writing the weight's dropped GGUF bytes back from it unless restore is False (the weight is going away
        too). A prepared call that was given ptr holds the copy's tensor itself and must be dropped as well."""
        if self.tiles is not None:
            if restore:
                self.restore_source()
            self.tiles = None


def _restore(lib: "Kernels", tiles: torch.Tensor, w: torch.Tensor, n: int, k: int, qtype: str) -> None:
    """Writes every row of w (n GGML rows of k values) back from its kept copy."""
    ids = torch.arange(n, dtype=torch.int64)
    _check(lib.lib.kvq_kept_rows(tiles.data_ptr(), n, k, QTYPES[qtype], ids.data_ptr(), n, w.data_ptr(),
                                 w.stride(0)), "restoring a weight from its kept copy")


