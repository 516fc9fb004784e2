"""In-process state: the embedded default when no Redis is configured.

Atomic because nothing between reading and writing state awaits: one event loop, one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Sequence
from dataclasses import replace

from gateway.core.routing import Candidate, Chooser, Router
from gateway.core.types import EngineLoad, TenantPolicy
from gateway.state.base import (
    AdmissionAsk,
    Lease,
    QueueEntry,
    QueueVerdict,
    RateLimitState,
    Refusal,
)


class InMemoryStore:
    def __init__(self, router: Router, chooser: Chooser | None = None) -> None:
        self._router = router
        self._chooser: Chooser = chooser or random.Random()
        self._leases: dict[str, Lease] = {}
        self._loads: dict[str, EngineLoad] = {}
        self._queue: dict[str, QueueEntry] = {}  # in order of service (FIFO here)
        self._changed = asyncio.Event()

    async def try_admit(self, ask: AdmissionAsk) -> Lease | Refusal:
        if ask.lease_id in self._leases:
            raise KeyError(f"lease {ask.lease_id} already exists")
        engines = frozenset(c.view.spec.name for c in ask.candidates)
        if self._someone_ahead(ask.lease_id if ask.queued else None, engines):
            return Refusal("queued_ahead")
        views = [
            Candidate(
                view=replace(c.view, load=self._loads.get(c.view.spec.name, EngineLoad())),
                need=c.need,
            )
            for c in ask.candidates
        ]
        chosen = self._router.pick(views, ask.kv_ceiling, self._chooser)
        if chosen is None:
            return Refusal("no_capacity")
        lease = Lease(
            id=ask.lease_id,
            engine=chosen.view.spec.name,
            blocks=chosen.need.blocks,
            seqs=chosen.need.seqs,
            tenant=ask.tenant.name,
            tokens=ask.tokens,
        )
        self._leases[lease.id] = lease
        self._add(lease.engine, lease.blocks, lease.seqs)
        if self._queue.pop(ask.lease_id, None) is not None:
            self._notify()  # the line moved: those behind may now go
        return lease

    async def release(self, lease: Lease, used_tokens: int | None = None) -> bool:
        held = self._leases.pop(lease.id, None)
        if held is None:
            return False
        self._add(held.engine, -held.blocks, -held.seqs)
        self._notify()
        return True

    async def renew(self, leases: Sequence[Lease]) -> None:
        return None  # in-process leases live exactly as long as the process

    async def enqueue(self, entry: QueueEntry, max_length: int) -> QueueVerdict:
        if len(self._queue) >= max_length:
            return "queue_full"
        self._queue[entry.id] = entry
        return "queued"

    async def dequeue(self, entry_id: str) -> None:
        if self._queue.pop(entry_id, None) is not None:
            self._notify()

    async def queue_length(self) -> int:
        return len(self._queue)

    async def blocks_ahead(self, engines: frozenset[str]) -> int:
        return sum(e.blocks for e in self._queue.values() if e.engines & engines)

    async def rate_limits(self, tenant: TenantPolicy) -> RateLimitState:
        return RateLimitState()

    async def loads(self) -> dict[str, EngineLoad]:
        return dict(self._loads)

    async def wait_for_change(self, within_s: float) -> None:
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), within_s)

    async def close(self) -> None:
        self._notify()

    def _someone_ahead(self, own_id: str | None, engines: frozenset[str]) -> bool:
        for entry in self._queue.values():
            if entry.id == own_id:
                return False
            if entry.engines & engines:
                return True
        return False

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _add(self, engine: str, blocks: int, seqs: int) -> None:
        load = self._loads.get(engine, EngineLoad())
        new = EngineLoad(load.reserved_blocks + blocks, load.reserved_seqs + seqs)
        if new == EngineLoad():
            self._loads.pop(engine, None)
        else:
            self._loads[engine] = new
