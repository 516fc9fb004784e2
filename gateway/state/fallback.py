"""`redis.on_failure: fail_open_local`: the Redis store, with an in-process store behind it.

While Redis answers, every call goes to it. When it cannot be reached (the Redis store raises
`StateUnavailable`), decisions are taken by a private in-process store that sees only
`local_share` of every engine (blocks and sequences) and of every tenant limit — each replica
its own share, so that N replicas with `local_share ≤ 1/N` together stay within every
engine. Reads (loads, queue length, rate limits) answer from the local store likewise.

Leases granted locally are **adopted** by Redis as soon as it answers again: written there in
one script (every replica then counts them), then held and renewed by the Redis store, and
dropped from the local store. Adoption comes before any admission through Redis, under a
lock, so Redis never admits while this replica still holds blocks it does not know of. A TPM
charge taken locally stays local: the adopted lease carries no TPM, so Redis never refunds
what it never charged.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from dataclasses import replace

from gateway.core.routing import Candidate
from gateway.core.types import EngineLoad, EngineView, TenantPolicy
from gateway.state.base import (
    AdmissionAsk,
    Lease,
    QueueEntry,
    QueueVerdict,
    RateLimitState,
    Refusal,
)
from gateway.state.errors import StateUnavailable
from gateway.state.memory import InMemoryStore
from gateway.state.redis import RedisStore
from gateway.state.totals import StoreTotals


class FailOpenLocal:
    """A `StateStore`: `shared` while Redis answers, `local` on `local_share` while not."""

    def __init__(self, shared: RedisStore, local: InMemoryStore, local_share: float) -> None:
        if not 0 < local_share <= 1:
            raise ValueError("local_share must be in (0, 1]")
        self.shared = shared
        self.local = local
        self.local_share = local_share
        # Leases granted locally, until Redis adopts them: id -> (lease, its policy for Redis).
        self._outage: dict[str, tuple[Lease, TenantPolicy]] = {}
        self._adopting = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def outage(self) -> frozenset[str]:
        """Ids of the leases granted locally and not yet adopted by Redis."""
        return frozenset(self._outage)

    # ---- the port ------------------------------------------------------------------------

    async def try_admit(self, ask: AdmissionAsk) -> Lease | Refusal:
        self._start()
        await self._adopt()
        ask = await self.shared.as_candidates(ask)  # both stores see it as Redis does
        try:
            return await self.shared.try_admit(ask)
        except StateUnavailable:
            result = await self.local.try_admit(self._local_ask(ask))
            if isinstance(result, Lease):
                # Charged to the local buckets: Redis must not refund what it never charged.
                self._outage[result.id] = (result, replace(ask.tenant, tpm=None))
            return result

    async def set_views(self, views: Sequence[EngineView]) -> None:
        await self.local.set_views(views)  # its leases of an outage are made whole there too
        await self.shared.set_views(views)

    async def release(self, lease: Lease, used_tokens: int | None = None) -> bool:
        if lease.id in self._outage:
            async with self._adopting:  # adopted meanwhile? then Redis holds it now
                if self._outage.pop(lease.id, None) is not None:
                    return await self.local.release(lease, used_tokens)
        return await self.shared.release(lease, used_tokens)

    async def renew(self, leases: Sequence[Lease]) -> None:
        await self.shared.renew([lease for lease in leases if lease.id not in self._outage])

    async def extend(self, lease: Lease, blocks: int) -> Lease:
        if lease.id in self._outage:
            async with self._adopting:
                held = self._outage.get(lease.id)
                if held is not None:
                    grown = await self.local.extend(lease, blocks)
                    self._outage[lease.id] = (grown, held[1])
                    return grown
        return await self.shared.extend(lease, blocks)

    async def enqueue(self, entry: QueueEntry, max_length: int) -> QueueVerdict:
        try:
            return await self.shared.enqueue(entry, max_length)
        except StateUnavailable:
            return await self.local.enqueue(entry, max_length)

    async def dequeue(self, entry_id: str) -> None:
        await self.local.dequeue(entry_id)
        await self.shared.dequeue(entry_id)

    async def queue_length(self) -> int:
        try:
            return await self.shared.queue_length()
        except StateUnavailable:
            return await self.local.queue_length()

    async def blocks_ahead(self, engines: frozenset[str]) -> int:
        try:
            return await self.shared.blocks_ahead(engines)
        except StateUnavailable:
            return await self.local.blocks_ahead(engines)

    async def rate_limits(self, tenant: TenantPolicy) -> RateLimitState:
        try:
            return await self.shared.rate_limits(tenant)
        except StateUnavailable:
            return await self.local.rate_limits(self._local_tenant(tenant))

    async def loads(self) -> dict[str, EngineLoad]:
        try:
            return await self.shared.loads()
        except StateUnavailable:
            return await self.local.loads()

    async def wait_for_change(self, within_s: float) -> None:
        """A change on either side: Redis's notices, or a local release in an outage."""
        waits = [
            asyncio.ensure_future(self.shared.wait_for_change(within_s)),
            asyncio.ensure_future(self.local.wait_for_change(within_s)),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def wait_behind(self, waiter_id: str, entry_id: str, within_s: float) -> None:
        """Behind an entry of the line that decided: Redis's, or the local one in an
        outage (the local store returns at once for an entry it does not hold)."""
        store = self.local if self.degraded else self.shared
        await store.wait_behind(waiter_id, entry_id, within_s)

    @property
    def degraded(self) -> bool:
        return self.shared.degraded

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.shared.close()
        await self.local.close()

    # ---- not part of the port ------------------------------------------------------------

    async def totals(self) -> StoreTotals:
        """What Redis holds (tests and metrics)."""
        return await self.shared.totals()

    async def set_group(self, group: str, engines: frozenset[str], kv_ceiling: float) -> None:
        """A group for asks in the named form (`RedisStore.set_group`; tests)."""
        await self.shared.set_group(group, engines, kv_ceiling)

    async def drop_group(self, group: str) -> None:
        """Forget a group named by `set_group` (`RedisStore.drop_group`; tests)."""
        await self.shared.drop_group(group)

    # ---- internals -----------------------------------------------------------------------

    async def _adopt(self) -> None:
        """Hand the leases granted locally to Redis, if it answers; else leave them be."""
        if not self._outage or self.shared.degraded:
            return
        async with self._adopting:
            held = list(self._outage.values())
            try:
                await self.shared.adopt(held)
            except StateUnavailable:
                return
            for lease, _ in held:
                del self._outage[lease.id]
                await self.local.release(lease)

    def _start(self) -> None:
        """Adopt in the background too, so that an idle replica's local leases reach Redis
        within a renewal period of it coming back."""
        if self._task is None and not self._closed:
            self._task = asyncio.create_task(self._adopt_forever(), name="fail-open-adopt")

    async def _adopt_forever(self) -> None:
        while True:
            await asyncio.sleep(self.shared.lease_ttl_s / 3)
            await self._adopt()

    def _local_ask(self, ask: AdmissionAsk) -> AdmissionAsk:
        """The ask as the local store sees it: `local_share` of every engine and of every
        tenant limit, rounded down."""
        share = self.local_share
        candidates = tuple(
            Candidate(
                replace(
                    c.view,
                    spec=replace(
                        c.view.spec, max_num_seqs=math.floor(c.view.spec.max_num_seqs * share)
                    ),
                ),
                c.need,
            )
            for c in ask.candidates
        )
        max_blocks = ask.tenant_max_blocks
        return replace(
            ask,
            candidates=candidates,
            kv_ceiling=ask.kv_ceiling * share,
            tenant=self._local_tenant(ask.tenant),
            tenant_max_blocks=None if max_blocks is None else math.floor(max_blocks * share),
        )

    def _local_tenant(self, policy: TenantPolicy) -> TenantPolicy:
        def scaled(limit: int | None) -> int | None:
            return None if limit is None else math.floor(limit * self.local_share)

        return replace(
            policy,
            max_concurrency=scaled(policy.max_concurrency),
            rpm=scaled(policy.rpm),
            tpm=scaled(policy.tpm),
        )
