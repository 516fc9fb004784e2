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
Before any rate has been observed (a cold start), the configured fallback stands for the
time the requests running now take to end: the same deficit is counted in such
"generations" of what runs (`running`), one `fallback_s` each, at least one.

A promise also holds a place in the line (`held_places`) until its client comes back (the
first arrival after it is due claims it, `claim`) or `PROMISE_GRACE_S` after it was due:
the refused stand in a line of their own, in the order they were advised. A retry is kept
out of the real line only by the places promised before its own, a newcomer by those due
before it would be through the line (every one before a release rate is known); otherwise
requests arriving meanwhile fill the line again and the advised retry is refused a second
time, its advice made worthless by newcomers.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass

from gateway.core.kvmath import ceil_div

MIN_RETRY_S = 0.1
MAX_RETRY_S = 300.0

PROMISE_GRACE_S = 1.5
"""How long after its advice a retry still finds its place held: `Retry-After` is whole
seconds (rounded up, so up to 1 s late), and a client's clock and network add a little."""


class ReleaseRate:
    """Sequences and blocks released per second over the last `window_s` seconds.

    Bounded whatever the rate: releases within `window_s / BUCKETS` of the first of a bucket
    are summed into it, so at most `BUCKETS + 1` buckets are kept (a release leaves the
    window with its bucket's first, at most `window_s / BUCKETS` early)."""

    BUCKETS = 256

    def __init__(self, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._width = window_s / self.BUCKETS
        # [time of its first release, blocks, sequences, releases], oldest first
        self._buckets: deque[list[float]] = deque()
        self._blocks = 0
        self._seqs = 0
        self._releases = 0

    def record(self, now: float, blocks: int, seqs: int = 1) -> None:
        last = self._buckets[-1] if self._buckets else None
        if last is not None and 0.0 <= now - last[0] < self._width:
            last[1] += blocks
            last[2] += seqs
            last[3] += 1
        else:
            self._buckets.append([now, blocks, seqs, 1])
        self._blocks += blocks
        self._seqs += seqs
        self._releases += 1
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] < now - self.window_s:
            _, blocks, seqs, releases = self._buckets.popleft()
            self._blocks -= int(blocks)
            self._seqs -= int(seqs)
            self._releases -= int(releases)

    def _span(self, now: float) -> float | None:
        """None until at least two releases were seen in the window (no rate to speak of)."""
        self._trim(now)
        if self._releases < 2:
            return None
        return max(now - self._buckets[0][0], 1.0)

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


PROMISE_TICKS_PER_S = 10
"""Promises are summed per tenth of a second of their due time (rounded up: a promise counts
until at most 0.1 s after it is due): however many refusals are advised, at most
`MAX_RETRY_S × PROMISE_TICKS_PER_S` sums are kept."""


class RetryForecast:
    """Advises refused requests when to come back, remembering what it advised (the
    promises) until each is due. One per gateway process; not thread-safe.

    Memory is bounded whatever the refusal rate: promises are summed per tick of their due
    time (`PROMISE_TICKS_PER_S`), and at most `max_places` places are kept in line (None: no
    cap; a line of `queue.max_length` places cannot keep more)."""

    def __init__(self, rate: ReleaseRate, fallback_s: float, max_places: int | None = None) -> None:
        if fallback_s <= 0:
            raise ValueError("fallback_s must be > 0")
        self.rate = rate
        self.fallback_s = fallback_s
        self.max_places = max_places
        self._ticks: list[int] = []  # a heap of the due ticks with a promise
        self._promised: dict[int, tuple[int, int]] = {}  # due tick -> (seqs, blocks)
        self._seqs = 0
        self._blocks = 0
        self._places: list[float] = []  # sorted: the due times of places kept in line

    def _lapse(self, now: float) -> None:
        while self._places and self._places[0] + PROMISE_GRACE_S <= now:
            self._places.pop(0)

    def held_places(self, now: float, claimed: float | None = None, line: int = 0) -> int:
        """Places kept for advised retries (neither claimed nor lapsed) ahead of a request:
        for a retry (`claimed`: the due time of the place it claimed) those due before its
        own; for a newcomer those due before it would be through a line of `line` places
        at the observed release rate (every one before a rate is known: a place taken now
        would still be taken when they come back)."""
        self._lapse(now)
        if claimed is not None:
            return bisect.bisect_left(self._places, claimed)
        seqs_per_s = self.rate.seqs_per_second(now)
        if not seqs_per_s:
            return len(self._places)
        return bisect.bisect_right(self._places, now + line / seqs_per_s)

    def claim(self, now: float) -> float | None:
        """A request arrived: if a kept place is due, it is taken as that place's retry and
        its due time returned; None for a newcomer."""
        self._lapse(now)
        if self._places and self._places[0] <= now:
            return self._places.pop(0)
        return None

    def promised(self, now: float) -> Room:
        """Retries advised and not yet due: they will stand ahead of the next one."""
        while self._ticks and self._ticks[0] <= now * PROMISE_TICKS_PER_S:
            seqs, blocks = self._promised.pop(heapq.heappop(self._ticks))
            self._seqs -= seqs
            self._blocks -= blocks
        return Room(self._seqs, self._blocks)

    def advise(
        self,
        now: float,
        *,
        need: Room,
        ahead: Room,
        free: Room,
        running: Room = Room(0, 0),
        promise: bool = True,
    ) -> RetryAdvice:
        """When a request needing `need`, refused with `ahead` waiting in line before it,
        `free` room on its engines now and `running` held there, should come back (see the
        module docstring).
        `promise`: remember the advice, so that later ones come after it, and hold the
        request's place in the line until it comes back."""
        promised = self.promised(now)
        seqs_per_s = self.rate.seqs_per_second(now)
        blocks_per_s = self.rate.per_second(now)
        seq_deficit = ahead.seqs + promised.seqs + need.seqs - max(0, free.seqs)
        block_deficit = ahead.blocks + promised.blocks + need.blocks - max(0, free.blocks)
        if seqs_per_s is None or blocks_per_s is None or seqs_per_s <= 0 or blocks_per_s <= 0:
            generations = seq_deficit / max(1, running.seqs)
            if running.blocks > 0:
                generations = max(generations, block_deficit / running.blocks)
            seconds = self.fallback_s * max(1.0, generations)
        else:
            seconds = max(seq_deficit / seqs_per_s, block_deficit / blocks_per_s, 1.0 / seqs_per_s)
        seconds = min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))
        if not promise:
            return RetryAdvice(seconds)
        tick = math.ceil((now + seconds) * PROMISE_TICKS_PER_S)
        if tick not in self._promised:
            heapq.heappush(self._ticks, tick)
        seqs, blocks = self._promised.get(tick, (0, 0))
        self._promised[tick] = (seqs + need.seqs, blocks + need.blocks)
        if self.max_places is None or len(self._places) < self.max_places:
            bisect.insort(self._places, now + seconds)
        self._seqs += need.seqs
        self._blocks += need.blocks
        return RetryAdvice(seconds)
