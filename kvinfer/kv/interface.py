"""The seam between scheduler, runner and a KV backend: the `KVManager` protocol, per-step views, the step layout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, TypeVar, runtime_checkable

from kvinfer.core.request import Request


@dataclass
class SeqSlice:
    """One sequence's part of a step, as the runner hands it to a backend: the view a manager gives of a request."""

    start: int  # tokens already in the cache
    num_new: int  # tokens computed this step
    block_table: Optional[Sequence[int]] = None  # paged
    slot: Optional[int] = None  # contiguous

    @property
    def end(self) -> int:
        return self.start + self.num_new


def is_decode(s: SeqSlice) -> bool:
    """One new token after cached ones: the rows a backend batches into one attention call."""
    return s.num_new == 1 and s.start > 0


T = TypeVar("T")


def decodes_first(items: Sequence[T], view: Callable[[T], SeqSlice]) -> list[T]:
    """The step layout every backend relies on: single-token decodes first (in order), then the rest (in order).

    The runner lays a step out with this; the backends' grouping (`leading_decodes`) reads it back."""
    return [x for x in items if is_decode(view(x))] + [x for x in items if not is_decode(view(x))]


def leading_decodes(seqs: Sequence[SeqSlice]) -> int:
    """How many of a step's sequences, laid out by `decodes_first`, are decodes."""
    n = 0
    while n < len(seqs) and is_decode(seqs[n]):
        n += 1
    return n


@runtime_checkable
class KVManager(Protocol):
    """What the scheduler, engine, runner, page and simulator may ask of a backend's bookkeeping.

    Code outside the factory (kv/factory.py) asks these capabilities, never the backend's name. Memory comes in
    units: blocks of `unit_tokens` tokens (paged), max-length slots (contiguous), none at all (none).
    """

    kind: str  # "paged" | "contiguous" | "none": for logs and the page only
    keeps_kv: bool  # False: nothing is cached, every step recomputes each sequence from its first token
    prefix_caching: bool  # full prompt blocks are found again by content
    can_fork: bool  # fork() shares a parent's cache with its n>1 siblings (copy-on-write)
    unit_name: str  # "block" | "slot" (what the page and logs call a unit)
    unit_tokens: int  # tokens one unit holds
    num_units: int
    token_capacity: int  # tokens all units hold
    max_request_tokens: int  # most tokens (prompt + output) one request can ever hold

    @property
    def num_free_units(self) -> int: ...

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """(cached blocks, tokens they hold) of the request's prompt prefix."""

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
                       reserve: int = 0) -> bool:
        """Room for num_new_tokens more tokens, leaving `reserve` units free afterwards where units are shared
        (paged); False (and no change) if there is none."""

    def trim(self, req: Request, num_tokens: int) -> None: ...

    def free(self, req: Request) -> None: ...

    def fork(self, parent: Request, child: Request) -> None: ...

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must do before the next forward."""

    def can_ever_fit(self, num_tokens: int) -> bool: ...

    def seq_slice(self, req: Request, start: int, num_new: int) -> SeqSlice:
        """The request's view for one step computing tokens [start, start + num_new)."""

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(blocks served from the prefix cache, full prompt blocks looked up)."""

    def reset_prefix_cache(self) -> None: ...

    def snapshot(self, seqs: Sequence[Request]) -> tuple[dict, list[dict]]:
        """JSON-ready picture of the units (fields for the page) and, per request of `seqs`, what it holds."""

    def check_integrity(self) -> None: ...
