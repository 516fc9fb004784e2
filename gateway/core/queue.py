"""The waiting line: requests that do not fit yet wait here, in order, until a deadline.

The queue decides *order* and *who may be tried on which engine*; it never touches engines
or clocks itself (times are passed in). Dispatch walks waiters in order and tries to place
each on the engines it may use; a waiter that cannot be placed *claims* its engines for the
rest of that pass, so nobody behind it overtakes it there (no starvation of large requests),
while waiters for other engines still move.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Waiter:
    """A queued request: which engines it may use and how much it needs (for estimates)."""

    id: str
    engines: frozenset[str]
    blocks: int
    enqueued_at: float
    deadline: float
    tenant: str = "default"
    priority: int = 0


class WaitQueue(Protocol):
    """What the service needs of a queue discipline (FIFO here; fair queuing plugs in)."""

    def __len__(self) -> int: ...
    def has_room(self) -> bool: ...
    def push(self, waiter: Waiter) -> None: ...
    def remove(self, waiter_id: str) -> Waiter | None: ...
    def in_order(self) -> Iterator[Waiter]: ...
    def expired(self, now: float) -> list[Waiter]: ...
    def blocks_ahead(self, engines: frozenset[str]) -> int: ...


class FifoQueue:
    """First come, first served, bounded by `max_length`."""

    def __init__(self, max_length: int) -> None:
        if max_length < 0:
            raise ValueError("max_length must be >= 0")
        self.max_length = max_length
        self._waiters: dict[str, Waiter] = {}  # insertion order is arrival order

    def __len__(self) -> int:
        return len(self._waiters)

    def has_room(self) -> bool:
        return len(self._waiters) < self.max_length

    def push(self, waiter: Waiter) -> None:
        if not self.has_room():
            raise OverflowError("queue is full")
        if waiter.id in self._waiters:
            raise KeyError(f"waiter {waiter.id} already queued")
        self._waiters[waiter.id] = waiter

    def remove(self, waiter_id: str) -> Waiter | None:
        return self._waiters.pop(waiter_id, None)

    def in_order(self) -> Iterator[Waiter]:
        # A copy: the caller removes waiters while iterating.
        return iter(list(self._waiters.values()))

    def expired(self, now: float) -> list[Waiter]:
        """Remove and return the waiters whose deadline has passed."""
        gone = [w for w in self._waiters.values() if w.deadline <= now]
        for w in gone:
            del self._waiters[w.id]
        return gone

    def blocks_ahead(self, engines: frozenset[str]) -> int:
        """Blocks queued by waiters that compete for any of `engines`."""
        return sum(w.blocks for w in self._waiters.values() if w.engines & engines)


@dataclass
class DispatchPass:
    """One walk over the queue: tracks engines claimed by waiters that could not be placed."""

    claimed: set[str] = field(default_factory=set)

    def usable(self, waiter: Waiter) -> frozenset[str]:
        """Engines this waiter may be tried on in this pass (none claimed by someone ahead)."""
        return waiter.engines - self.claimed

    def stuck(self, waiter: Waiter) -> None:
        """`waiter` could not be placed: its engines are claimed for the rest of the pass."""
        self.claimed |= waiter.engines
