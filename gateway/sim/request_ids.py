"""The ``x-request-id`` values a simulated engine received (a testing aid, not vLLM state).

vLLM uses the header, when present, as the base of its request id (``chatcmpl-<id>``,
``cmpl-<id>``). The log keeps the last ``capacity`` values in arrival order, so a test can
assert what a gateway sent (for example, that every retry carried a distinct id), and counts
the ids in flight (the engine request ids older vLLM derived from the header), for
``--reject-duplicate-request-ids``.
"""

from __future__ import annotations

from collections import Counter, deque

DEFAULT_CAPACITY = 10_000


class RequestIdLog:
    """Received ids (bounded, oldest dropped first) and the ids of requests in flight."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._recent: deque[str] = deque(maxlen=capacity)
        self._in_flight: Counter[str] = Counter()
        self.total = 0

    def received(self, request_id: str) -> None:
        """Record one received value (every generation request that carried the header)."""
        self._recent.append(request_id)
        self.total += 1

    def recent(self) -> list[str]:
        """The last ``capacity`` values, oldest first."""
        return list(self._recent)

    def in_flight(self, request_id: str) -> bool:
        return self._in_flight[request_id] > 0

    def started(self, request_id: str) -> None:
        self._in_flight[request_id] += 1

    def ended(self, request_id: str) -> None:
        """Pair of ``started``; must be called exactly once per ``started``."""
        self._in_flight[request_id] -= 1
        if self._in_flight[request_id] <= 0:
            del self._in_flight[request_id]

    @property
    def num_in_flight(self) -> int:
        return sum(self._in_flight.values())
