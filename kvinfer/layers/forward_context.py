"""The facts one forward needs beyond its tensors, set by the runner around exactly that forward and read by the
layers through get_forward_context().

The layers' forward() signatures stay those of torch modules (a linear takes x), so what a step knows about its
rows reaches them here rather than through every call. The attention metadata (md) still travels as an argument:
only the model's attention layers read it, while the facts here are read by linears, experts and attention alike.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator


@dataclass(frozen=True)
class ForwardContext:
    """One forward's facts, as plain immutable data.

    prompt_spans: the rows of the forward's token batch that are prompt tokens, as sorted, disjoint [start, end)
    ranges. Where the prompt route is on, those rows take it (QuantLinears with a kept tile copy, attention); the
    others are computed as usual. A row's route is its role, set by the runner from the row's position against its
    prompt's length, never the batch's, so a request's result does not depend on what shares its steps.
    """

    prompt_spans: tuple[tuple[int, int], ...] = field(default=())

    def __post_init__(self):
        # Callers hand over lists (the step plan's); the context keeps its own copy that nothing can change.
        object.__setattr__(self, "prompt_spans", tuple((int(a), int(b)) for a, b in self.prompt_spans))


EMPTY = ForwardContext()

# A context variable rather than a module global: each thread (the engine's, a test's, a server's) starts with
# EMPTY and never sees a forward another thread is running.
_current: ContextVar[ForwardContext] = ContextVar("kvinfer_forward_context", default=EMPTY)


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Within: ctx is the current forward's context on this thread; the one before comes back after, so a layer
    may set a narrower one for a part of its rows (the experts of a mixture-of-experts layer)."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    """The context of the forward running on this thread; EMPTY outside any forward."""
    return _current.get()

