"""A quantised weight's kept copy (KeptTiles): laid out once for the VNNI and AMX routes, registered with the
library under the weight's address, and able to give the weight's own pages back (and restore them)."""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch

from .abi import QTYPES, _check

if TYPE_CHECKING:
    from .ops import Kernels

# Types whose kept copy holds every byte of the GGUF rows (kvq_kept_rows reads them back), so the rows themselves
# need not stay resident; and the source bytes packed at a time when they are dropped (the peak above the copy).
_DROPPABLE = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})
_DROP_CHUNK_BYTES = 32 << 20
_MADV_DONTNEED = 4


def _drop_pages(addr: int, nbytes: int) -> None:
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
    """A weight's copy in AMX tile layout, registered with the library under the weight's address (by
    Kernels.keep_tiles) for as long as this object lives. It holds the weight too, so that the address cannot be
    reused meanwhile; the weight's bytes must not change while it is kept.

    With dropped set, the weight's own pages were given back once packed (every kernel that reads the weight finds
    the copy: matmuls and embedding rows); restore_source() writes the GGUF bytes back from the copy for readers
    outside the kernels (dequantization, sharding), and release() does so before unregistering."""

    __slots__ = ("_lib", "weight", "tiles", "qtype", "n", "k", "dropped", "__weakref__")

    def __init__(self, lib: "Kernels", w: torch.Tensor, tiles: torch.Tensor, qtype: str = "", n: int = 0,
                 k: int = 0, dropped: bool = False):
        self._lib, self.weight, self.tiles = lib, w, tiles
        self.qtype, self.n, self.k, self.dropped = qtype, n, k, dropped

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()

    def restore_source(self) -> None:
        """Makes the weight's GGUF bytes resident again (if they were dropped), from the copy."""
        if self.dropped and self.tiles is not None:
            _restore(self._lib, self.tiles, self.weight, self.n, self.k, self.qtype)
            self.dropped = False

    def drop_source(self) -> bool:
        """Gives the weight's pages back now (a type whose copy holds every byte). Returns whether they are."""
        if not self.dropped and self.tiles is not None and self.qtype in _DROPPABLE and self.weight.is_contiguous():
            _drop_pages(self.weight.data_ptr(), self.weight.numel())
            self.dropped = True
        return self.dropped

    def release(self, restore: bool = True) -> None:
        """Unregisters the copy (matmuls of the weight go back to unpacking per call), first writing the weight's
        dropped GGUF bytes back from it unless restore is False (the weight is going away too)."""
        if self.tiles is not None:
            if restore:
                self.restore_source()
            self._lib.lib.kvq_amx_tiles_register(self.weight.data_ptr(), 0, 0, 0, 0, None)
            self.tiles = None

    def __del__(self):
        # Collected with its layer (which holds it as long as the weight is read): the dropped pages are not
        # written back, which at a model's teardown would bring every weight's bytes back just to free them.
        try:
            self.release(restore=False)
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


def _restore(lib: "Kernels", tiles: torch.Tensor, w: torch.Tensor, n: int, k: int, qtype: str) -> None:
    """Writes every row of w (n GGML rows of k values) back from its kept copy."""
    ids = torch.arange(n, dtype=torch.int64)
    _check(lib.lib.kvq_kept_rows(tiles.data_ptr(), n, k, QTYPES[qtype], ids.data_ptr(), n, w.data_ptr(),
                                 w.stride(0)), "restoring a weight from its kept copy")


