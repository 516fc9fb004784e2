"""The order of the waiting line: priority classes, then weighted fair sharing, then arrival.

Start-time fair queuing (Goyal et al., 1996), charged by KV blocks:

- Priority classes are served strictly in order: higher `priority` first.
- Within a class every tenant has a *finish tag*. An entry of tenant t gets
  `start = max(V − B / weight, F_t)` and `finish = start + blocks / weight`, and the line is
  ordered by `(−priority, start, arrival)`. `V`, the class's virtual time, is the smallest
  start tag queued in the class (the entry "in service" in SFQ terms), or — with nothing
  queued — the largest start tag ever served there; and it never goes back: it is at least
  the `V` recorded before each change of the line (the *floor*), so an entry leaving does
  not pull it back either.
- `B` is the *burst credit* in blocks (`burst_blocks`). A tenant that has used less than its
  share lately (`F_t` behind `V`) may start up to `B / weight` before `V`, i.e. ahead of
  everyone waiting at `V`: its burst is served at once, up to `B` blocks, instead of at its
  weight's share while the others' backlog waits. The credit cannot be hoarded: it is the
  distance from `F_t` to `V`, capped at `B / weight`, so whatever a tenant did not use
  earlier, it gets at most `B` blocks ahead of its share. Over any stretch of services in
  line order a tenant gets at most `weight · ΔV + B + one entry` blocks (`ΔV`: how far `V`
  moved; tests/core/test_fairqueue.py checks it for every window), and a
  tenant that waits all along keeps its tags chained (`F_t ≥ V − B / weight`), so it never
  gets credit while it is backlogged. `B = 0` is plain start-time fair queuing. Because `V`
  never goes back, credited entries (which start before `V`) cannot pull the next tenant's
  tags further back: credits do not stack.
- `F_t` is the larger of the finish tag of the tenant's last *served* entry and the finish
  tag of its last *queued* entry. An entry that leaves without being served (timeout, client
  gone) leaves no trace: the tenant's later entries move back by its charge, so abandoned
  requests cost a tenant nothing (measured in benchmarks/bench_fairness.py: without this, a
  tenant whose oldest entries time out falls below its share).
- Admissions that never queued are charged too (`charge`), so a tenant that just took a
  burst of capacity directly goes behind the others when the line forms.
- A served tag that can no longer matter is forgotten (issue 14: tenants come and go, the
  line's memory must not grow with every tenant ever served): once `F_t ≤ V − B / weight`
  (weight as the tag was written), `max(V − B / weight, F_t)` is `V − B / weight` for good,
  since V never goes back; a tenant whose queued entries remain keeps their later tags. A
  few such tags are dropped at each write (`PRUNE_BATCH`, oldest horizon first). Exact while
  the tenant's weight stays; if it comes back with a smaller weight it is a newcomer again,
  with at most its burst credit, as any new tenant.

Consequences the tests pin down: a tenant flooding the line only lengthens its own run of
tags, so another tenant's new entry lands at most one entry of the flooder behind the head
(at the head, with credit left); over any stretch in which two tenants both wait, their
served blocks divided by weight differ by at most one largest entry each; over any stretch,
a tenant exceeds its share of the virtual time by at most `B` blocks plus one entry.

Pure: no clock (expiry times are passed in), no randomness, no I/O. The Redis adapter
implements the same rules in Lua; the conformance suite checks that they agree.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Any

from sortedcontainers import SortedList

PRIORITY_LIMIT = 10**9
"""|priority| must stay below this (the Redis adapter encodes it in fixed width)."""

BURST_BLOCKS = 256
"""The default burst credit `B`, in KV blocks (see the module docstring; 0 turns it off)."""

PRUNE_BATCH = 4
"""Served tags checked for forgetting at each write of one (the first few horizons)."""

_MARGIN = 1e-9
"""A horizon is taken this much (relative) later than computed: float rounding never
forgets a tag that still matters by an ulp."""

NEWCOMER_SEQ = 2**62
"""The arrival number of an ask that is not queued yet: after everyone who is."""

Key = tuple[int, float, int]
"""An entry's place in the line; smaller goes first: (−priority, start tag to six decimals,
arrival)."""

PLACE_DECIMALS = 6
"""Start tags order the line to this many decimals, as the Redis line's text keys do
(`%024.6f`): two tags equal in exact arithmetic but summed along different paths (weight
1.5: 1/1.5 + 4/1.5 and 5/1.5 differ in the last bit) go by arrival in both stores."""


def place(start: float) -> float:
    """A start tag as the line orders it (`PLACE_DECIMALS`)."""
    return round(start, PLACE_DECIMALS)


def check_burst(burst_blocks: float) -> None:
    """Raise ValueError for a burst credit the line cannot use."""
    if not 0 <= burst_blocks < float("inf"):
        raise ValueError(f"burst_blocks must be >= 0 and finite, got {burst_blocks}")


def check_policy(priority: int, weight: float) -> None:
    """Raise ValueError for a priority or weight the line cannot order by."""
    if not -PRIORITY_LIMIT < priority < PRIORITY_LIMIT:
        raise ValueError(f"priority must be within ±{PRIORITY_LIMIT}, got {priority}")
    if not weight > 0:
        raise ValueError(f"weight must be > 0, got {weight}")


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued request with its place in the line."""

    id: str
    tenant: str
    priority: int
    engines: frozenset[str]
    blocks: int
    start: float
    finish: float
    seq: int
    expires_at: float

    @property
    def key(self) -> Key:
        return (-self.priority, place(self.start), self.seq)


