"""The Responses API responses one simulated engine stored, for ``previous_response_id``.

vLLM (with ``VLLM_ENABLE_RESPONSES_API_STORE=1``; without it ``store`` is silently ignored)
keeps, per engine, each stored response and the conversation it answered, in plain dicts that
it never empties: its store grows for the life of the server. The simulator keeps the last
``capacity`` only (a lookup refreshes one), so that engines under a long soak stay level;
``capacity`` 0 stores nothing, as vLLM's default does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 4096


@dataclass(frozen=True)
class StoredResponse:
    """What a later turn prepends: the conversation the response answered (its
    ``instructions``, history and input as chat messages) and the text it generated."""

    messages: tuple[Mapping[str, Any], ...]
    text: str


class ResponseStore:
    """Response id → ``StoredResponse``, the last ``capacity`` (least recently used first out)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        found = self._entries.get(response_id)
        if found is not None:
            self._entries.move_to_end(response_id)
        return found
