"""In-process state: the embedded default when no Redis is configured.

Atomic because nothing between reading and writing state awaits: one event loop, one step.
The rules are the pure core's: tenant limits from `gateway.core.tenants`, the order of the
waiting line from `gateway.core.fairqueue`, the capacity kept from tenants above their fair
share from `gateway.core.headroom`. Leases live as long as the process (there is no
other replica to fail), queue entries until `max_wait_s` after they joined.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from gateway.core import headroom as room
from gateway.core import tenants
from gateway.core.fairqueue import BURST_BLOCKS, FairQueue, Waiting
from gateway.core.prefix import PrefixHolds
from gateway.core.routing import Candidate, Chooser, Router, fits
from gateway.core.tenants import TenantUsage
from gateway.core.types import EngineLoad, EngineView, Footprint, TenantPolicy
from gateway.state.active import ActiveTenants, Unused
from gateway.state.base import (
    AdmissionAsk,
    Behind,
    Lease,
    QueueEntry,
    QueueVerdict,
    RateLimitState,
    Refusal,
)
from gateway.state.engines import OrderedEngines, OrderedGroup, unstaged
from gateway.state.groups import GroupCache
from gateway.state.totals import StoreTotals
from gateway.state.wakeups import BehindWaiters

_NO_LOAD = EngineLoad()
_UNORDERED = object()  # `_choose_ordered`: this ask needs every engine scored


@dataclass(frozen=True, slots=True)
class _Held:
    lease: Lease
    policy: TenantPolicy  # as at admission: refunds are capped by its TPM


@dataclass(frozen=True, slots=True)
class _Headroom:
    """The headroom rule (gateway/core/headroom.py) as it applies to one ask."""

    store: InMemoryStore
    ask: AdmissionAsk
    held: int
    others: float
    pool: int
    now: float
    unused: Unused  # what the other active tenants lack of their shares of the pool
    need: int  # the ask's largest footprint among its candidates
    mine: float  # the ask's tenant's recent usage
    pool_free: int = 0  # free blocks of all candidates now
    excess: float = 0.0  # the other holders' burst claims beyond their unused shares
    claims: float = 0.0  # those claims whole (headroom.py burst_claim)

    def allows(self, c: Candidate) -> bool:
        capacity = c.view.spec.capacity_blocks(self.ask.kv_ceiling)
        return room.allows(
            held=self.held,
            need=c.need.blocks,
            average=self.mine,
            weight=self.ask.tenant.weight,
            others=self.others,
            pool_capacity=self.pool,
            free_after=c.view.free_blocks(self.ask.kv_ceiling) - c.need.blocks,
            engine_capacity=capacity,
            headroom=self.store.headroom,
            pool_free_after=self.pool_free - c.need.blocks,
            others_unused=self.unused.against(self.pool_free - c.need.blocks - self.excess),
            others_excess=self.excess,
            others_claims=self.claims,
        )

    def over_share(self, need: int) -> bool:
        """Whether `need` more blocks would take the ask's tenant above its share."""
        return room.over_share(
            held=self.held,
            need=need,
            average=self.mine,
            weight=self.ask.tenant.weight,
            total=self.ask.tenant.weight + self.others,
            capacity=self.pool,
        )

    def passable(self, e: Waiting) -> bool:
        """A queued entry this ask may pass: the ask stays within its share, and the entry
        would take its (other) tenant above its own."""
        if self.over_share(self.need):
            return False
        total = self.ask.tenant.weight + self.others
        seen = self.store.activity(e.tenant)
        if e.tenant == self.ask.tenant.name or seen is None:
            return False
        other = seen.weight
        return room.over_share(
            held=self.store.tenant_blocks(e.tenant),
            need=e.blocks,
            average=self.store.average(e.tenant, self.now),
            weight=other,
            total=total,
            capacity=self.pool,
        )


