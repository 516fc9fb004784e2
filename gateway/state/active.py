"""The in-process store's active tenants (gateway/core/headroom.py), with the aggregates the
headroom rule needs kept as they change, so that no decision visits every tenant.

A tenant is remembered from its first admission or enqueue (while headroom is on) until it
is found inactive (nothing held, nothing queued, not seen within the window) at a
`prune`: exactly the tenants the rule before issue 14 kept, forgotten at the same calls.
Kept for them: the sum of their weights (exact: a float sum in one order or another
differs in the last bit; this is the correctly rounded sum, whatever the order), the sum of
their held blocks, the holders ordered by held blocks per weight (those above a given
share are the first few from the top), the holders with a last request ordered by
`(min(average, held) + last need) / weight` (a bound below the same with the average now,
which lies between the two: those whose burst claim may hold at a given share are the first
few from the bottom), and a heap of when each unpinned tenant was last seen (the next to age
out is the first). tests/state/test_scale.py checks that the work
per decision does not grow with the tenants.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

from gateway.core import headroom as room

_EPSILON = 2.0**-53
_SCALE = 1074  # every float is a whole multiple of 2**-1074


def _scaled(weight: float) -> int:
    """`weight` × 2**1074, exactly (a float is n / 2**k with k ≤ 1074): sums of these are
    exact, and `_unscaled` rounds them once (int / int is correctly rounded)."""
    n, d = float(weight).as_integer_ratio()
    return n << (_SCALE - d.bit_length() + 1)


def _unscaled(total: int) -> float:
    return total / (1 << _SCALE)


@dataclass(slots=True)
class Unused:
    """The sum of the other active tenants' unused shares of the pool, as the rule computes
    it (`headroom.unused_share` per tenant, summed one by one), known without visiting
    every tenant: `approx` is the same sum from the maintained totals (`share × weights −
    held`, plus what the few tenants above their share hold beyond it) and `slack` bounds
    how far the two float computations can differ. The rule only compares the sum with an
    integer number of free blocks; within `slack` of `approx` the tenants are visited and
    the sum is computed term by term (`exact`), so the comparison is always the rule's."""

    approx: float
    slack: float
    exact: Callable[[], float]
    _exact: float | None = None

    def against(self, pool_free_after: float) -> float:
        """A value that compares with `pool_free_after` as the per-tenant sum does."""
        if abs(pool_free_after - self.approx) > self.slack:
            return self.approx
        if self._exact is None:
            self._exact = self.exact()
        return self._exact


