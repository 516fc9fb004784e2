"""Which engine holds a stored Responses API response, and what it used.

vLLM keeps the responses it stored in the memory of the engine that answered; a request
naming one in `previous_response_id` must go back to that engine, and it prepends that
response's conversation to the new input — tokens the gateway counts from the answer it
passed back (its `usage.total_tokens`). Bounded (oldest forgotten first) and per gateway
replica: another replica does not know the id and routes the request as any other (the
engine that lacks the response answers 404).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

MAX_STORED = 10_000
_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]{1,200})"')
_TOTAL = re.compile(rb'"total_tokens"\s*:\s*(\d{1,12})')


@dataclass(frozen=True, slots=True)
class StoredResponse:
    engine: str
    total_tokens: int


class ResponseLog:
    """Response id → the engine that stored it and its total tokens (LRU, bounded)."""

    def __init__(self, max_entries: int = MAX_STORED) -> None:
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._max = max_entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def max_entries(self) -> int:
        """The bound: past it the oldest is forgotten."""
        return self._max

    def remember(self, response_id: str, engine: str, total_tokens: int) -> None:
        self._entries[response_id] = StoredResponse(engine, total_tokens)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        found = self._entries.get(response_id)
        if found is not None:
            self._entries.move_to_end(response_id)
        return found


def response_facts(head: bytes, tail: bytes) -> tuple[str, int] | None:
    """A Responses answer's id (the first ``resp_…`` id in its first bytes: the JSON body's,
    or the stream's ``response.created`` event) and its total tokens (the last
    ``total_tokens`` in its end: the body's, or ``response.completed``'s), or None."""
    found = _ID.search(head)
    if found is None:
        return None
    totals = _TOTAL.findall(tail)
    total = int(totals[-1]) if totals else 0
    return found.group(1).decode(), total
