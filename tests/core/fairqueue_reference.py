"""The waiting line as it was before issue 14 (scans of the whole line): the reference the
indexed `gateway.core.fairqueue` is checked against (tests/core/test_fairqueue_indexed.py).

The rules, as in `gateway.core.fairqueue`:

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

Consequences the tests pin down: a tenant flooding the line only lengthens its own run of
tags, so another tenant's new entry lands at most one entry of the flooder behind the head
(at the head, with credit left); over any stretch in which two tenants both wait, their
served blocks divided by weight differ by at most one largest entry each; over any stretch,
a tenant exceeds its share of the virtual time by at most `B` blocks plus one entry.

Pure: no clock (expiry times are passed in), no randomness, no I/O. The Redis adapter
implements the same rules in Lua; the conformance suite checks that they agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

PRIORITY_LIMIT = 10**9
"""|priority| must stay below this (the Redis adapter encodes it in fixed width)."""

BURST_BLOCKS = 256
"""The default burst credit `B`, in KV blocks (see the module docstring; 0 turns it off)."""

NEWCOMER_SEQ = 2**62
"""The arrival number of an ask that is not queued yet: after everyone who is."""

Key = tuple[int, float, int]
"""An entry's place in the line; smaller goes first: (−priority, start tag, arrival)."""


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
        return (-self.priority, self.start, self.seq)


def _by_key(entry: Waiting) -> Key:
    return entry.key


class FairQueue:
    """The waiting line and the fair-sharing tags. Mutable; one instance per store."""

    def __init__(self, burst_blocks: float = BURST_BLOCKS) -> None:
        check_burst(burst_blocks)
        self.burst_blocks = float(burst_blocks)
        self._entries: dict[str, Waiting] = {}
        self._served: dict[tuple[int, str], float] = {}  # (priority, tenant) → finish tag
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
        return sum(1 for e in self._entries.values() if e.tenant == tenant)

    def in_order(self) -> list[Waiting]:
        return sorted(self._entries.values(), key=_by_key)

    def virtual_now(self, priority: int) -> float:
        starts = [e.start for e in self._entries.values() if e.priority == priority]
        v = min(starts) if starts else self._idle_v.get(priority, 0.0)
        return max(self._floor.get(priority, 0.0), v)

    def last_finish(self, tenant: str, priority: int) -> float:
        queued = [
            e.finish
            for e in self._entries.values()
            if e.tenant == tenant and e.priority == priority
        ]
        return max([self._served.get((priority, tenant), 0.0), *queued])

    def start_tag(self, tenant: str, priority: int, weight: float) -> float:
        """The start tag a new entry of `tenant` would get now: `max(V − B / weight, F_t)`."""
        credit = self.burst_blocks / weight
        return max(self.virtual_now(priority) - credit, self.last_finish(tenant, priority))

    def newcomer_key(self, tenant: str, priority: int, weight: float) -> Key:
        """Where an ask that is not queued would stand: behind everyone already queued with
        the same start tag."""
        return (-priority, self.start_tag(tenant, priority, weight), NEWCOMER_SEQ)

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
        self._entries[entry_id] = entry
        return entry

    def leave(self, entry_id: str) -> Waiting | None:
        """Leave without being served (timeout, client gone): the entry leaves no trace.

        The tenant's later entries in the class move back by its charge, never before the
        place it held — otherwise every abandoned request would leave a hole in the
        tenant's run of tags and cost it its share while it keeps waiting."""
        if entry_id in self._entries:
            self._hold_v(self._entries[entry_id].priority)
        gone = self._entries.pop(entry_id, None)
        if gone is not None:
            charge = gone.finish - gone.start
            for e in list(self._entries.values()):
                if e.tenant == gone.tenant and e.priority == gone.priority and e.key > gone.key:
                    start = max(gone.start, e.start - charge)
                    moved = replace(e, start=start, finish=start + (e.finish - e.start))
                    self._entries[e.id] = moved
        return gone

    def serve(self, entry_id: str) -> Waiting | None:
        """The entry was admitted: its tags become the tenant's and the class's history."""
        if entry_id in self._entries:
            self._hold_v(self._entries[entry_id].priority)
        entry = self._entries.pop(entry_id, None)
        if entry is not None:
            self._remember(entry.tenant, entry.priority, entry.start, entry.finish)
        return entry

    def charge(self, tenant: str, priority: int, weight: float, blocks: int) -> None:
        """An admission that never queued: charge it as if served straight away."""
        check_policy(priority, weight)
        start = self._tag(tenant, priority, weight)
        self._remember(tenant, priority, start, start + blocks / weight)

    def surcharge(self, tenant: str, priority: int, weight: float, blocks: int) -> None:
        """More blocks for a request already served (its lease grew): the tenant's served
        finish tag moves on by `blocks / weight` from `max(V, F_served)` (no burst credit),
        so its later entries stand further back. V itself does not move: entries queued
        now keep their tags and nobody else's lead is forgiven."""
        check_policy(priority, weight)
        key = (priority, tenant)
        start = max(self.virtual_now(priority), self._served.get(key, 0.0))
        self._served[key] = start + blocks / weight

    def expire(self, now: float) -> list[Waiting]:
        """Remove and return entries whose time is up (they leave without service)."""
        gone = sorted((e for e in self._entries.values() if e.expires_at <= now), key=_by_key)
        for e in gone:
            self.leave(e.id)
        return gone

    def blocked(
        self,
        key: Key,
        engines: frozenset[str],
        own_id: str | None = None,
        passable: Callable[[Waiting], bool] | None = None,
    ) -> bool:
        """True when a queued entry ordered before `key` competes for any of `engines`;
        entries for which `passable` is true do not count (see gateway/core/headroom.py)."""
        return any(
            e.key < key
            and e.engines & engines
            and e.id != own_id
            and (passable is None or not passable(e))
            for e in self._entries.values()
        )

    def blocks_ahead(self, engines: frozenset[str]) -> int:
        """Blocks wanted by queued entries competing for any of `engines`."""
        return sum(e.blocks for e in self._entries.values() if e.engines & engines)

    def _hold_v(self, priority: int) -> None:
        """Record V before the line changes: whatever leaves or joins, V never goes back."""
        self._floor[priority] = self.virtual_now(priority)

    def _tag(self, tenant: str, priority: int, weight: float) -> float:
        """The start tag for a new charge (recording the V it used)."""
        self._hold_v(priority)
        return self.start_tag(tenant, priority, weight)

    def _remember(self, tenant: str, priority: int, start: float, finish: float) -> None:
        key = (priority, tenant)
        self._served[key] = max(self._served.get(key, 0.0), finish)
        self._idle_v[priority] = max(self._idle_v.get(priority, 0.0), start)
