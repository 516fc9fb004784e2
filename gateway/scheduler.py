"""Admission with a waiting line: admit now, wait for capacity, or refuse with 429.

The decisions live in the state store (atomic, shared by every replica) and the pure core;
this module is the asyncio side: one loop per waiting request that retries whenever
capacity may have changed, a deadline, and clean-up when a client leaves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from gateway.core.deadline import Unattainable, Verdict, Wait, out_of_reach
from gateway.core.retry import ReleaseRate, RetryAdvice, RetryForecast, Room
from gateway.core.types import DEFAULT_TENANT, EngineLoad, Footprint, TenantPolicy
from gateway.engines.pool import EnginePool
from gateway.errors import GatewayError, NoEngine, RateLimited
from gateway.state.base import (
    AdmissionAsk,
    Lease,
    QueueEntry,
    Refusal,
    StateStore,
)

log = logging.getLogger(__name__)


# Waiters not behind anyone re-check at least this often even without a change notice
# (engine health and reported usage change without releases).
POLL_S = 0.25

PASS_POLL_S = 1.0
"""A waiter behind another tenant's entry that the headroom rule may later let it pass
(`Behind.may_pass`) looks again this often; shares change with every admission and
release, and waking it at each of them would be a decision per release per waiter."""

EXPIRY_SLACK_S = 0.05
"""A waiter behind an entry whose time is up looks again this long after its expiry (the
look itself removes it from the line, and wakes the others behind it)."""

BEHIND_POLL_S = 10.0
"""A waiter behind an entry it cannot pass waits for that entry to leave; it looks again
after this long at most anyway (a notice lost in a reconnect is followed by a wake-up of
everyone; this is the last resort)."""

STAGE_WITHIN = 0.5
"""A waiter takes a staged slot (`admission.staged_seqs`: it would wait inside the engine
for a running sequence to end) only within this fraction of `queue.max_wait_s`; after that
only a slot the engine runs at once. Under overload the line's head is old, staging stops,
and `max_wait_s` stays a bound on the wait before the engine starts a request."""

_TENANT_MESSAGES = {
    "tenant_concurrency": "Too many concurrent requests for tenant {t}.",
    "tenant_rpm": "Requests-per-minute limit reached for tenant {t}.",
    "tenant_tpm": "Tokens-per-minute limit reached for tenant {t}.",
    "tenant_kv_share": "Tenant {t} holds its whole share of the KV cache.",
}


@dataclass(frozen=True, slots=True)
class Ask:
    """One request's claim: its footprint on each engine it may use."""

    id: str
    needs: Mapping[str, Footprint]
    tenant: TenantPolicy = DEFAULT_TENANT
    tokens: int = 0
    tenant_max_blocks: int | None = None
    engines: frozenset[str] = field(init=False)
    # As the store is asked (`AdmissionAsk.engines`): the footprint on most of its engines,
    # and the engines where it differs (another block size, blocks expected cached there).
    need: Footprint = field(init=False, repr=False, compare=False)
    exceptions: tuple[tuple[str, Footprint], ...] = field(init=False, repr=False, compare=False)
    # The engines where its footprint carries prefix hashes the store may credit.
    prefixed: frozenset[str] = field(init=False, repr=False, compare=False)
    # The deadline gate (core/deadline.py), asked before each decision with the seconds
    # waited so far: the engines that meet the request's latency targets now (None: no
    # gate, every engine of `needs`). `targeted`: the request has a TTFT or TPOT target.
    gate: Callable[[float], Verdict] | None = field(default=None, repr=False, compare=False)
    targeted: bool = field(default=False, repr=False, compare=False)
    # How long before admission began the request reached the gateway: the gate's
    # `waited_s` counts from its arrival (a duration, so any clock can measure it).
    since_s: float = field(default=0.0, repr=False, compare=False)
    # Seconds until the `k + 1`-th predicted end of a request running on its engines, for
    # `k` requests with targets ahead of it (None: not that many predicted); the deadline
    # gate's forecast of its turn (core/deadline.out_of_reach).
    turn: Callable[[int], float | None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engines", frozenset(self.needs))
        prefixed = frozenset(n for n, f in self.needs.items() if f.prefix or f.cached)
        object.__setattr__(self, "prefixed", prefixed)
        common = Counter(self.needs.values()).most_common(1)
        need = common[0][0] if common else Footprint(0, 1, 0)
        exceptions = tuple(sorted((n, f) for n, f in self.needs.items() if f != need))
        object.__setattr__(self, "need", need)
        object.__setattr__(self, "exceptions", exceptions)

    def only(self, engines: Collection[str]) -> Ask:
        """This ask on `engines` alone (those of its engines the deadline gate left)."""
        if len(engines) == len(self.needs):
            return self
        return replace(self, needs={n: f for n, f in self.needs.items() if n in engines})

    def uncached(self, engines: Collection[str]) -> Ask:
        """This ask with no prefix credit nor cache hit expected on `engines`."""
        if not engines:
            return self
        needs = {n: f.uncached() if n in engines else f for n, f in self.needs.items()}
        return replace(self, needs=needs)

    @property
    def blocks(self) -> int:
        """For estimates: the smallest footprint among its engines."""
        return min(f.blocks for f in self.needs.values())

    @property
    def seqs(self) -> int:
        return min(f.seqs for f in self.needs.values())


LineOutcome = Literal["admitted", "refused", "abandoned", "failed"]
"""How a request's stay in the line ended: a lease; a `GatewayError` (429, 503); the client
gone (cancelled); any other exception."""


class LineTally(Protocol):
    """Told once of each stay in the line as it ends (`GatewayMetrics` counts them). Called
    on the request's path: must be cheap and must not raise."""

    def left_line(self, outcome: LineOutcome) -> None: ...


class Scheduler:
    def __init__(
        self,
        *,
        store: StateStore,
        pool: EnginePool,
        kv_ceiling: float,
        max_length: int,
        max_wait_s: float,
        retry_fallback_s: float,
        rate: ReleaseRate,
        clock: Callable[[], float] = time.monotonic,
        tally: LineTally | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.kv_ceiling = kv_ceiling
        self.max_length = max_length
        self.max_wait_s = max_wait_s
        self.retry_fallback_s = retry_fallback_s
        self.rate = rate
        self.forecast = RetryForecast(rate, retry_fallback_s, max_places=max_length)
        self.clock = clock
        self.tally = tally
        self.waiting: dict[str, float] = {}
        """This process's requests in the line, by ask id: when each began to wait."""
        self._targeted: dict[str, None] = {}  # those with latency targets, in line order

    async def admit(self, ask: Ask) -> Lease:
        """A lease on some engine, after waiting if needed; raises `RateLimited` (429), or
        `NoEngine` (503) when none of the request's engines is healthy."""
        self._require_healthy(ask)
        claimed = self.forecast.claim(self.clock())  # a retry advised to come back now?
        # `leftover`: something of this ask may be in the store (a queue entry, or a lease
        # written by a call the client's departure cut short); handed back unless placed.
        placed = leftover = targeted = False
        left: LineOutcome = "failed"  # if it waited: how it left the line, unless placed
        arrived = self.clock() - max(0.0, ask.since_s)
        try:
            first = await self._gated(ask, queued=False, waited_s=self.clock() - arrived)
            if isinstance(first, Lease):
                placed = True
                return first
            if isinstance(first, Refusal):
                await self._refuse_unless_waitable(ask, first)
            else:
                await self._refuse_out_of_reach(ask, first, ahead=len(self._targeted))
            entry = QueueEntry(ask.id, ask.tenant, ask.engines, ask.blocks, self.max_wait_s)
            leftover = True  # until the store says no: its answer may be lost (a timeout)
            places = self._line_places(claimed)
            verdict = await self.store.enqueue(entry, places)
            if verdict != "queued":
                leftover = False
                who = "the gateway's" if verdict == "queue_full" else f"tenant {ask.tenant.name}'s"
                kept = self.max_length - places
                why = (
                    f" ({kept} of its places kept for retries it advised earlier)"
                    if kept and verdict == "queue_full"
                    else ""
                )
                raise RateLimited(
                    f"{who} queue is full{why}; no engine has room for this request's "
                    f"{ask.blocks} KV blocks now.",
                    code="queue_full",
                    retry=await self._advice(ask, queued=False),
                )
            self.waiting[ask.id] = self.clock()
            if ask.targeted:
                targeted = True
                self._targeted[ask.id] = None
            deadline = self.clock() + self.max_wait_s
            while True:
                stage = deadline - self.clock() > self.max_wait_s * STAGE_WITHIN
                waited = self.clock() - arrived
                result = await self._gated(ask, queued=True, stage=stage, waited_s=waited)
                if isinstance(result, Lease):
                    placed = True
                    return result
                if isinstance(result, Refusal):
                    await self._refuse_unless_waitable(ask, result)
                self._require_healthy(ask)
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise RateLimited(
                        f"No engine had room for this request's {ask.blocks} KV blocks within "
                        f"{self.max_wait_s:g} s of waiting.",
                        code="queue_timeout",
                        retry=await self._advice(ask, queued=True),
                    )
                if isinstance(result, Wait):  # no engine meets its targets yet
                    if targeted:  # refused as soon as its turn cannot come in time
                        await self._refuse_out_of_reach(ask, result, ahead=self._ahead(ask.id))
                    within = min(remaining, POLL_S, result.for_s)
                    await self.store.wait_for_change(max(within, 0.0))
                else:
                    await self._pause(ask, result, remaining)
        except GatewayError:
            left = "refused"
            raise
        except asyncio.CancelledError:
            leftover = True  # a store call may have been cut short after it took effect
            left = "abandoned"
            raise
        finally:
            if targeted:
                self._targeted.pop(ask.id, None)
            if self.waiting.pop(ask.id, None) is not None and self.tally is not None:
                self.tally.left_line("admitted" if placed else left)
            if leftover and not placed:
                # Leaving without a lease (timeout, refusal, or the client went away):
                # dequeue and release by id are idempotent, so hand back whatever there is.
                await asyncio.shield(self._abandon(ask.id))

    @property
    def targeted_waiting(self) -> int:
        """How many of this process's requests in the line have latency targets."""
        return len(self._targeted)

    def _ahead(self, ask_id: str) -> int:
        """The requests with targets that joined the line before `ask_id` and wait still
        (O(line), only while a request with targets is told to wait)."""
        for place, waiting in enumerate(self._targeted):
            if waiting == ask_id:
                return place
        return len(self._targeted)

    async def _refuse_out_of_reach(self, ask: Ask, wait: Wait, *, ahead: int) -> None:
        """429 `slo_unattainable` when the line ahead of the request outlasts what is left
        of its deadline (`core.deadline.out_of_reach`)."""
        rate = self.rate.seqs_per_second(self.clock())
        turn = ask.turn(ahead) if ask.turn is not None else None
        if out_of_reach(wait, ahead=ahead, admitted_per_s=rate, turn_s=turn):
            when = (
                f"its turn is expected in {turn:.3g} s"
                if turn is not None
                else f"engines take about {rate:.3g} a second"
            )
            raise RateLimited(
                f"This request cannot get its first token within its service class's "
                f"target: {ahead} requests with targets wait ahead of it, and {when}.",
                code="slo_unattainable",
                retry=await self._advice(ask, queued=ahead > 0, promise=False),
            )

    def _line_places(self, claimed: float | None) -> int:
        """`queue.max_length` less the places held for retries this process advised ahead
        of this request (they come back to find them, not a line refilled by newcomers
        meanwhile; `claimed`: this request is the retry of the place due then)."""
        held = self.forecast.held_places(self.clock(), claimed, line=self.max_length)
        return max(0, self.max_length - held)

    async def _pause(self, ask: Ask, refusal: Refusal, remaining_s: float) -> None:
        """Until the next re-check is worth making. Behind a queued entry (`queued_ahead`
        with `Refusal.behind`): until that entry leaves, or its time is up, or (headroom)
        the next `PASS_POLL_S`; capacity freed elsewhere cannot admit this request before
        that entry goes. Otherwise until capacity may have changed (a release) or
        `POLL_S`; when load estimated as foreign may be what keeps the request out, the
        engines are scraped sooner (`EnginePool.want_fresh`), and the next re-check reads
        the new figures.

        The end of that scrape wakes nobody on purpose: a scrape can fall between one of the
        gateway's requests ending in the engine and its lease's release, when the foreign
        estimate is one sequence short, and a waiter woken at once ran in that moment (a CI
        run admitted a request beyond a direct client's share)."""
        behind = refusal.behind
        if behind is not None:
            cap = PASS_POLL_S if behind.may_pass else BEHIND_POLL_S
            within = min(remaining_s, cap, behind.expires_in_s + EXPIRY_SLACK_S)
            await self.store.wait_behind(ask.id, behind.entry_id, within)
            return
        self.pool.want_fresh(ask.engines)
        await self.store.wait_for_change(min(remaining_s, POLL_S))

    def oldest_wait_s(self) -> float | None:
        """How long the longest-waiting of this process's queued requests has waited; None
        when none waits here."""
        if not self.waiting:
            return None
        return max(0.0, self.clock() - min(self.waiting.values()))

    async def extend(self, lease: Lease, blocks: int) -> Lease:
        """Grow a running request's lease (see `StateStore.extend`)."""
        return await self.store.extend(lease, blocks)

    async def release(self, lease: Lease, used_tokens: int | None = None) -> None:
        """Give a lease back (idempotent); waiters anywhere are told by the store."""
        self.pool.ended(lease.engine)
        if await self.store.release(lease, used_tokens):
            self.rate.record(self.clock(), lease.blocks, lease.seqs)

    def _require_healthy(self, ask: Ask) -> None:
        states = [self.pool.get(name) for name in ask.engines]
        if not any(s is not None and s.healthy for s in states):
            raise NoEngine(
                "No healthy engine can serve this request now: "
                + "; ".join(
                    f"{s.spec.name}: {s.last_error or 'unhealthy'}" for s in states if s is not None
                ),
                headers={"retry-after": "1"},
            )

    async def _abandon(self, ask_id: str) -> None:
        await self.store.dequeue(ask_id)
        await self.store.release(Lease(id=ask_id, engine="", blocks=0, seqs=0))

    def _credit_where_cached(self, ask: Ask) -> Ask:
        """`ask` without prefix credit on the engines that no longer cache prefixes (a scrape
        saw one restarted with caching off while the ask waited)."""
        if not ask.prefixed:
            return ask
        return ask.uncached([n for n in ask.prefixed if not self._caches(n)])

    def _caches(self, name: str) -> bool:
        state = self.pool.get(name)
        return state is not None and state.spec.prefix_caching

    async def _gated(
        self, ask: Ask, *, queued: bool, waited_s: float, stage: bool = True
    ) -> Lease | Refusal | Wait:
        """One decision behind the deadline gate: on the engines that meet the request's
        latency targets now; `Wait` when none does yet; a 429 `slo_unattainable` when it
        cannot meet its TTFT target on any engine, even an idle one."""
        if ask.gate is None:
            return await self._try(ask, queued=queued, stage=stage)
        verdict = ask.gate(waited_s)
        if isinstance(verdict, Wait):
            return verdict
        if isinstance(verdict, Unattainable):
            best = (
                "no engine serves it"
                if verdict.best_ttft_s == float("inf")
                else (
                    f"the fastest engine would take {verdict.best_ttft_s:.3g} s with nothing ahead"
                )
            )
            raise RateLimited(
                f"This request cannot get its first token within its service class's target "
                f"({max(verdict.left_s, 0.0):.3g} s left of it): {best}.",
                code="slo_unattainable",
                retry=await self._advice(ask, queued=queued, promise=False),
            )
        return await self._try(ask.only(verdict.engines), queued=queued, stage=stage)

    async def _try(self, ask: Ask, *, queued: bool, stage: bool = True) -> Lease | Refusal:
        """One decision, on the request's engine set (`AdmissionAsk.engines`): the store is
        first given the views that changed since the last decision, then the ask with its
        common footprint and the few engines where it differs; how it keeps the engines is
        its own. Prefix credit goes only to engines that cache prefixes as the pool sees
        them now (the views given first, so the store has made the leases it credited on an
        engine that stopped caching whole before this decision: `StateStore.set_views`)."""
        changed = self.pool.changed_views()
        if changed:
            await self.store.set_views(changed)
        ask = self._credit_where_cached(ask)
        return await self.store.try_admit(
            AdmissionAsk(
                lease_id=ask.id,
                kv_ceiling=self.kv_ceiling,
                tenant=ask.tenant,
                tokens=ask.tokens,
                tenant_max_blocks=ask.tenant_max_blocks,
                queued=queued,
                engines=ask.engines,
                need=ask.need,
                exceptions=ask.exceptions,
                staged=stage,
            )
        )

    async def _refuse_unless_waitable(self, ask: Ask, refusal: Refusal) -> None:
        if refusal.waitable:
            return
        seconds = refusal.retry_after_s
        message = _TENANT_MESSAGES.get(refusal.code, "{t}: refused").format(t=ask.tenant.name)
        if refusal.code == "tenant_tpm" and seconds is None:
            # More than the whole bucket: waiting will not help, a smaller request will.
            message = (
                f"This request may use up to {ask.tokens} tokens (prompt plus max output), "
                f"more than tenant {ask.tenant.name}'s whole limit of {ask.tenant.tpm} tokens "
                f"per minute; lower max_tokens."
            )
            seconds = 60.0
        if seconds is None:  # concurrency, KV share: when enough of the engines' work ends
            retry = await self._advice(ask, queued=False, promise=False)
        else:
            retry = RetryAdvice(seconds)
        raise RateLimited(message, code=refusal.code, retry=retry)

    async def _advice(self, ask: Ask, *, queued: bool, promise: bool = True) -> RetryAdvice:
        """When to come back (core/retry.py): behind the whole line as it stands (a retry
        joins at its end) and the retries advised before, at the observed release rate."""
        loads = await self.store.loads()
        free_seqs = free_blocks = running_seqs = running_blocks = 0
        for name in ask.engines:
            if self.pool.get(name) is not None:
                load = loads.get(name, EngineLoad())
                view = self.pool.view(name, load)
                free_seqs += max(0, view.free_seqs())
                free_blocks += max(0, view.free_blocks(self.kv_ceiling))
                running_seqs += load.reserved_seqs
                running_blocks += load.reserved_blocks
        need = Room(seqs=ask.seqs, blocks=ask.blocks)
        waiting = await self.store.queue_length() - (1 if queued else 0)
        blocks = await self.store.blocks_ahead(ask.engines) - (ask.blocks if queued else 0)
        ahead = Room(seqs=max(0, waiting), blocks=max(0, blocks))
        free = Room(seqs=free_seqs, blocks=free_blocks)
        running = Room(seqs=running_seqs, blocks=running_blocks)
        return self.forecast.advise(
            self.clock(), need=need, ahead=ahead, free=free, running=running, promise=promise
        )
