"""The Responses API's store (store: true): the newest responses in memory within a byte budget."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class StoredResponse:
    body: dict  # the response as it was returned
    conversation: list[dict]  # chat messages up to and including its answer (for previous_response_id)
    inputs: list[dict]  # the items of its own input (GET .../input_items)
    size: int  # bytes it holds (as UTF-8 JSON: body, conversation and inputs), counted against the store's budget


def default_store_bytes() -> int:
    """A small share of the machine's memory: 1/32 of it, at most 1 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(16 << 20, min(1 << 30, total // 32))


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


class ResponseStore:
    """The newest responses in memory, every stored byte counted against one budget; the oldest go first."""

    def __init__(self, max_bytes: Optional[int] = None):
        self.max_bytes = default_store_bytes() if max_bytes is None else max_bytes
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        self.evicted = 0  # responses dropped to stay within the budget, since start-up

    def put(self, body: dict, conversation: list[dict], inputs: Optional[list[dict]] = None) -> None:
        inputs = inputs or []
        size = _json_bytes(body) + _json_bytes(conversation) + _json_bytes(inputs)
        if size > self.max_bytes:  # could never fit: keeping it would evict everything else for nothing
            self.evicted += 1
            return
        self.items[body["id"]] = StoredResponse(body, conversation, inputs, size)
        self.bytes += size
        while self.items and self.bytes > self.max_bytes:
            self.bytes -= self.items.popitem(last=False)[1].size
            self.evicted += 1

    def get(self, response_id: str) -> Optional[StoredResponse]:
        return self.items.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self.items.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None
