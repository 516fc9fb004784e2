"""Retry-After that means something: the time until the work ahead can drain.

The gateway observes how fast reserved blocks are released (a sliding window of release
events, times passed in) and estimates when enough blocks will have been released for the
queue ahead plus this request. Without observations it falls back to a configured figure.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gateway.core.kvmath import ceil_div

MIN_RETRY_S = 0.1
MAX_RETRY_S = 300.0


class ReleaseRate:
    """Blocks released per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._blocks = 0

    def record(self, now: float, blocks: int) -> None:
        self._events.append((now, blocks))
        self._blocks += blocks
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            _, blocks = self._events.popleft()
            self._blocks -= blocks

    def per_second(self, now: float) -> float | None:
        """None until at least two releases were seen in the window (no rate to speak of)."""
        self._trim(now)
        if len(self._events) < 2:
            return None
        span = max(now - self._events[0][0], 1.0)
        return self._blocks / span


@dataclass(frozen=True, slots=True)
class RetryAdvice:
    seconds: float

    @property
    def header_seconds(self) -> int:
        """`Retry-After` is whole seconds, at least 1."""
        return max(1, ceil_div(int(self.seconds * 1000), 1000))

    @property
    def header_ms(self) -> int:
        return max(1, round(self.seconds * 1000))


def advise_retry(
    blocks_needed: int, free_blocks: int, rate_per_s: float | None, fallback_s: float
) -> RetryAdvice:
    """When `blocks_needed` (the queue ahead plus this request) may be free again."""
    deficit = blocks_needed - max(0, free_blocks)
    if deficit <= 0:
        seconds = MIN_RETRY_S
    elif rate_per_s is None or rate_per_s <= 0:
        seconds = fallback_s
    else:
        seconds = deficit / rate_per_s
    return RetryAdvice(seconds=min(MAX_RETRY_S, max(MIN_RETRY_S, seconds)))