def _by_key(entry: Waiting) -> Key:
    return entry.key


class FairQueue:
    """The waiting line and the fair-sharing tags. Mutable; one instance per store.

    Indexed so that no decision walks the whole line: the entries in line order (a sorted
    list), each tenant's count and, per class and tenant, its entries' finish tags (sorted),
    and the expiry times (a heap, stale items skipped). tests/state/test_scale.py checks
    that the work per decision does not grow with the line."""

    def __init__(self, burst_blocks: float = BURST_BLOCKS, *, prune: bool = True) -> None:
        check_burst(burst_blocks)
        self.burst_blocks = float(burst_blocks)
        self.prune = prune  # forget served tags that can no longer matter
        self._entries: dict[str, Waiting] = {}
        self._order: Any = SortedList()  # (key, id) in line order
        self._counts: dict[str, int] = {}  # tenant → entries queued
        self._finishes: dict[tuple[int, str], Any] = {}  # (priority, tenant) → SortedList
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (expires_at, seq, id)
        self._served: dict[tuple[int, str], float] = {}  # (priority, tenant) → finish tag
        # When each served tag stops mattering (V past it by B / weight), in order.
        self._horizons: dict[tuple[int, str], float] = {}
        self._forget: Any = SortedList()  # (horizon, priority, tenant)
        self._idle_v: dict[int, float] = {}  # priority → largest start tag served
        self._floor: dict[int, float] = {}  # priority → V before the last change (V's floor)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entries

    def get(self, entry_id: str) -> Waiting | None:
        return self._entries.get(entry_id)

    def count(self, tenant: str) -> int:
        return self._counts.get(tenant, 0)

    def in_order(self) -> list[Waiting]:
        return [self._entries[i] for _, i in self._order]

    def virtual_now(self, priority: int) -> float:
        """V of the class: the smallest start tag queued in it (the first of the class in
        line order), else the largest served; never below its floor."""
        at = self._order.bisect_left(((-priority,),))
        v = self._idle_v.get(priority, 0.0)
        if at < len(self._order):
            first = self._entries[self._order[at][1]]
            if first.priority == priority:
                v = first.start
        return max(self._floor.get(priority, 0.0), v)

    def last_finish(self, tenant: str, priority: int) -> float:
        finishes = self._finishes.get((priority, tenant))
        queued: float = finishes[-1][0] if finishes else 0.0
        return max(self._served.get((priority, tenant), 0.0), queued)

    def start_tag(self, tenant: str, priority: int, weight: float) -> float:
        """The start tag a new entry of `tenant` would get now: `max(V − B / weight, F_t)`."""
        credit = self.burst_blocks / weight
        return max(self.virtual_now(priority) - credit, self.last_finish(tenant, priority))

    def newcomer_key(self, tenant: str, priority: int, weight: float) -> Key:
        """Where an ask that is not queued would stand: behind everyone already queued with
        the same start tag."""
        return (-priority, place(self.start_tag(tenant, priority, weight)), NEWCOMER_SEQ)

    def push(
        self,
        entry_id: str,
        *,
        tenant: str,
        priority: int,
        weight: float,
        engines: Iterable[str],
        blocks: int,
        expires_at: float,
    ) -> Waiting:
        """Join the line. Pushing an id that is already queued returns its entry unchanged."""
        check_policy(priority, weight)
        if entry_id in self._entries:
            return self._entries[entry_id]
        start = self._tag(tenant, priority, weight)
        self._seq += 1
        entry = Waiting(
            id=entry_id,
            tenant=tenant,
            priority=priority,
            engines=frozenset(engines),
            blocks=blocks,
            start=start,
            finish=start + blocks / weight,
            seq=self._seq,
            expires_at=expires_at,
        )
        self._add(entry)
        heapq.heappush(self._deadlines, (expires_at, entry.seq, entry_id))
        return entry

    def leave(self, entry_id: str) -> Waiting | None:
        """Leave without being served (timeout, client gone): the entry leaves no trace.

        The tenant's later entries in the class move back by its charge, never before the
        place it held — otherwise every abandoned request would leave a hole in the
        tenant's run of tags and cost it its share while it keeps waiting."""
        if entry_id in self._entries:
            self._hold_v(self._entries[entry_id].priority)
        gone = self._drop(entry_id)
        if gone is not None:
            charge = gone.finish - gone.start
            finishes = self._finishes.get((gone.priority, gone.tenant))
            later = [self._entries[i] for _, _, i in finishes or ()]
            for e in later:  # the tenant's own entries in the class, not the whole line
                if e.key > gone.key:
                    start = max(gone.start, e.start - charge)
                    moved = replace(e, start=start, finish=start + (e.finish - e.start))
                    self._drop(e.id)
                    self._add(moved)
        return gone

    def serve(self, entry_id: str) -> Waiting | None:
        """The entry was admitted: its tags become the tenant's and the class's history."""
        if entry_id in self._entries:
            self._hold_v(self._entries[entry_id].priority)
        entry = self._drop(entry_id)
        if entry is not None:
            charge = entry.finish - entry.start  # blocks / weight
            weight = entry.blocks / charge if entry.blocks > 0 and charge > 0 else None
            self._remember(entry.tenant, entry.priority, entry.start, entry.finish, weight)
        return entry

    def charge(self, tenant: str, priority: int, weight: float, blocks: int) -> None:
        """An admission that never queued: charge it as if served straight away."""
        check_policy(priority, weight)
        start = self._tag(tenant, priority, weight)
        self._remember(tenant, priority, start, start + blocks / weight, weight)

    def surcharge(self, tenant: str, priority: int, weight: float, blocks: int) -> None:
        """More blocks for a request already served (its lease grew): the tenant's served
        finish tag moves on by `blocks / weight` from `max(V, F_served)` (no burst credit),
        so its later entries stand further back. V itself does not move: entries queued
        now keep their tags and nobody else's lead is forgiven."""
        check_policy(priority, weight)
        key = (priority, tenant)
        start = max(self.virtual_now(priority), self._served.get(key, 0.0))
        self._set_served(key, start + blocks / weight, weight)

    def expire(self, now: float) -> list[Waiting]:
        """Remove and return entries whose time is up (they leave without service)."""
        due: list[Waiting] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, entry_id = heapq.heappop(self._deadlines)
            e = self._entries.get(entry_id)
            if e is not None and e.seq == seq:  # else served or gone already
                due.append(e)
        gone = sorted(due, key=_by_key)
        for e in gone:
            self.leave(e.id)
        return gone

    def blocked(
        self,
        key: Key,
        engines: AbstractSet[str],
        own_id: str | None = None,
        passable: Callable[[Waiting], bool] | None = None,
    ) -> bool:
        """True when a queued entry ordered before `key` competes for any of `engines`;
        entries for which `passable` is true do not count (see gateway/core/headroom.py)."""
        return self.blocker(key, engines, own_id, passable) is not None

    def blocker(
        self,
        key: Key,
        engines: AbstractSet[str],
        own_id: str | None = None,
        passable: Callable[[Waiting], bool] | None = None,
    ) -> Waiting | None:
        """The nearest queued entry ordered before `key` that competes for any of `engines`
        and is not `passable`; None when there is none (`blocked` is False). Looks back
        from `key` up to the first that blocks: the one a waiter at `key` has to see leave
        before anything else of the line ahead of it can matter."""
        ahead = self._order.irange(maximum=(key,), inclusive=(True, False), reverse=True)
        for _, entry_id in ahead:
            e = self._entries[entry_id]
            if (
                not e.engines.isdisjoint(engines)
                and e.id != own_id
                and (passable is None or not passable(e))
            ):
                return e
        return None

    def next_of_tenant(self, gone: Waiting) -> Waiting | None:
        """The first entry of `gone`'s tenant and class ordered after `gone` (which has left):
        the one that moved up the most when `gone` left unserved."""
        finishes = self._finishes.get((gone.priority, gone.tenant)) or ()
        later = (self._entries[i] for _, _, i in finishes)
        return min((e for e in later if e.key > gone.key), key=_by_key, default=None)

    def blocks_ahead(self, engines: frozenset[str]) -> int:
        """Blocks wanted by queued entries competing for any of `engines`."""
        return sum(e.blocks for e in self._entries.values() if e.engines & engines)

    def _add(self, entry: Waiting) -> None:
        self._entries[entry.id] = entry
        self._order.add((entry.key, entry.id))
        self._counts[entry.tenant] = self._counts.get(entry.tenant, 0) + 1
        finishes = self._finishes.setdefault((entry.priority, entry.tenant), SortedList())
        finishes.add((entry.finish, entry.seq, entry.id))

    def _drop(self, entry_id: str) -> Waiting | None:
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return None
        self._order.remove((entry.key, entry.id))
        left = self._counts[entry.tenant] - 1
        if left:
            self._counts[entry.tenant] = left
        else:
            del self._counts[entry.tenant]
        tag = (entry.priority, entry.tenant)
        self._finishes[tag].remove((entry.finish, entry.seq, entry.id))
        if not self._finishes[tag]:
            del self._finishes[tag]
        return entry

    def _hold_v(self, priority: int) -> None:
        """Record V before the line changes: whatever leaves or joins, V never goes back."""
        self._floor[priority] = self.virtual_now(priority)

    def _tag(self, tenant: str, priority: int, weight: float) -> float:
        """The start tag for a new charge (recording the V it used)."""
        self._hold_v(priority)
        return self.start_tag(tenant, priority, weight)

    def _remember(
        self, tenant: str, priority: int, start: float, finish: float, weight: float | None
    ) -> None:
        key = (priority, tenant)
        self._idle_v[priority] = max(self._idle_v.get(priority, 0.0), start)
        served = self._served.get(key)
        if served is None or finish > served:
            self._set_served(key, finish, weight)
        else:
            self._prune()

    def _set_served(self, key: tuple[int, str], finish: float, weight: float | None) -> None:
        """The tenant's served finish tag is `finish` now; `weight` (None: unknown) says
        when it stops mattering."""
        self._served[key] = finish
        if not self.prune:
            return
        old = self._horizons.pop(key, None)
        if old is not None:
            self._forget.remove((old, *key))
        if weight is not None:  # else kept until a write that knows it
            horizon = (finish + self.burst_blocks / weight) * (1 + _MARGIN) + _MARGIN
            self._horizons[key] = horizon
            self._forget.add((horizon, *key))
        self._prune()

    def _prune(self) -> None:
        """Forget up to `PRUNE_BATCH` served tags whose horizon V has passed."""
        for _ in range(PRUNE_BATCH):
            if not self._forget:
                return
            horizon, priority, tenant = self._forget[0]
            if horizon > self.virtual_now(priority):
                return
            del self._forget[0]
            del self._horizons[(priority, tenant)]
            del self._served[(priority, tenant)]

    def served_tags(self) -> int:
        """How many tenants' served tags the line remembers (tests: they are forgotten)."""
        return len(self._served)
