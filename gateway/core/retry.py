"""Retry-After that means something: when the line ahead, and the retries already advised,
will have drained.

The gateway observes how fast its requests end (`ReleaseRate`: sequences and blocks released
per second over a sliding window; times passed in). A request refused for want of room (a
full line, a wait that ran out) is told to come back when, at that rate, enough will have
been released for everything ahead of it — the waiting line *and the refused requests told
to come back before it* — plus itself:

    seconds = max(seq_deficit / seqs_per_s, block_deficit / blocks_per_s, 1 / seqs_per_s)
    deficit = ahead + promised (not yet due) + own − free now

so refusals given at the same moment get advice consistent with each other (each one a
release later than the one before: they come back in order, not as a herd), and never
earlier than the first expected release (`1 / seqs_per_s`, the mean time between two).
Before any rate has been observed, the configured fallback, also spread by the promises.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from gateway.core.kvmath import ceil_div

MIN_RETRY_S = 0.1
MAX_RETRY_S = 300.0


class ReleaseRate:
    """Sequences and blocks released per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._events: deque[tuple[float, int, int]] = deque()  # (time, blocks, seqs)
        self._blocks = 0
        self._seqs = 0

    def record(self, now: float, blocks: int, seqs: int = 1) -> None:
        self._events.append((now, blocks, seqs))
        self._blocks += blocks
        self._seqs += seqs
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            _, blocks, seqs = self._events.popleft()
            self._blocks -= blocks
            self._seqs -= seqs

    def _span(self, now: float) -> float | None:
        """None until at least two releases were seen in the window (no rate to speak of)."""
        self._trim(now)
        if len(self._events) < 2:
            return None
        return max(now - self._events[0][0], 1.0)

    def per_second(self, now: float) -> float | None:
        """Blocks released per second; None without a rate."""
        span = self._span(now)
        return None if span is None else self._blocks / span

    def seqs_per_second(self, now: float) -> float | None:
        """Sequences released per second; None without a rate."""
        span = self._span(now)
        return None if span is None else self._seqs / span


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


@dataclass(frozen=True, slots=True)
class Room:
    """Sequences and blocks: what is free now, what waits ahead, what one request needs."""

    seqs: int
    blocks: int


class RetryForecast:
    """Advises refused requests when to come back, remembering what it advised (the
    promises) until each is due. One per gateway process; not thread-safe."""

    def __init__(self, rate: ReleaseRate, fallback_s: float) -> None:
        if fallback_s <= 0:
            raise ValueError("fallback_s must be > 0")
        self.rate = rate
        self.fallback_s = fallback_s
        self._promised: list[tuple[float, int, int]] = []  # a heap of (due, seqs, blocks)
        self._seqs = 0
        self._blocks = 0

    def promised(self, now: float) -> Room:
        """Retries advised and not yet due: they will stand ahead of the next one."""
        while self._promised and self._promised[0][0] <= now:
            _, seqs, blocks = heapq.heappop(self._promised)
            self._seqs -= seqs
            self._blocks -= blocks
        return Room(self._seqs, self._blocks)

    def advise(
        self, now: float, *, need: Room, ahead: Room, free: Room, promise: bool = True
    ) -> RetryAdvice:
        """When a request needing `need`, refused with `ahead` waiting in line before it and
        `free` room on its engines now, should come back (see the module docstring).
        `promise`: remember the advice, so that later ones come after it."""
        promised = self.promised(now)
        seqs_per_s = self.rate.seqs_per_second(now)
        blocks_per_s = self.rate.per_second(now)
        if seqs_per_s is None or blocks_per_s is None or seqs_per_s <= 0 or blocks_per_s <= 0:
            seconds = self.fallback_s * (1 + len(self._promised))
        else:
            seq_deficit = ahead.seqs + promised.seqs + need.seqs - max(0, free.seqs)
            block_deficit = ahead.blocks + promised.blocks + need.blocks - max(0, free.blocks)
            seconds = max(seq_deficit / seqs_per_s, block_deficit / blocks_per_s, 1.0 / seqs_per_s)
        seconds = min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))
        if not promise:
            return RetryAdvice(seconds)
        heapq.heappush(self._promised, (now + seconds, need.seqs, need.blocks))
        self._seqs += need.seqs
        self._blocks += need.blocks
        return RetryAdvice(seconds)
