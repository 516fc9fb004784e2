"""Engines kept ordered by free KV blocks, so that "the engine with the most free blocks" is a
lookup and not a visit of every engine (issue 14; docs/engine-index.md).

The order is the default routing's (`gateway.core.routing`): most free blocks first, then
fewest running sequences; then the engine's *kind* (a number the caller gives engines alike
in all a decision reads of them but their load) and its name, so that engines ranked as
one come in parts of one kind, each in name order (the order the scheduler gives its
candidates in: a chooser offered the tied engines sees them as when every engine is
scored). Only engines that could take a one-sequence request are in
it (`open`: healthy, a free sequence slot); the store moves an engine as its free blocks or
running sequences change, O(log engines) each.

`first` walks from the top to the first engine that passes a test, stopping where free
blocks fall below a floor or where the test says that nothing further down can pass: the
test is the router's filter and the headroom rule, so the walk visits only the engines
ranked above the choice that fail them (for the common one-sequence ask with the headroom
rule off or engines of equal capacity: none). `tied` lists the engines ranked as one
without visiting them, in parts of one kind (engines alike in all a decision reads of them
but their load): the engines of a part pass or fail the test alike, so one of each part
decides for all.

Pure and mutable; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import overload

from sortedcontainers import SortedList

_Key = tuple[int, int, int, str]  # (-free blocks, running sequences, kind, name)


class EngineOrder:
    """Engines ordered by (most free blocks, fewest running, kind, name)."""

    __slots__ = ("_keys", "_order")

    def __init__(self) -> None:
        self._keys: dict[str, _Key] = {}
        self._order: SortedList = SortedList()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def set(self, name: str, free: int, running: int, open: bool = True, kind: int = 0) -> None:
        """Place `name` with `free` blocks and `running` sequences; out of the order when
        not `open` (it cannot take a one-sequence request now). Engines of one `kind` are
        alike in all a decision reads of them but their load (the caller numbers them)."""
        old = self._keys.get(name)
        key = (-free, running, kind, name)
        if old == key and open:
            return
        if old is not None:
            self._order.remove(old)
            del self._keys[name]
        if open:
            self._order.add(key)
            self._keys[name] = key

    def discard(self, name: str) -> None:
        old = self._keys.pop(name, None)
        if old is not None:
            self._order.remove(old)

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        """(name, free blocks, running), best first."""
        for neg_free, running, _kind, name in self._order:
            yield name, -neg_free, running

    def first(self, passes: Callable[[str], bool | None], floor: float) -> str | None:
        """The best-ranked engine that passes `passes`, walking from the top: engines with
        fewer than `floor` free blocks are not visited (none of them could pass), nor any
        after one for which `passes` returns None (it knows none of the rest can pass).
        None if no engine passes."""
        for neg_free, _running, _kind, name in self._order:
            if -neg_free < floor:
                break
            verdict = passes(name)
            if verdict is None:
                break
            if verdict:
                return str(name)
        return None

    def tied(self, name: str, *, by_running: bool = True) -> list[Sequence[str]]:
        """The engines ranked as `name` (equal free blocks and, `by_running`, equal running
        sequences), in parts whose engines are of one kind with equal running sequences:
        each part in name order, its engines unvisited (views of the order, found by
        bisection: O(parts × log engines), whatever the parts' sizes)."""
        neg_free, running, _, _ = self._keys[name]
        if by_running:
            lo = self._order.bisect_left((neg_free, running))
            hi = self._order.bisect_left((neg_free, running + 1))
        else:
            lo = self._order.bisect_left((neg_free,))
            hi = self._order.bisect_left((neg_free + 1,))
        parts: list[Sequence[str]] = []
        while lo < hi:
            first: _Key = self._order[lo]
            end = min(hi, self._order.bisect_left((first[0], first[1], first[2] + 1)))
            parts.append(Names(self._order, lo, end))
            lo = end
        return parts


class Names(Sequence[str]):
    """The names of a slice of an order, read as they are asked for (a chooser asks for
    its length and one item)."""

    __slots__ = ("_hi", "_lo", "_order")

    def __init__(self, order: SortedList, lo: int, hi: int) -> None:
        self._order, self._lo, self._hi = order, lo, hi

    def __len__(self) -> int:
        return self._hi - self._lo

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return str(self._order[self._lo + (i % n)][3])

    def __iter__(self) -> Iterator[str]:
        for key in self._order.islice(self._lo, self._hi):
            yield key[3]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Names({list(self)!r})"
