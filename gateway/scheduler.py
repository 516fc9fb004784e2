"""Admission with a waiting line: admit now, wait for capacity, or refuse with 429.

The decisions are the pure core's (`core.queue`, `core.routing` via the state store,
`core.retry`); this module holds the asyncio side: one future per waiter, a dispatch pass
whenever capacity may have been released, deadlines, and cancellation when a client leaves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.core.queue import DispatchPass, Waiter, WaitQueue
from gateway.core.retry import ReleaseRate, RetryAdvice, advise_retry
from gateway.core.routing import Candidate
from gateway.core.types import EngineLoad, Footprint
from gateway.engines.pool import EnginePool
from gateway.errors import RateLimited
from gateway.state.base import AdmissionAsk, Lease, StateStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ask:
    """One request's claim: its footprint on each engine it may use."""

    id: str
    needs: Mapping[str, Footprint]
    tenant: str = "default"

    @property
    def engines(self) -> frozenset[str]:
        return frozenset(self.needs)

    @property
    def blocks(self) -> int:
        """For estimates: the smallest footprint among its engines."""
        return min(f.blocks for f in self.needs.values())


class Scheduler:
    def __init__(
        self,
        *,
        store: StateStore,
        pool: EnginePool,
        queue: WaitQueue,
        kv_ceiling: float,
        max_wait_s: float,
        retry_fallback_s: float,
        rate: ReleaseRate,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.pool = pool
        self.queue = queue
        self.kv_ceiling = kv_ceiling
        self.max_wait_s = max_wait_s
        self.retry_fallback_s = retry_fallback_s
        self.rate = rate
        self.clock = clock
        self._asks: dict[str, Ask] = {}
        self._futures: dict[str, asyncio.Future[Lease]] = {}
        self._pump_lock = asyncio.Lock()
        self._background: set[asyncio.Future[None]] = set()

    # -- admission ---------------------------------------------------------------------------

    async def admit(self, ask: Ask) -> Lease:
        """A lease on some engine, after waiting if needed; raises `RateLimited` (429)."""
        now = self.clock()
        if not self._anyone_ahead(ask.engines):
            lease = await self._try(ask, ask.engines)
            if lease is not None:
                return lease
        if not self.queue.has_room():
            raise RateLimited(
                f"The gateway's queue is full ({len(self.queue)} waiting); no engine has "
                f"room for this request's {ask.blocks} KV blocks now.",
                code="queue_full",
                retry=await self._advice(ask),
            )
        waiter = Waiter(
            id=ask.id,
            engines=ask.engines,
            blocks=ask.blocks,
            enqueued_at=now,
            deadline=now + self.max_wait_s,
            tenant=ask.tenant,
        )
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self.queue.push(waiter)
        self._asks[ask.id] = ask
        self._futures[ask.id] = future
        placed = False
        try:
            await self.pump()
            try:
                lease = await asyncio.wait_for(asyncio.shield(future), timeout=self.max_wait_s)
            except TimeoutError:
                if not (future.done() and not future.cancelled()):
                    raise RateLimited(
                        f"No engine had room for this request's {ask.blocks} KV blocks within "
                        f"{self.max_wait_s:g} s of waiting.",
                        code="queue_timeout",
                        retry=await self._advice(ask),
                    ) from None
                lease = future.result()  # placed just as the deadline passed
            placed = True
            return lease
        finally:
            self.queue.remove(ask.id)
            self._asks.pop(ask.id, None)
            self._futures.pop(ask.id, None)
            if not placed:
                if future.done() and not future.cancelled():
                    # Placed, but the waiter is leaving (the client went away): give it back.
                    self._spawn(self.release(future.result()))
                else:
                    future.cancel()

    async def release(self, lease: Lease) -> None:
        """Give a lease back (idempotent) and let waiters in."""
        if await self.store.release(lease):
            self.rate.record(self.clock(), lease.blocks)
        await self.pump()

    async def pump(self) -> None:
        """One dispatch pass: place waiters in order wherever they fit."""
        async with self._pump_lock:
            dispatch = DispatchPass()
            for waiter in self.queue.in_order():
                usable = dispatch.usable(waiter)
                ask = self._asks.get(waiter.id)
                if not usable or ask is None:
                    continue
                lease = await self._try(ask, usable)
                if lease is None:
                    dispatch.stuck(waiter)
                    continue
                future = self._futures.get(waiter.id)
                self.queue.remove(waiter.id)
                if future is None or future.done():
                    # The waiter left while we were placing it.
                    await self.store.release(lease)
                    continue
                future.set_result(lease)

    # -- helpers ----------------------------------------------------------------------------

    def _anyone_ahead(self, engines: frozenset[str]) -> bool:
        return any(w.engines & engines for w in self.queue.in_order())

    async def _try(self, ask: Ask, engines: frozenset[str]) -> Lease | None:
        candidates = tuple(
            Candidate(view=self.pool.view(name, EngineLoad()), need=ask.needs[name])
            for name in sorted(engines)
            if self.pool.get(name) is not None
        )
        return await self.store.try_admit(
            AdmissionAsk(
                lease_id=ask.id,
                candidates=candidates,
                kv_ceiling=self.kv_ceiling,
                tenant=ask.tenant,
            )
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run clean-up that must not be lost to the caller's cancellation."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    async def _advice(self, ask: Ask) -> RetryAdvice:
        loads = await self.store.loads()
        free = 0
        for name in ask.engines:
            if self.pool.get(name) is not None:
                free += max(
                    0,
                    self.pool.view(name, loads.get(name, EngineLoad())).free_blocks(
                        self.kv_ceiling
                    ),
                )
        ahead = self.queue.blocks_ahead(ask.engines)
        now = self.clock()
        return advise_retry(
            ahead + ask.blocks, free, self.rate.per_second(now), self.retry_fallback_s
        )


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("releasing an unused lease failed", exc_info=task.exception())