class ActiveTenants:
    def __init__(self, window: float) -> None:
        self.window = window
        self._records: dict[str, room.Activity] = {}
        self._tracked: dict[str, tuple[float, int, int]] = {}  # name → weight, held, scaled
        self._weights = 0  # the sum of the scaled weights
        self._held = 0
        self._ratios: Any = SortedList()  # (held / weight, name) of holders
        self._claims: Any = SortedList()  # (claim key, name) of holders with a last need
        self._claim_key: dict[str, float] = {}
        self._aging: list[tuple[float, str]] = []  # heap of (last seen, name), unpinned
        self._aging_at: dict[str, float] = {}  # name → its last seen in the heap
        self._pinned: set[str] = set()  # holding blocks or queued

    def __len__(self) -> int:
        return len(self._records)

    def get(self, name: str) -> room.Activity | None:
        return self._records.get(name)

    def set(self, name: str, record: room.Activity, *, held: int, queued: int) -> None:
        """Write the tenant's record (seen or observed); `held`, `queued`: its state now."""
        self._records[name] = record
        self.update(name, held=held, queued=queued)

    def update(self, name: str, *, held: int, queued: int) -> None:
        """The tenant's held blocks or queued entries may have changed."""
        pinned = held > 0 or queued > 0
        if pinned:
            self._pinned.add(name)
        else:
            self._pinned.discard(name)
        record = self._records.get(name)
        if record is None:
            return
        self._untrack(name)
        scaled = _scaled(record.weight)
        self._tracked[name] = (record.weight, held, scaled)
        self._weights += scaled
        self._held += held
        if held > 0:
            self._ratios.add((held / record.weight, name))
            if record.need > 0:
                key = (min(record.average, held) + record.need) / record.weight
                self._claim_key[name] = key
                self._claims.add((key, name))
        if not pinned and self._aging_at.get(name) != record.last_seen:
            self._aging_at[name] = record.last_seen
            heapq.heappush(self._aging, (record.last_seen, name))

    def prune(self, now: float) -> None:
        """Forget the tenants that are not active at `now` (`headroom.is_active`)."""
        while self._aging and now - self._aging[0][0] > self.window:
            last_seen, name = heapq.heappop(self._aging)
            if self._aging_at.get(name) == last_seen:
                del self._aging_at[name]
            record = self._records.get(name)
            if record is None or record.last_seen != last_seen or name in self._pinned:
                continue  # seen since (a later item), or pinned (pushed again when unpinned)
            self._untrack(name)
            del self._records[name]

    def others_weight(self, name: str) -> float:
        """The active tenants' weights but `name`'s (call `prune` first)."""
        own = self._tracked.get(name)
        return _unscaled(self._weights - (own[2] if own else 0))

    def unused(self, name: str, *, pool: int, total: float) -> Unused:
        """The other active tenants' unused shares of `pool` (`headroom.unused_share`, with
        `total` the active weights, the asking tenant's included)."""
        own = self._tracked.get(name)
        weights = _unscaled(self._weights - (own[2] if own else 0))
        held = self._held - (own[1] if own else 0)
        per_weight = pool / total
        approx = per_weight * weights - held
        scale = per_weight * weights + held
        # Tenants holding more than their share: their terms are 0, not negative.
        visited = 0
        for ratio, other in reversed(self._ratios):
            if ratio < per_weight * (1 - 1e-9):
                break
            visited += 1
            if other == name:
                continue
            w, h, _ = self._tracked[other]
            approx += max(0.0, h - w * per_weight)
            scale += h + w * per_weight
        n = len(self._records) + visited
        slack = 4 * (n + 16) * _EPSILON * (scale + 1) + 1e-9

        def exact() -> float:
            return sum(  # in the order the tenants were first seen, as before issue 14
                room.unused_share(
                    held=self._tracked[other][1], weight=record.weight, total=total, capacity=pool
                )
                for other, record in self._records.items()
                if other != name
            )

        return Unused(max(0.0, approx), slack, exact)

    def claims(
        self, name: str, *, pool: int, total: float, limit: float, now: float
    ) -> tuple[float, float]:
        """The other holders' `headroom.burst_claim`s of `pool` at `now` summed, `(excess,
        claims)`, in the order of their claim keys (then names), stopping once the excess is
        above `limit` (the pool's free blocks: the rule's answer is then known, the claims
        being at least the excess). Visits only the holders whose claim may hold at this
        share (key ≤ pool / total), and at most `headroom.CLAIM_VISITS` of them, not every
        tenant."""
        bound = pool / total * (1 + 1e-9)
        excess = claims = 0.0
        visits = 0
        for key, other in self._claims:
            if key > bound or visits == room.CLAIM_VISITS:
                break
            if other == name:
                continue
            visits += 1
            weight, held, _ = self._tracked[other]
            record = self._records[other]
            claim, more = room.burst_claim(
                held=held,
                average=room.average_at(record, held=held, now=now, window=self.window),
                need=record.need,
                weight=weight,
                total=total,
                capacity=pool,
            )
            excess += more
            claims += claim
            if excess > limit:
                break
        return excess, claims

    def _untrack(self, name: str) -> None:
        counted = self._tracked.pop(name, None)
        if counted is None:
            return
        weight, held, scaled = counted
        self._weights -= scaled
        self._held -= held
        if held > 0:
            self._ratios.remove((held / weight, name))
        key = self._claim_key.pop(name, None)
        if key is not None:
            self._claims.remove((key, name))
