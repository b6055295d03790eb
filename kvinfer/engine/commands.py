"""The commands the AsyncLLMEngine's callers send its engine thread, one small typed message each."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class AddRequests:
    """Queue requests the input processor has checked, all or none, onto one stream; `accepted` resolves (or fails
    with the reason) on the stream's loop."""

    stream: Any  # RequestStream
    requests: list  # [EngineRequest]
    accepted: Any  # asyncio.Future


@dataclass(frozen=True)
class Call:
    """Run `fn(engine)` between two steps; its result resolves `future` on `loop`."""

    fn: Callable[[Any], Any]
    loop: Any
    future: Any


@dataclass(frozen=True)
class StopSample:
    """Output processing found a stop string: sample `index` of the request ends after `kept` tokens."""

    request_id: str
    index: int
    kept: int


@dataclass(frozen=True)
class Retire:
    """The request's outputs are done (it finished normally): the core forgets it. `stream` and `final`: a final
    output held back until the stop commands before this one corrected the counts, handed to the stream after."""

    request_id: str
    stream: Any = None
    final: Optional[Any] = None


@dataclass(frozen=True)
class Abort:
    """Cancel requests (the client left, or the server gave up on them): whatever still runs stops, KV freed."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    """Stop the engine thread."""


Command = AddRequests | Call | StopSample | Retire | Abort | Shutdown
