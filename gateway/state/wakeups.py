"""Targeted wake-ups for a store's `wait_behind` callers (issue 14).

A waiter behind a queued entry sleeps until that entry leaves the line; the store tells
this registry when an entry left (`departed`) or when a waiter's own entry moved up
(`wake`). Both stores use it: in-process the store's own calls report, on Redis the change
notices do (so a departure on any replica wakes the waiters here). An entry seen leaving is
remembered for a while (`keep` of them): on Redis the notice can arrive before its waiter
has begun to wait (the admit reply and the message come on different connections).
"""

from __future__ import annotations

import asyncio
import contextlib


class BehindWaiters:
    def __init__(self, keep: int = 0) -> None:
        self._behind: dict[str, set[str]] = {}  # entry id → the waiters behind it
        self._wakes: dict[str, asyncio.Event] = {}  # waiter id → its wake-up
        self._departed: dict[str, None] = {}  # the last `keep` entries seen leaving
        self._keep = keep

    async def wait(self, waiter_id: str, entry_id: str, within_s: float) -> None:
        """Until `entry_id` is reported gone, `waiter_id` is woken, or `within_s`."""
        if entry_id in self._departed:
            return
        event = self._wakes.setdefault(waiter_id, asyncio.Event())
        self._behind.setdefault(entry_id, set()).add(waiter_id)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), within_s)
        finally:
            if self._wakes.get(waiter_id) is event:
                del self._wakes[waiter_id]
            waiters = self._behind.get(entry_id)
            if waiters is not None:
                waiters.discard(waiter_id)
                if not waiters:
                    del self._behind[entry_id]

    def departed(self, entry_id: str) -> None:
        """`entry_id` left the line: wake the waiters behind it."""
        if self._keep:
            self._departed[entry_id] = None
            if len(self._departed) > self._keep:
                del self._departed[next(iter(self._departed))]
        for waiter in self._behind.pop(entry_id, ()):
            self.wake(waiter)

    def wake(self, waiter_id: str) -> None:
        event = self._wakes.get(waiter_id)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for event in self._wakes.values():
            event.set()
