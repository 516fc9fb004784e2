"""Shared state in Redis: several gateway replicas, one set of leases, limits and one line.

Every decision is one Lua script (`gateway/state/lua/`, one Redis function library run with
FCALL by `gateway.state.scripts`, packed by hiredis; EVALSHA on a Redis before 7.0, or with
`functions=False`), so it is atomic across replicas and takes one round trip. Scripts read
the time from Redis `TIME`, never from a replica's clock.
All keys share the hash tag `{<key_prefix>}` (one Cluster slot) and every write gives every
key a TTL; see docs/state.md for the layout.

Leases expire `lease_ttl_s` after their last renewal; the store renews the leases it holds
every `lease_ttl_s / 3` in a background task, and every script first reaps what expired,
so a replica killed without releasing gives its capacity back within `lease_ttl_s`. Its
waiters' queue entries are kept alive the same way (renewed in the same script call, never
past their `max_wait_s`), so a dead replica's entries leave the line — and stop counting
towards `max_length` — within `lease_ttl_s` too.

A change that may let a waiter in (a release, an entry leaving the line, a reaped lease) is
published on `{<key_prefix>}:changed` by the script itself, saying what changed (common.lua
`finish`); every store listens and wakes only the waiters it concerns: capacity freed wakes
its `wait_for_change` callers (the waiters not behind anyone), an entry leaving wakes the
`wait_behind` callers behind it.

Connections: three per store — the change listener's (redis-py's pub/sub), the background
renewals' lane, and the request path's lane, one pipelined connection that carries at most
`max_connections - 2` script calls in flight at once (`gateway.state.scripts.Lane`); a call
beyond that waits for its turn (back-pressure) and its `timeout_s` starts when it is
written. Waiting requests hold no call while they wait (they wait for the listener's
notices); the bound is never mistaken for a lost Redis.

Losing Redis: the calls that decide admission raise `StateUnavailable` (503, "fail closed")
— limits and capacity shared by replicas cannot be checked, and admitting blind could
over-commit every engine N-fold. `gateway.state.fallback.FailOpenLocal` wraps this store for
`on_failure: fail_open_local`. The store keeps trying Redis (after a short back-off) and
resumes without a restart; releases and dequeues made during the outage are retried when it
is back, and `adopt` takes over leases granted elsewhere meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.core import headroom as room
from gateway.core import tenants
from gateway.core.fairqueue import BURST_BLOCKS, check_burst, check_policy
from gateway.core.routing import DEFAULT_CACHED_BLOCK_WEIGHT, Router
from gateway.core.tenants import Bucket, TenantUsage
from gateway.core.types import EngineLoad, EngineView, Footprint, TenantPolicy
from gateway.state.base import (
    AdmissionAsk,
    Behind,
    Lease,
    QueueEntry,
    QueueVerdict,
    RateLimitState,
    Refusal,
    RefusalCode,
)
from gateway.state.engines import EngineBook, Group
from gateway.state.errors import StateUnavailable
from gateway.state.groups import GroupCache
from gateway.state.scripts import Lane, Library, Script
from gateway.state.totals import StoreTotals
from gateway.state.wakeups import BehindWaiters

log = logging.getLogger(__name__)


KEY_NAMES = (
    "leases",
    "lexp",
    "load",
    "ten",
    "rate",
    "q",
    "qent",
    "qexp",
    "qtf",
    "fair",
    "act",
    "pfx",
    "acts",
    "actr",
    "acta",
    "fairh",
    "actb",
    "views",
    "grp",
    "eg",
    "gord",
    "pfh",
    "gone",
    "gused",
    "touch",  # last: the scripts take the last key as the TTL clock (common.lua `touch`)
)
SCRIPTS = ("admit", "release", "renew", "extend", "enqueue", "dequeue", "inspect", "engines")
# Buckets in debt need up to two minutes to fill again; keys must outlive that idle time.
MIN_KEY_TTL_S = 130.0
# After a failed call, go straight to the failure path for this long before trying again.
RETRY_REDIS_AFTER_S = 0.5
RENEW_CHUNK = 100
"""Leases and entries per renew script call: a round of 10,000 leases is 100 calls of at
most ~0.45 ms each (measured) instead of one of ~15 ms that holds Redis's one thread, for
~1.3x the server time in all (issue 14; docs/benchmarks.md)."""
_DEPARTED_KEPT = 4096  # entries remembered as gone (`wait_behind` begun after the notice)
ORDER_MIN_ENGINES = 16
"""Engine groups this large or larger are kept ordered on Redis (grouped asks
decided from the order, docs/engine-index.md); the asks for smaller ones go as candidates.
Measured (docs/benchmarks.md, "engines kept ordered on Redis"): keeping the order costs a
few Redis commands at every change of an engine's load, which scoring every candidate
costs less than below ~16 engines (server time), more above."""
MAX_CONNECTIONS = 32
"""The default pool size per store (per gateway process)."""
PENDING_DEQUEUES_MAX = 10_000
"""Dequeues that failed while Redis was away, kept to send again (about 100 B each)."""

MIN_CONNECTIONS = 3  # the listener, the renewals, and at least one for the request path
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)


LUA_DIR: Traversable = resources.files("gateway.state") / "lua"
"""Where the scripts are read from: the package's. (tests/state/mutate_lua.py points it at a
changed copy, before any store is made.)"""


@functools.cache
def _lua(name: str) -> str:
    """A Lua file of `LUA_DIR` (read once per process)."""
    return (LUA_DIR / f"{name}.lua").read_text()


def _script_source(name: str) -> str:
    """Script `name` whole, for EVALSHA: the shared code, `begin`, then its body."""
    return _lua("common") + "\nbegin(KEYS, ARGV)\n" + _lua(name)


def library_source(name: str, lua: Callable[[str], str] = _lua) -> str:
    """Every script as the text of one function library named `name`: the shared code
    once, then each body as its function (`Library.function_name`). `lua(file)` gives a
    Lua file's text (this package's by default; benchmarks/bench_admit_replay.py gives
    another tree's)."""
    parts = [f"#!lua name={name}", lua("common")]
    for script in SCRIPTS:
        parts.append(
            f"redis.register_function('{Library.function_name(name, script)}', "
            f"function(KEYS, ARGV)\nbegin(KEYS, ARGV)\n{lua(script)}\nend)"
        )
    return "\n".join(parts) + "\n"