class InMemoryStore:
    def __init__(
        self,
        router: Router,
        chooser: Chooser | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        burst_blocks: float = BURST_BLOCKS,
        headroom: float = room.HEADROOM,
        active_window_s: float = room.ACTIVE_WINDOW_S,
    ) -> None:
        room.check_headroom(headroom, active_window_s)
        self._router = router
        self.headroom = headroom
        self._active_window_s = active_window_s
        self._activity = ActiveTenants(active_window_s)  # tenants seen lately (headroom.py)
        self._chooser: Chooser = chooser or random.Random()
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._loads: dict[str, EngineLoad] = {}
        self._tenants: dict[str, TenantUsage] = {}
        self._line = FairQueue(burst_blocks)
        self._holds = PrefixHolds()  # prefix blocks the leases hold, per engine
        self._whole: set[str] = set()  # credited leases made whole (`_make_whole`)
        self._changed = asyncio.Event()
        self._behind = BehindWaiters()  # `wait_behind` callers (this store's calls report)
        self._engines = OrderedEngines(lambda name: self._loads.get(name, _NO_LOAD))
        self.groups = GroupCache()  # the engine sets kept as groups (`_group_of`)
        # How the order ranks as the router does (routing.py `ordered_by`); None: grouped
        # asks are expanded and every engine scored.
        self._ordered_routing = router.ordered_by

    async def try_admit(self, ask: AdmissionAsk) -> Lease | Refusal:
        if ask.lease_id in self._held:
            raise KeyError(f"lease {ask.lease_id} already exists")
        now = self._expire()
        # The ask's engine set is used whatever the answer: a waiter asks on it again.
        group = ask.group if ask.engines is None else self._group_of(ask, now)
        policy = ask.tenant
        usage = self._tenants.get(policy.name, TenantUsage())
        refused = tenants.check_rates(
            usage,
            max_concurrency=policy.max_concurrency,
            rpm=policy.rpm,
            tpm=policy.tpm,
            tokens=ask.tokens,
            now=now,
        )
        if refused is not None:
            return Refusal(refused.code, refused.retry_after_s)
        if group is not None or ask.engines is not None:  # not an ask with candidates
            ordered = self._engines.ordered.get(group) if group is not None else None
            if ordered is not None and self._orderable(ask, ordered):
                chosen = self._choose_ordered(ask, ordered, usage, now)
                if isinstance(chosen, Refusal):
                    return chosen
                if isinstance(chosen, Candidate):
                    return self._grant(ask, usage, now, chosen)
            ask = self._engines.expand(ask, group)
        chosen = self._choose(ask, usage, now)
        if not isinstance(chosen, Candidate):
            return chosen
        return self._grant(ask, usage, now, chosen)

    def _group_of(self, ask: AdmissionAsk, now: float) -> str | None:
        """The group this store keeps of the ask's engine set (set up the first time; None
        past `MAX_GROUPS` sets: decided as candidates); the groups no ask used for
        `GROUP_IDLE_S` are dropped (groups.py). Only these groups cost a move at every change
        of an engine's load."""
        assert ask.engines is not None
        group = self.groups.use(ask.engines, now)
        if group is not None and group not in self._engines.ordered:
            self._engines.set_group(group, ask.engines, ask.kv_ceiling)
        while (idle := self.groups.idle(now)) is not None:
            self._engines.drop_group(idle)
        return group

    def _choose(self, ask: AdmissionAsk, usage: TenantUsage, now: float) -> Candidate | Refusal:
        """The engine for an ask with candidates: every one of them scored."""
        credited = [self._credited(c) for c in ask.candidates]
        within_share = [
            c for c in credited if tenants.share_allows(usage, c.need.blocks, ask.tenant_max_blocks)
        ]
        if ask.candidates and not within_share:
            return Refusal("tenant_kv_share")
        engines = frozenset(c.view.spec.name for c in ask.candidates)

        def pool_need() -> tuple[int, int]:
            pool = sum(c.view.spec.capacity_blocks(ask.kv_ceiling) for c in ask.candidates)
            return pool, max((c.need.blocks for c in ask.candidates), default=0)

        rule = self._headroom_rule(ask, usage.blocks, now, pool_need)
        behind = self._behind_whom(ask, engines, rule, now)
        if behind is not None:
            return behind
        views = [
            Candidate(
                view=c.view.with_load(self._loads.get(c.view.spec.name, _NO_LOAD)), need=c.need
            )
            for c in within_share
        ]
        if rule is not None:
            free = sum(max(0, c.view.free_blocks(ask.kv_ceiling)) for c in views)
            rule = self._with_claims(rule, free, now)
            views = [c for c in views if rule.allows(c)]
        chosen = self._router.pick(views, ask.kv_ceiling, self._chooser)
        return Refusal("no_capacity") if chosen is None else chosen

    def _orderable(self, ask: AdmissionAsk, group: OrderedGroup) -> bool:
        """Whether the group's order decides this grouped ask as scoring every engine
        would: the ask's ceiling is the group's, the router ranks by free blocks (then
        perhaps by running sequences), the request runs at least one sequence, and some
        engine of the group has a view."""
        need = ask.need
        return (
            self._ordered_routing is not None
            and need is not None
            and need.seqs >= 1
            and need.credit == 0  # credit is the store's to give
            and ask.kv_ceiling == group.kv_ceiling
            and bool(group.present)
        )

    def _choose_ordered(
        self, ask: AdmissionAsk, group: OrderedGroup, usage: TenantUsage, now: float
    ) -> Candidate | Refusal | object:
        """The engine for a grouped ask, from the group's order: the engines of the
        exceptions (and those where live leases hold the request's prefix) are scored one
        by one, the rest are ranked by the order, so only the engines ranked above the
        choice that fail the router's filter or the headroom rule are visited. The same
        choice as `_choose` on the expanded ask, or `_UNORDERED` where it would take more
        than this (an exception outside the tenant's KV share)."""
        assert ask.need is not None and self._ordered_routing is not None
        need, ceiling, limit = ask.need, ask.kv_ceiling, ask.tenant_max_blocks
        special = {n: f for n, f in ask.exceptions if n in group.present}
        if len(special) == len(group.present):
            return _UNORDERED  # no engine takes `need`: the headroom rule's largest differs
        worst = max([need.blocks, *(f.blocks for f in special.values())])
        for name in self._holds.holders(need.prefix):
            if name in group.present:
                special.setdefault(name, need)
        exceptions = [
            self._credited(self._candidate(name, footprint, ask.staged))
            for name, footprint in special.items()
        ]
        common = tenants.share_allows(usage, need.blocks, limit)
        if not common:
            if not any(tenants.share_allows(usage, c.need.blocks, limit) for c in exceptions):
                return Refusal("tenant_kv_share")
            return _UNORDERED
        if not all(tenants.share_allows(usage, c.need.blocks, limit) for c in exceptions):
            return _UNORDERED
        rule = self._headroom_rule(ask, usage.blocks, now, lambda: (group.capacity, worst))
        behind = self._behind_whom(ask, group.present, rule, now)
        if behind is not None:
            return behind
        floor: float = need.blocks
        over = False
        if rule is not None:
            rule = self._with_claims(rule, group.free, now)
            over = rule.over_share(need.blocks)  # as `rule.allows` decides for `need`
            if over:  # an engine passes only with headroom × its capacity free after it
                floor = need.blocks + self.headroom * group.min_capacity
            exceptions = [c for c in exceptions if rule.allows(c)]
        built: dict[str, Candidate] = {}  # the engines read by this decision

        def candidate(name: str) -> Candidate:
            c = built.get(name)
            if c is None:
                c = built[name] = self._candidate(name, need, ask.staged)
            return c

        def passes(name: str) -> bool | None:
            if name in special:
                return False  # scored as an exception
            c = candidate(name)
            if not fits(c, ceiling):
                return False
            if rule is not None and not rule.allows(c):
                # Within its share the rule does not depend on the engine: none passes.
                return False if over else None
            return True

        router = self._router
        first = group.order.first(passes, floor)
        tied: Sequence[str] = ()
        best = ranked = None
        if first is not None:
            by_running = self._ordered_routing == "running"
            passing: list[Sequence[str]] = []
            for part in group.order.tied(first, by_running=by_running):
                # The engines of a part pass alike: one decides for all of it.
                others = [name for name in part if name not in special] if special else part
                if others and passes(others[0]):
                    passing.append(others)
            tied = passing[0] if len(passing) == 1 else sorted(n for p in passing for n in p)
            best = ranked = router.score(candidate(first), ceiling)
        scored = [(router.score(c, ceiling), c) for c in exceptions if fits(c, ceiling)]
        if scored:
            top = max(score for score, _ in scored)
            best = top if best is None else max(best, top)
        if best is None:
            return Refusal("no_capacity")
        # As `Router.pick` over every engine: the best score, its ties in name order.
        tied_exceptions = [(c.view.spec.name, c) for score, c in scored if score == best]
        if not tied_exceptions:
            return candidate(self._chooser.choice(tied))
        if ranked == best:
            ties = sorted([*((name, None) for name in tied), *tied_exceptions])
            name, chosen = self._chooser.choice(ties)
            return chosen if chosen is not None else candidate(name)
        return self._chooser.choice(sorted(tied_exceptions))[1]

    def _candidate(self, name: str, need: Footprint, staged: bool) -> Candidate:
        view = self._engines.loaded(name)
        assert view is not None
        return Candidate(view if staged else unstaged(view), need)

    def _behind_whom(
        self, ask: AdmissionAsk, engines: AbstractSet[str], rule: _Headroom | None, now: float
    ) -> Refusal | None:
        """`queued_ahead` when a queued entry ahead of the ask competes for its engines and
        may not be passed; None when nothing stands ahead."""
        policy = ask.tenant
        own = self._line.get(ask.lease_id) if ask.queued else None
        key = (
            own.key if own else self._line.newcomer_key(policy.name, policy.priority, policy.weight)
        )
        passable = rule.passable if rule is not None else None
        ahead = self._line.blocker(key, engines, own_id=ask.lease_id, passable=passable)
        if ahead is None:
            return None
        may_pass = (  # another tenant's entry, that tenant holding blocks (headroom.py)
            passable is not None
            and ahead.tenant != policy.name
            and self.tenant_blocks(ahead.tenant) > 0
        )
        return Refusal(
            "queued_ahead", behind=Behind(ahead.id, max(0.0, ahead.expires_at - now), may_pass)
        )

    def _with_claims(self, rule: _Headroom, free: int, now: float) -> _Headroom:
        """The rule with the pool's free blocks and the other holders' burst claims."""
        total = rule.ask.tenant.weight + rule.others
        excess, claims = self._activity.claims(
            rule.ask.tenant.name, pool=rule.pool, total=total, limit=free, now=now
        )
        return replace(rule, pool_free=free, excess=excess, claims=claims)

    def _grant(self, ask: AdmissionAsk, usage: TenantUsage, now: float, chosen: Candidate) -> Lease:
        """Write the lease on the chosen engine and charge the tenant."""
        policy = ask.tenant
        charged = tenants.charge(
            usage,
            rpm=policy.rpm,
            tpm=policy.tpm,
            blocks=chosen.need.blocks,
            tokens=ask.tokens,
            now=now,
        )
        limited = policy.rpm is not None or policy.tpm is not None
        lease = Lease(
            id=ask.lease_id,
            engine=chosen.view.spec.name,
            blocks=chosen.need.blocks,
            seqs=chosen.need.seqs,
            tenant=policy.name,
            tokens=ask.tokens,
            rates=tenants.rate_limit_values(charged, rpm=policy.rpm, tpm=policy.tpm, now=now)
            if limited
            else None,
            prompt_blocks=chosen.need.prompt_blocks,
            prefix=chosen.need.prefix,
            credit=chosen.need.credit,
        )
        self._held[lease.id] = _Held(lease, policy)
        seen = self._activity.get(policy.name)
        if self.headroom > 0:
            seen = room.observe(
                seen,
                weight=policy.weight,
                held=usage.blocks,
                now=now,
                window=self._active_window_s,
                need=chosen.need.blocks,
            )
        shared = self._holds.hold(lease.engine, lease.prefix)
        self._add(
            lease.engine,
            lease.private_blocks + shared,
            lease.seqs,
            lease.private_prompt_blocks + shared,
        )
        self._tenants[policy.name] = charged
        if self._line.serve(ask.lease_id) is not None:
            self._behind.departed(ask.lease_id)  # the line moved: those behind may now go
        else:
            self._line.charge(policy.name, policy.priority, policy.weight, lease.blocks)
        self._changed_tenant(policy.name, seen)
        return lease

    async def set_views(self, views: Sequence[EngineView]) -> None:
        for engine in self._engines.stopped_caching(views):
            await self._make_whole(engine)
        self._engines.set_views(views)

    async def _make_whole(self, engine: str) -> None:
        """The engine stopped caching prefixes: every lease credited there is extended by
        its credit (the blocks it counted as another lease's are its own now), once."""
        for held in list(self._held.values()):
            lease = held.lease
            if lease.engine == engine and lease.credit and lease.id not in self._whole:
                self._whole.add(lease.id)
                await self.extend(lease, lease.credit)

    async def release(self, lease: Lease, used_tokens: int | None = None) -> bool:
        held = self._held.pop(lease.id, None)
        if held is None:
            return False
        self._whole.discard(lease.id)
        got = held.lease
        freed = self._holds.drop(got.engine, got.prefix)
        self._add(
            got.engine,
            -(got.private_blocks + freed),
            -got.seqs,
            -(got.private_prompt_blocks + freed),
        )
        rpm, tpm, now = held.policy.rpm, held.policy.tpm, self._clock()
        usage = self._tenants.get(got.tenant, TenantUsage())
        self._observe_held(got.tenant, usage.blocks, now)
        usage = tenants.release(
            usage, tpm=tpm, blocks=got.blocks, charged=got.tokens, used=used_tokens, now=now
        )
        # Forget tenants holding nothing with full buckets: the map stays small, and a
        # forgotten tenant is exactly a fresh one.
        usage = tenants.forget_full(usage, rpm=rpm, tpm=tpm, now=now)
        if usage == TenantUsage():
            self._tenants.pop(got.tenant, None)
        else:
            self._tenants[got.tenant] = usage
        self._changed_tenant(got.tenant)
        self._notify()
        return True

    async def renew(self, leases: Sequence[Lease]) -> None:
        return None  # in-process leases live exactly as long as the process

    async def extend(self, lease: Lease, blocks: int) -> Lease:
        held = self._held.get(lease.id)
        if held is None or blocks <= 0:
            return held.lease if held is not None else lease
        grown = replace(held.lease, blocks=held.lease.blocks + blocks)
        self._held[lease.id] = _Held(grown, held.policy)
        self._add(grown.engine, blocks, 0, 0)
        policy = held.policy
        self._line.surcharge(policy.name, policy.priority, policy.weight, blocks)
        usage = self._tenants.get(grown.tenant, TenantUsage())
        self._observe_held(grown.tenant, usage.blocks, self._clock())
        self._tenants[grown.tenant] = replace(usage, blocks=usage.blocks + blocks)
        self._changed_tenant(grown.tenant)
        return grown

    def _observe_held(self, tenant: str, held: int, now: float) -> None:
        """The headroom rule's average of what a seen tenant holds, before `held` changes."""
        seen = self._activity.get(tenant)
        if seen is not None:
            seen = room.observe(seen, weight=None, held=held, now=now, window=self._active_window_s)
            self._changed_tenant(tenant, seen)

    async def enqueue(self, entry: QueueEntry, max_length: int) -> QueueVerdict:
        now = self._expire()
        if entry.id in self._line:
            return "queued"
        if len(self._line) >= max_length:
            return "queue_full"
        cap = entry.tenant.max_queued
        queued = self._line.count(entry.tenant.name)
        if cap is not None and queued >= cap:
            return "tenant_queue_full"
        if self.headroom > 0 and not room.line_allows(
            queued=queued,
            length=len(self._line),
            max_length=max_length,
            weight=entry.tenant.weight,
            others=self._others_weight(entry.tenant.name, now),
            headroom=self.headroom,
        ):
            return "queue_full"
        self._line.push(
            entry.id,
            tenant=entry.tenant.name,
            priority=entry.tenant.priority,
            weight=entry.tenant.weight,
            engines=entry.engines,
            blocks=entry.blocks,
            expires_at=now + entry.max_wait_s,
        )
        name = entry.tenant.name
        seen = self._activity.get(name)
        if self.headroom > 0:
            seen = room.observe(
                seen,
                weight=entry.tenant.weight,
                held=self.tenant_blocks(name),
                now=now,
                window=self._active_window_s,
                need=entry.blocks,
            )
        self._changed_tenant(name, seen)
        return "queued"

    async def dequeue(self, entry_id: str) -> None:
        gone = self._line.leave(entry_id)
        if gone is not None:
            self._changed_tenant(gone.tenant)
            self._left_unserved(gone)

    async def queue_length(self) -> int:
        self._expire()
        return len(self._line)

    async def blocks_ahead(self, engines: frozenset[str]) -> int:
        self._expire()
        return self._line.blocks_ahead(engines)

    async def rate_limits(self, tenant: TenantPolicy) -> RateLimitState:
        usage = self._tenants.get(tenant.name, TenantUsage())
        values = tenants.rate_limit_values(usage, rpm=tenant.rpm, tpm=tenant.tpm, now=self._clock())
        return RateLimitState(
            limit_requests=values.limit_requests,
            remaining_requests=values.remaining_requests,
            reset_requests_s=values.reset_requests_s,
            limit_tokens=values.limit_tokens,
            remaining_tokens=values.remaining_tokens,
            reset_tokens_s=values.reset_tokens_s,
        )

    async def loads(self) -> dict[str, EngineLoad]:
        return dict(self._loads)

    async def wait_for_change(self, within_s: float) -> None:
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), within_s)

    async def wait_behind(self, waiter_id: str, entry_id: str, within_s: float) -> None:
        if entry_id in self._line:
            await self._behind.wait(waiter_id, entry_id, within_s)

    @property
    def degraded(self) -> bool:
        return False  # nothing to lose in-process

    async def close(self) -> None:
        self._notify()
        self._behind.wake_all()

    async def totals(self) -> StoreTotals:
        """Everything held right now (not part of the port: tests and metrics)."""
        self._expire()
        return StoreTotals(
            leases=len(self._held),
            queued=len(self._line),
            reserved_blocks=sum(v.reserved_blocks for v in self._loads.values()),
            reserved_seqs=sum(v.reserved_seqs for v in self._loads.values()),
            tenant_in_flight={t: u.in_flight for t, u in self._tenants.items() if u.in_flight},
            tenant_blocks={t: u.blocks for t, u in self._tenants.items() if u.blocks},
        )

    async def set_group(self, group: str, engines: frozenset[str], kv_ceiling: float) -> None:
        """Name a group of engines for asks in the named form (`AdmissionAsk.group`), with
        the KV ceiling its asks use; engines without a view (`set_views`) are left out. Not
        part of the port: the store names its own groups for the engine-set form (`groups`);
        tests and benchmarks drive groups directly. Kept until `drop_group`."""
        self._engines.set_group(group, engines, kv_ceiling)

    async def drop_group(self, group: str) -> None:
        """Forget a group named by `set_group`: its engines are no longer moved in it, and
        asks may no longer name it. No error if it was never set."""
        self._engines.drop_group(group)

    def _credited(self, c: Candidate) -> Candidate:
        """The candidate with the leading prefix blocks live leases hold on its engine taken
        off its footprint (they cost nothing more there)."""
        if not c.need.prefix:
            return c
        held = self._holds.leading(c.view.spec.name, c.need.prefix)
        return replace(c, need=c.need.credited(held))

    def _headroom_rule(
        self, ask: AdmissionAsk, held: int, now: float, pool_need: Callable[[], tuple[int, int]]
    ) -> _Headroom | None:
        """The headroom rule for this ask (`pool_need`: its engines' capacity and its largest
        footprint among them, asked for only when the rule applies); None when it cannot
        limit anything (off, or nobody else active)."""
        if self.headroom <= 0:
            return None
        others = self._others_weight(ask.tenant.name, now)
        if others <= 0:
            return None
        pool, need = pool_need()
        total = ask.tenant.weight + others
        unused = self._activity.unused(ask.tenant.name, pool=pool, total=total)
        mine = self.average(ask.tenant.name, now)
        return _Headroom(self, ask, held, others, pool, now, unused, need, mine)

    def _others_weight(self, tenant: str, now: float) -> float:
        """The other active tenants' weights (gateway/core/headroom.py); forgets the
        inactive tenants."""
        self._activity.prune(now)
        return self._activity.others_weight(tenant)

    def _changed_tenant(self, tenant: str, seen: room.Activity | None = None) -> None:
        """Keep the active tenants' aggregates: `tenant`'s blocks or entries changed, and
        `seen` is its new record (if any)."""
        held, queued = self.tenant_blocks(tenant), self._line.count(tenant)
        if seen is not None:
            self._activity.set(tenant, seen, held=held, queued=queued)
        else:
            self._activity.update(tenant, held=held, queued=queued)

    def activity(self, tenant: str) -> room.Activity | None:
        """The headroom rule's record of `tenant` (None: not active)."""
        return self._activity.get(tenant)

    def tenant_blocks(self, tenant: str) -> int:
        return self._tenants.get(tenant, TenantUsage()).blocks

    def average(self, tenant: str, now: float) -> float:
        """The tenant's recent usage (gateway/core/headroom.py)."""
        return room.average_at(
            self._activity.get(tenant),
            held=self.tenant_blocks(tenant),
            now=now,
            window=self._active_window_s,
        )

    def _expire(self) -> float:
        """Drop queue entries whose time is up (a waiter that crashed never blocks the line
        for longer than its `max_wait_s`); returns the time used."""
        now = self._clock()
        gone = self._line.expire(now)
        for tenant in {e.tenant for e in gone}:
            self._changed_tenant(tenant)
        for e in gone:
            self._left_unserved(e)
        return now

    def _notify(self) -> None:
        """Capacity may have changed: wake the waiters not behind anyone."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _left_unserved(self, gone: Waiting) -> None:
        """`gone` left without service: those behind it, and its tenant's next entry (which
        moved up by its charge, perhaps past the entry it waited behind), look again."""
        self._behind.departed(gone.id)
        moved = self._line.next_of_tenant(gone)
        if moved is not None:
            self._behind.wake(moved.id)

    def _add(self, engine: str, blocks: int, seqs: int, prompt_blocks: int) -> None:
        load = self._loads.get(engine, EngineLoad())
        new = EngineLoad(
            load.reserved_blocks + blocks,
            load.reserved_seqs + seqs,
            load.prompt_blocks + prompt_blocks,
        )
        if new == EngineLoad():
            self._loads.pop(engine, None)
        else:
            self._loads[engine] = new
        self._engines.moved(engine)