def _library() -> Library:
    """The scripts as one function library, named by a digest of its whole text, so
    replicas of different versions (a rolling upgrade) each call their own."""
    name = f"kvgw_{hashlib.sha1(library_source('kvgw').encode()).hexdigest()[:16]}"
    return Library(name, library_source(name))


def _opt(value: float | None) -> str:
    return "" if value is None else repr(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStore:
    def __init__(
        self,
        url: str,
        router_scorers: Sequence[str],
        *,
        replica_id: str,
        cached_block_weight: float = DEFAULT_CACHED_BLOCK_WEIGHT,
        lease_ttl_s: float = 15,
        key_prefix: str = "kvgw",
        seed: int | None = None,
        timeout_s: float = 1.0,
        burst_blocks: float = BURST_BLOCKS,
        headroom: float = room.HEADROOM,
        active_window_s: float = room.ACTIVE_WINDOW_S,
        max_connections: int = MAX_CONNECTIONS,
        functions: bool = True,
        order_min_engines: int = ORDER_MIN_ENGINES,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`clock` is for tests only: the scripts then take its time instead of Redis `TIME`
        (scripts.py `Script`), so a test can drive them and `InMemoryStore(clock=...)` on one
        clock it sets. Production leaves it None: every replica reads one clock, Redis's."""
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be > 0")
        if max_connections < MIN_CONNECTIONS:
            raise ValueError(f"max_connections must be >= {MIN_CONNECTIONS}")
        check_burst(burst_blocks)
        room.check_headroom(headroom, active_window_s)
        if any(c in key_prefix for c in "{}"):
            raise ValueError("key_prefix must not contain braces (it becomes the hash tag)")
        checked = Router(router_scorers, cached_block_weight=cached_block_weight)  # validates
        self.scorers = checked.scorer_names
        # admit.lua's ARGV 17: how the engine order ranks as the scorers do, and the scorers.
        self._routing = f"{checked.ordered_by or ''};{','.join(self.scorers)}"
        self.cached_block_weight = checked.cached_block_weight
        self.replica_id = replica_id
        self.lease_ttl_s = float(lease_ttl_s)
        self.burst_blocks = float(burst_blocks)  # the line's burst credit (fairqueue.py)
        self.headroom = float(headroom)  # capacity kept from tenants above their share
        self.active_window_s = float(active_window_s)
        self.key_ttl_s = max(MIN_KEY_TTL_S, 3 * self.lease_ttl_s)
        tag = f"{{{key_prefix}}}"
        self.keys = [f"{tag}:{name}" for name in KEY_NAMES]
        self.channel = f"{tag}:changed"
        self._rng = random.Random(seed) if seed is not None else None
        # The change listener's one connection (redis-py's pub/sub), from a pool of one
        # that waits rather than raising MaxConnectionsError, as redis-py's default pool
        # did past its size, which looked like a lost Redis.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=1,
            timeout=None,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # One immediate retry on a fresh connection (a pooled one may have died with an
            # earlier server); the scripts' calls retry likewise (scripts.py).
            retry=Retry(NoBackoff(), 1),
        )
        self._redis = aioredis.Redis.from_pool(pool)
        self.max_connections = max_connections
        # The scripts' own connections, made with the same settings: the renewals' one,
        # never queued behind admissions, and the rest for the request path.
        # Their reads and writes are timed by the lane, per call (`Lane`), not by the socket.
        lanes = aioredis.ConnectionPool.from_url(
            url, socket_timeout=None, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
        )
        calls = max_connections - 2
        self._request_lane = Lane(lanes.make_connection, calls, self._still_up, timeout_s)
        self._background_lane = Lane(lanes.make_connection, 1, self._still_up, timeout_s)
        shared = [repr(self.key_ttl_s), self.channel]  # ARGV 1 and 2 of every script; 3: time
        library = _library() if functions else None
        self._scripts = {
            name: Script(name, _script_source(name), self.keys, shared, library, clock)
            for name in SCRIPTS
        }
        # Leases this replica renews: id -> the lease's record as Redis holds it, written
        # again by the renewal if Redis lost it (see renew.lua).
        self._held: dict[str, dict[str, Any]] = {}
        self._queued: set[str] = set()  # this replica's waiters' entries, renewed like leases
        self._whole: set[str] = set()  # credited leases made whole (`_make_whole`)
        self._pending_release: dict[str, int | None] = {}  # to retry once Redis is back
        self._pending_dequeue: set[str] = set()
        # Held by a renewal round: a lease released while its renewal is on the way is written
        # again by renew.lua and released once the reply is read (`flush` waits for that).
        self._renewing = asyncio.Lock()
        self._down_until = 0.0  # monotonic; before it, skip Redis
        self._changed = asyncio.Event()
        # Set while the listener is subscribed (tests wait for it: subscribing wakes every
        # waiter once, in case a notice was missed before).
        self._subscribed = asyncio.Event()
        self._behind = BehindWaiters(_DEPARTED_KEPT)  # `wait_behind` callers: the notices
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        # Views as the scheduler gave them, and the groups of engine sets its asks came with
        # (or named by `set_group`). The groups of `order_min_engines` or more engines are
        # kept ordered on Redis (`_ordered`; their engines `_in_order`, whose views Redis
        # keeps), to give again when Redis lost them; `_unsynced`: a push failed, give them
        # all before the next grouped ask.
        self.engines = EngineBook()
        self.groups = GroupCache()  # the engine sets kept as groups (`_group_of`)
        self._group_clock = clock or time.monotonic  # their last uses
        self.order_min_engines = order_min_engines
        self._ordered: dict[str, Group] = {}
        self._in_order: set[str] = set()
        self._unsynced = False

    # ---- the port ------------------------------------------------------------------------

    async def try_admit(self, ask: AdmissionAsk) -> Lease | Refusal:
        check_policy(ask.tenant.priority, ask.tenant.weight)
        group = ask.group if ask.engines is None else await self._group_of(ask)
        if (group is not None or ask.engines is not None) and (
            group not in self._ordered or ask.need is None or ask.need.credit
        ):
            # A small group (or one never set: KeyError), past `MAX_GROUPS` sets, or a need
            # that arrives credited (credit is the store's to give): decided as the
            # candidates it stands for.
            ask, group = self.engines.expand(ask, group), None
        if group is not None:
            # Decided from the views and groups Redis holds (engines.lua): the group's
            # engines kept ordered by free blocks (admit.lua `ordered`).
            if self._unsynced:
                await self._regroup()
            args = self._admit_args(ask, group)
            reply = await self._call("admit", args)
            if _text(reply[0]) == "regroup":  # its keys expired: give them again
                await self._regroup()
                reply = await self._call("admit", args)
            if _text(reply[0]) == "regroup":  # lost again at once: as candidates this time
                ask = self.engines.expand(ask, group)
                reply = await self._call("admit", self._admit_args(ask))
        else:
            reply = await self._call("admit", self._admit_args(ask))
        kind = _text(reply[0])
        if kind == "refused":
            code: RefusalCode = _text(reply[1])  # type: ignore[assignment]
            retry = _text(reply[2])
            behind = None
            if len(reply) >= 6:  # queued_ahead: the entry it waits behind
                behind = Behind(_text(reply[3]), float(reply[4]), _text(reply[5]) == "1")
            return Refusal(code, float(retry) if retry else None, behind)
        if kind == "exists" and _text(reply[4]) != self.replica_id:
            raise KeyError(f"lease {ask.lease_id} already exists")
        # "exists" from this replica: a retried call whose first run wrote the lease.
        engine = _text(reply[1])
        credit = int(reply[8] if kind == "lease" else reply[6])
        if ask.need is not None:
            prefix = dict(ask.exceptions).get(engine, ask.need).prefix
        else:
            prefix = next((c.need.prefix for c in ask.candidates if c.view.spec.name == engine), ())
        lease = Lease(
            id=ask.lease_id,
            engine=engine,
            blocks=int(reply[2]),
            seqs=int(reply[3]),
            tenant=ask.tenant.name,
            tokens=ask.tokens,
            rates=_rates(ask.tenant, reply) if kind == "lease" else None,
            prompt_blocks=int(reply[7] if kind == "lease" else reply[5]),
            prefix=prefix,
            credit=credit,
        )
        self._held[lease.id] = self._record(lease, ask.tenant)
        self._queued.discard(lease.id)  # served: admit.lua took it off the line
        return lease

    async def set_views(self, views: Sequence[EngineView]) -> None:
        for engine in self.engines.stopped_caching(views):
            await self._make_whole(engine)
        changed = self.engines.set_views(views)
        await self._push(self._views_call(name for name in changed if name in self._in_order))

    async def _make_whole(self, engine: str) -> None:
        """The engine stopped caching prefixes: this replica's leases credited there are
        extended by their credit (the blocks they counted as another lease's are their own
        now), once. Every replica does so for its own when it sees the change."""
        for lease_id, record in list(self._held.items()):
            credit = int(record.get("c", 0))
            if record["e"] == engine and credit and lease_id not in self._whole:
                self._whole.add(lease_id)
                await self.extend(Lease(lease_id, engine, int(record["b"]), 0), credit)

    async def release(self, lease: Lease, used_tokens: int | None = None) -> bool:
        """Never raises for a lost Redis: the release is retried in the background (and the
        lease, no longer renewed, expires within `lease_ttl_s` in any case)."""
        held = self._held.pop(lease.id, None)
        self._whole.discard(lease.id)
        # A renewal round on its way may have read the lease as held: Redis must not let
        # it write the lease again (release.lua).
        racing = "1" if self._renewing.locked() else ""
        try:
            reply = await self._call("release", [lease.id, _opt(used_tokens), racing])
        except StateUnavailable:
            if held is None:
                return False
            self._pending_release[lease.id] = used_tokens
            return True
        return bool(int(reply))

    async def renew(self, leases: Sequence[Lease]) -> None:
        """Extend the given leases; never raises for a lost Redis (they may then expire)."""
        held = {lease.id: self._held[lease.id] for lease in leases if lease.id in self._held}
        if held:
            with contextlib.suppress(StateUnavailable):
                await self._renew(held)

    async def extend(self, lease: Lease, blocks: int) -> Lease:
        record = self._held.get(lease.id)
        if record is None or blocks <= 0:
            return lease
        target = int(record["b"]) + blocks  # a size, not a delta: safe to run twice
        try:
            args = [lease.id, str(record["b"]), str(target), repr(self.burst_blocks)]
            now = int(await self._call("extend", args))
        except StateUnavailable:
            return lease
        # 0: gone from Redis while its request runs; the renewal writes it again, this size.
        record["b"] = now or target
        return replace(lease, blocks=record["b"])

    async def enqueue(self, entry: QueueEntry, max_length: int) -> QueueVerdict:
        check_policy(entry.tenant.priority, entry.tenant.weight)
        ttl = max(self.key_ttl_s, entry.max_wait_s + self.lease_ttl_s)
        args = [
            entry.id,
            entry.tenant.name,
            str(entry.tenant.priority),
            repr(float(entry.tenant.weight)),
            str(entry.blocks),
            repr(float(entry.max_wait_s)),
            str(max_length),
            _opt(entry.tenant.max_queued),
            repr(ttl),
            repr(self.burst_blocks),
            repr(self.headroom),
            repr(self.active_window_s),
            self.replica_id,
            repr(self.lease_ttl_s),
            *sorted(entry.engines),
        ]
        # Renewed from now on (an answer lost on its way back still left an entry to renew).
        self._queued.add(entry.id)
        try:
            reply = await self._call("enqueue", args)
        except BaseException:
            self._queued.discard(entry.id)  # the scheduler dequeues it anyway
            raise
        verdict: QueueVerdict = _text(reply)  # type: ignore[assignment]
        if verdict != "queued":
            self._queued.discard(entry.id)
        return verdict

    async def dequeue(self, entry_id: str) -> None:
        """Never raises for a lost Redis (retried later; the entry expires in any case)."""
        self._queued.discard(entry_id)
        try:
            await self._call("dequeue", [entry_id])
        except StateUnavailable:
            # Retried once Redis is back, so that it stops blocking the line before its
            # time is up; past PENDING_DEQUEUES_MAX (a long outage under load) it is left to
            # expire there (max_wait_s + lease_ttl_s), and memory stays bounded.
            if len(self._pending_dequeue) < PENDING_DEQUEUES_MAX:
                self._pending_dequeue.add(entry_id)

    async def queue_length(self) -> int:
        return int(await self._inspect("length"))

    async def blocks_ahead(self, engines: frozenset[str]) -> int:
        return int(await self._inspect("ahead", *sorted(engines)))

    async def rate_limits(self, tenant: TenantPolicy) -> RateLimitState:
        if tenant.rpm is None and tenant.tpm is None:
            return RateLimitState()
        raw = [_text(v) for v in await self._inspect("rates", tenant.name)]
        return _rate_values(tenant, *raw)

    async def loads(self) -> dict[str, EngineLoad]:
        return _loads(await self._inspect("loads"))

    async def wait_for_change(self, within_s: float) -> None:
        self._start()
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), within_s)

    async def wait_behind(self, waiter_id: str, entry_id: str, within_s: float) -> None:
        self._start()
        await self._behind.wait(waiter_id, entry_id, within_s)

    async def close(self) -> None:
        """Stop renewing and listening and close the connections. Leases still held are not
        released here: they expire within `lease_ttl_s` (release them before closing)."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)  # a swallowed cancel ends within 1 s
        self._tasks.clear()
        self._notify_all()
        await self._request_lane.aclose()
        await self._background_lane.aclose()
        await self._redis.aclose()

    # ---- engine groups: the store's own, not part of the port ----------------------------

    async def _group_of(self, ask: AdmissionAsk) -> str | None:
        """The group this replica keeps of the ask's engine set (given to Redis the first
        time if it is kept ordered there; None past `MAX_GROUPS` sets: decided as
        candidates); the groups no ask used for `GROUP_IDLE_S` are forgotten here
        (groups.py; Redis drops them itself, `drop_group`)."""
        assert ask.engines is not None
        now = self._group_clock()
        group = self.groups.use(ask.engines, now)
        if group is not None and group not in self.engines.groups:
            await self.set_group(group, ask.engines, ask.kv_ceiling)
        while (idle := self.groups.idle(now)) is not None:
            await self.drop_group(idle)
        return group

    async def as_candidates(self, ask: AdmissionAsk) -> AdmissionAsk:
        """The ask with candidates (one with candidates as it is), its engine set's group
        used first as `try_admit` would: what the fail-open wrapper gives both its stores.
        Not part of the port."""
        group = ask.group if ask.engines is None else await self._group_of(ask)
        return self.engines.expand(ask, group)

    async def set_group(self, group: str, engines: frozenset[str], kv_ceiling: float) -> None:
        """Name a group of engines for asks in the named form (`AdmissionAsk.group`), with
        the KV ceiling its asks use; engines without a view (`set_views`) are left out. A
        group of `order_min_engines` or more is given to Redis, which keeps it ordered. Not
        part of the port: the store names its own groups for the engine-set form
        (`groups`); tests and benchmarks drive groups directly."""
        made = self.engines.set_group(group, engines, kv_ceiling)
        if len(made.names) < self.order_min_engines:
            if self._ordered.pop(group, None) is not None:  # its asks go as candidates
                self._orders_changed()
            return
        self._ordered[group] = made
        self._orders_changed()
        await self._push(self._views_call(made.names))
        await self._push(self._group_call(group, made))

    async def drop_group(self, group: str) -> None:
        """Forget a group named by `set_group` (no error if it was never set), by this
        replica only: another may still ask on it. Redis drops a group no replica asked on
        for a key TTL (renew.lua), and a replica asking on it after that gives it again
        (`_regroup`)."""
        self.engines.drop_group(group)
        if self._ordered.pop(group, None) is not None:
            self._orders_changed()

    def _orders_changed(self) -> None:
        """`_in_order` again from `_ordered` (after a group was kept, dropped or let go)."""
        self._in_order = {name for made in self._ordered.values() for name in made.names}

    async def _push(self, args: list[str] | None) -> None:
        """Give Redis views or a group (engines.lua); if it does not answer, every view and
        group is given again before the next grouped ask (`_regroup`)."""
        if args is None or self._unsynced:
            return
        try:
            await self._call("engines", args)
        except StateUnavailable:
            self._unsynced = True

    async def _regroup(self) -> None:
        """Give Redis every view and group this replica keeps ordered there (their keys
        expired, or a push failed); raises `StateUnavailable` if it does not answer."""
        self._unsynced = False
        calls = [self._views_call(self._in_order)]
        calls += [self._group_call(group, made) for group, made in self._ordered.items()]
        try:
            for args in calls:
                if args is not None:
                    await self._call("engines", args)
        except StateUnavailable:
            self._unsynced = True
            raise

    # ---- not part of the port ------------------------------------------------------------

    async def totals(self) -> StoreTotals:
        """What Redis holds, for every replica (after reaping); tests and metrics."""
        leases, queued, load, ten = await self._inspect("totals")
        loads = _loads(load)
        counters = _flat(ten)
        return StoreTotals(
            leases=int(leases),
            queued=int(queued),
            reserved_blocks=sum(v.reserved_blocks for v in loads.values()),
            reserved_seqs=sum(v.reserved_seqs for v in loads.values()),
            tenant_in_flight={k[2:]: v for k, v in counters.items() if k.startswith("n:") and v},
            tenant_blocks={k[2:]: v for k, v in counters.items() if k.startswith("k:") and v},
        )

    @property
    def degraded(self) -> bool:
        """True while Redis is considered unreachable (calls take the failure path)."""
        return time.monotonic() < self._down_until

    async def flush(self) -> None:
        """Wait for a renewal round on its way, then send the releases and dequeues not yet
        sent (made while Redis was away, or a lease the round wrote again as it was being
        released). Afterwards Redis holds exactly what this replica still holds. Raises
        `StateUnavailable` if Redis does not answer."""
        async with self._renewing:
            if self.degraded:
                await asyncio.sleep(max(0.0, self._down_until - time.monotonic()))
            await self._catch_up()

    @property
    def held(self) -> frozenset[str]:
        """Ids of the leases this replica holds in Redis and renews."""
        return frozenset(self._held)

    def stop_renewing(self) -> None:
        """Stop the background tasks without releasing anything (what a crash looks like to
        the other replicas: the leases expire within `lease_ttl_s`)."""
        for task in self._tasks:
            task.cancel()
        self._closed = True

    # ---- internals -----------------------------------------------------------------------

    def _views_call(self, names: Iterable[str]) -> list[str] | None:
        """engines.lua's arguments giving these engines' views (7 values each; those without
        a view are left out); None when there is none to give."""
        args = ["views"]
        for name in names:
            view = self.engines.views.get(name)
            if view is None:
                continue
            args += [
                name,
                str(view.spec.usable_blocks),
                str(view.spec.max_num_seqs),
                str(view.staged_seqs),
                str(view.foreign_blocks),
                str(view.foreign_seqs),
                "1" if view.healthy else "0",
            ]
        return args if len(args) > 1 else None

    @staticmethod
    def _group_call(group: str, made: Group) -> list[str]:
        return ["group", group, repr(made.kv_ceiling), *made.names]

    def _admit_args(self, ask: AdmissionAsk, group: str | None = None) -> list[str]:
        """admit.lua's arguments: an ask with candidates, or decided on `group` (by default
        the named form's)."""
        if group is None:
            group = ask.group
        policy = ask.tenant
        seed = "" if self._rng is None else str(self._rng.randrange(2**31))
        args = [
            ask.lease_id,
            self.replica_id,
            repr(self.lease_ttl_s),
            policy.name,
            str(policy.priority),
            repr(float(policy.weight)),
            _opt(policy.max_concurrency),
            _opt(policy.rpm),
            _opt(policy.tpm),
            _opt(ask.tenant_max_blocks),
            str(ask.tokens),
            "1" if ask.queued else "0",
            seed,
            self._routing,
            repr(self.burst_blocks),
            repr(self.headroom),
            repr(self.active_window_s),
            str(len(ask.candidates)) if group is None else "g",
            repr(self.cached_block_weight),
        ]
        lists: dict[tuple[bytes, ...], int] = {}  # each prefix sent once: engines share sizes

        def footprint(f: Footprint) -> list[str]:
            number = lists.setdefault(f.prefix, len(lists) + 1) if f.prefix else 0
            return [str(f.blocks), str(f.seqs), str(f.prompt_blocks), str(number), str(f.cached)]

        if group is not None:
            assert ask.need is not None
            args += [group, repr(float(ask.kv_ceiling)), "1" if ask.staged else "0"]
            args += footprint(ask.need)
            args.append(str(len(ask.exceptions)))
            for name, f in ask.exceptions:
                args += [name, *footprint(f)]
        for c in ask.candidates:
            spec = c.view.spec
            args += [
                spec.name,
                str(spec.capacity_blocks(ask.kv_ceiling)),
                str(c.view.seq_slots),
                str(c.view.foreign_blocks),
                str(c.view.foreign_seqs),
                "1" if c.view.healthy else "0",
                *footprint(c.need),
            ]
        args.append(str(len(lists)))
        for prefix in lists:  # in numbering order (dicts keep insertion order)
            args += [str(len(prefix)), *(h.hex() for h in prefix)]
        return args

    async def _inspect(self, what: str, *args: str) -> Any:
        return await self._call("inspect", [what, *args])

    async def _call(self, script: str, args: list[str], *, background: bool = False) -> Any:
        """Run one script; a lost Redis becomes `StateUnavailable` (and a short back-off).

        The call first waits for its lane's turn (`background`: the renewals' own
        connection); the wait is back-pressure, not a failure. Once it has its turn a call
        made while Redis is known to be away fails at once instead of timing out."""
        self._start()
        self._still_up()
        lane = self._background_lane if background else self._request_lane
        try:
            return await self._scripts[script](lane, args)
        except REDIS_ERRORS as e:
            self._down_until = time.monotonic() + RETRY_REDIS_AFTER_S
            log.warning("redis unreachable (%s: %s)", type(e).__name__, e)
            raise StateUnavailable(
                f"Shared state (Redis) is unreachable: {e}", retry_after_s=RETRY_REDIS_AFTER_S
            ) from e

    def _still_up(self) -> None:
        """A call whose turn came while Redis was found away fails at once (not after its
        own timeout, behind every other queued call's)."""
        left = self._down_until - time.monotonic()
        if left > 0:
            raise StateUnavailable(
                "Shared state (Redis) is unreachable; retrying shortly.", retry_after_s=left
            )

    def _record(self, lease: Lease, tenant: TenantPolicy) -> dict[str, Any]:
        """The lease as Redis holds it (admit.lua's json; a limit the tenant does not have
        is absent, not null), for the renewal to write again if Redis lost it."""
        record = {
            "e": lease.engine,
            "b": lease.blocks,
            "s": lease.seqs,
            "pb": lease.prompt_blocks,
            "t": lease.tenant,
            "k": lease.tokens,
            "r": self.replica_id,
            "rpm": tenant.rpm,
            "tpm": tenant.tpm,
            "p": tenant.priority,
            "w": tenant.weight,
        }
        if lease.prefix:
            record["h"] = [h.hex() for h in lease.prefix]
            record["c"] = lease.credit
        return {k: v for k, v in record.items() if v is not None}

    async def _write_leases(
        self, records: dict[str, dict[str, Any]], entries: Sequence[str] = ()
    ) -> list[str]:
        """The renew script: extends these leases and queue entries, writes again the
        leases Redis does not have; returns the ids it wrote."""
        args = [repr(self.lease_ttl_s), str(len(entries)), *entries]
        for lease_id, record in records.items():
            args += [lease_id, json.dumps(record, separators=(",", ":"))]
        return [_text(raw) for raw in await self._call("renew", args, background=True)]

    async def adopt(self, leases: Sequence[tuple[Lease, TenantPolicy]]) -> None:
        """Take over leases granted outside Redis (by a fallback store in an outage): written
        to Redis in one script, so every replica counts them, then held and renewed here.
        `tenant` is the policy they were granted under (a TPM charged elsewhere must not be
        refunded here: pass it without `tpm`). Raises `StateUnavailable` (nothing adopted)."""
        records = {lease.id: self._record(lease, tenant) for lease, tenant in leases}
        if not records:
            return
        await self._write_leases(records)
        self._held.update(records)
        for lease_id in records:
            log.info("lease %s, granted while Redis was away, is held in Redis", lease_id)

    @property
    def pending(self) -> int:
        """Releases and dequeues made while Redis was away, not yet sent."""
        return len(self._pending_release) + len(self._pending_dequeue)

    async def _renew(self, held: dict[str, dict[str, Any]], entries: Sequence[str] = ()) -> None:
        """Extend `held` (id -> record) and `entries`; Redis writes again the leases it lost.
        In calls of at most `RENEW_CHUNK` leases and entries, one after another."""
        restored: list[str] = []
        items, queued = list(held.items()), list(entries)
        while True:
            take, queued = queued[:RENEW_CHUNK], queued[RENEW_CHUNK:]
            room = RENEW_CHUNK - len(take)
            chunk, items = dict(items[:room]), items[room:]
            restored += await self._write_leases(chunk, take)
            if not items and not queued:
                break
        for lease_id in restored:
            if lease_id in self._held:
                log.warning(
                    "lease %s was gone from Redis (restarted, or expired before it was "
                    "renewed); written again: its request is still running",
                    lease_id,
                )
            else:
                # Released while this renewal was on its way: the release may have run
                # first, so the lease written again must go too (release is idempotent).
                self._pending_release.setdefault(lease_id, None)
        if self._pending_release:
            await self._catch_up()

    def _start(self) -> None:
        if self._tasks or self._closed:
            return
        self._tasks = [
            asyncio.create_task(self._renew_forever(), name="redis-store-renew"),
            asyncio.create_task(self._listen_forever(), name="redis-store-listen"),
        ]

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            try:
                async with self._renewing:
                    await self._catch_up()
                    if self._held or self._queued:
                        await self._renew(dict(self._held), sorted(self._queued))
            except StateUnavailable:
                pass  # logged by _call; tried again next round
            except Exception:  # never let the renewals die: the leases would expire
                log.exception("renewing leases failed; trying again next round")

    async def _catch_up(self) -> None:
        """Releases and dequeues that failed in an outage, now that Redis may be back."""
        for lease_id, used in list(self._pending_release.items()):
            await self._call("release", [lease_id, _opt(used)], background=True)
            self._pending_release.pop(lease_id, None)
        for entry_id in list(self._pending_dequeue):
            await self._call("dequeue", [entry_id], background=True)
            self._pending_dequeue.discard(entry_id)

    async def _listen_forever(self) -> None:
        # Ends on `_closed` as well as on cancellation: redis-py's get_message may swallow a
        # cancel that arrives as its own timeout fires.
        while not self._closed:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._notify_all()  # anything may have changed while we were not listening
                self._subscribed.set()
                while not self._closed:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._on_message(message.get("data"))
            except REDIS_ERRORS:
                self._subscribed.clear()
                self._notify_all()  # waiters fall back to their own polling
                await asyncio.sleep(RETRY_REDIS_AFTER_S)
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed in newer redis-py

    def _notify(self) -> None:
        """Capacity may have changed: wake the waiters not behind anyone."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _notify_all(self) -> None:
        """Anything may have changed (a notice may have been missed): wake every waiter."""
        self._notify()
        self._behind.wake_all()

    def _on_message(self, data: Any) -> None:
        """A change notice (common.lua `finish`): 'c', 'd:<id>', 'w:<id>' lines."""
        text = _text(data) if data is not None else ""
        for line in text.split("\n"):
            if line == "c":
                self._notify()
            elif line.startswith("d:"):
                self._behind.departed(line[2:])
            elif line.startswith("w:"):
                self._behind.wake(line[2:])
            else:  # a replica of an older version: '1', anything changed
                self._notify_all()
                return


def _flat(raw: Sequence[Any]) -> dict[str, int]:
    return {_text(raw[i]): int(raw[i + 1]) for i in range(0, len(raw), 2)}


def _loads(raw: Sequence[Any]) -> dict[str, EngineLoad]:
    fields = _flat(raw)
    names = {k[2:] for k in fields}
    return {
        name: EngineLoad(
            fields.get(f"b:{name}", 0), fields.get(f"s:{name}", 0), fields.get(f"p:{name}", 0)
        )
        for name in names
    }


def _rates(tenant: TenantPolicy, reply: Sequence[Any]) -> RateLimitState | None:
    """The tenant's rate limits as a granted admission left them (its reply's levels)."""
    if tenant.rpm is None and tenant.tpm is None:
        return None
    requests, tokens, now = (_text(v) for v in reply[4:7])
    return _rate_values(tenant, requests, now, tokens, now, now)


def _rate_values(
    tenant: TenantPolicy,
    requests: str,
    requests_at: str,
    tokens: str,
    tokens_at: str,
    now: str,
) -> RateLimitState:
    """`x-ratelimit-*` values from bucket levels and stamps as the scripts return them
    ('' = a full bucket), at Redis time `now`."""
    usage = TenantUsage(
        requests=Bucket(float(requests), float(requests_at)) if requests else None,
        tokens=Bucket(float(tokens), float(tokens_at)) if tokens else None,
    )
    return tenants.rate_limit_values(usage, rpm=tenant.rpm, tpm=tenant.tpm, now=float(now))
