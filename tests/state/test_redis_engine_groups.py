"""Grouped asks on Redis (issue 14, docs/engine-index.md): admit.lua decides a grouped ask
from the views, groups and engine order Redis keeps (engines.lua) exactly as it decides the
same ask with every engine sent as a candidate.

Two stores on the test session's real Redis, with key prefixes of their own, get the same
random operations as in `test_engine_groups` (admissions with exceptions and shared
prefixes, views changing, releases, extensions, the line): one each ask expanded into
candidates, the other the grouped ask. Every answer, the loads and the totals must agree.
Redis keeps its own clock, so there are no clock steps here.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.core.routing import DEFAULT_SCORERS
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
from gateway.state.base import AdmissionAsk, Lease, Refusal
from gateway.state.engines import EngineBook
from gateway.state.redis import RedisStore
from tests.redis_server import redis_url
from tests.state.conftest import assert_clean, drop_keys, new_prefix
from tests.state.test_engine_groups import GROUPS, SCORERS, SPECS, drive, untimed_op, walk

pytestmark = pytest.mark.redis


def _store(scorers: tuple[str, ...], headroom: float, prefix: str, seed: int = 7) -> RedisStore:
    return RedisStore(
        redis_url(),
        scorers,
        replica_id="a",
        key_prefix=prefix,
        seed=seed,
        headroom=headroom,
        active_window_s=3600.0,  # slow decay: each store reads its own Redis clock
        burst_blocks=16,
        order_min_engines=1,  # every group kept ordered on Redis, however small
    )


async def _grouped_and_scored(
    scorers: tuple[str, ...],
    headroom: float,
    views: dict[str, EngineView],
    groups: dict[str, frozenset[str]] = GROUPS,
    seed: int = 7,
) -> tuple[RedisStore, RedisStore, EngineBook, list[str]]:
    """Two stores with key prefixes of their own (`scored` is sent expanded asks, `grouped`
    the grouped ones) and the book that expands them, given these views and groups."""
    prefixes = [new_prefix(), new_prefix()]
    scored, grouped = (_store(scorers, headroom, p, seed) for p in prefixes)
    book = EngineBook()
    book.set_views(views.values())
    await grouped.set_views(list(views.values()))
    for name, engines in groups.items():
        book.set_group(name, engines, 1.0)
        await grouped.set_group(name, engines, 1.0)
    return scored, grouped, book, prefixes


async def _close(stores: tuple[RedisStore, ...], prefixes: list[str]) -> None:
    for store in stores:
        await store.close()
    for p in prefixes:
        await drop_keys(p)


@pytest.mark.parametrize("scorers", SCORERS)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(untimed_op, min_size=20, max_size=80), headroom=st.sampled_from((0.0, 0.2, 0.5))
)
async def test_a_grouped_ask_is_decided_on_redis_as_its_candidates_are(
    scorers: tuple[str, ...], ops: list[tuple[Any, ...]], headroom: float
) -> None:
    views = {s.name: EngineView(s, EngineLoad(), staged_seqs=1) for s in SPECS}
    scored, grouped, book, prefixes = await _grouped_and_scored(scorers, headroom, views)
    try:
        await drive(scored, grouped, book, views, ops, clock=None, tolerance=0.5)
    finally:
        await _close((scored, grouped), prefixes)


@pytest.mark.parametrize("seed", range(6))
async def test_grouped_asks_on_redis_where_engines_tie_and_the_headroom_rule_holds_back(
    seed: int,
) -> None:
    """Long seeded walks: engines drained to ties, four active tenants (one far above its
    share) so the headroom rule refuses engines, prefixes held (credit), views changing.
    The two stores agree on every answer."""
    rng = random.Random(seed)
    views = {s.name: EngineView(s, EngineLoad(), staged_seqs=1) for s in SPECS}
    scorers = SCORERS[seed % 4]
    headroom = 0.3 if seed < 4 else 0.0
    scored, grouped, book, prefixes = await _grouped_and_scored(scorers, headroom, views)
    client = aioredis.from_url(redis_url())
    try:
        # Tenant c used far more than its share lately (its record as common.lua keeps it;
        # the window is long, so it stays so): above its share whenever it holds blocks, so
        # the rule holds the engines back by their capacities (the walk past them).
        seconds, micros = await client.time()
        now = repr(seconds + micros / 1e6)
        record = {"w": "0.5", "s": now, "u": "60", "us": now, "n": "3600.0", "h": "0"}
        for p in prefixes:
            await client.hset(f"{{{p}}}:act", "c", json.dumps(record))
            await client.pexpire(f"{{{p}}}:act", 130_000)  # as the scripts would
        leases = await walk(scored, grouped, book, views, rng, 800)
        for lease in leases:
            assert await grouped.release(lease, 0) == await scored.release(lease, 0)
        assert await grouped.totals() == await scored.totals()
        await assert_clean(prefixes[1])  # the views, groups and order keys have TTLs too
    finally:
        await client.aclose()
        for store in (scored, grouped):
            await store.close()
        for p in prefixes:
            await drop_keys(p)


@pytest.mark.parametrize("functions", [True, False])
async def test_a_group_redis_lost_is_given_again(functions: bool) -> None:
    """The group's keys expired (here: deleted): the ask is answered after the replica gives
    its views and groups again (by FCALL of the function library and by EVALSHA, as on a
    Redis before 7.0)."""
    prefix = new_prefix()
    store = RedisStore(
        redis_url(),
        DEFAULT_SCORERS,
        replica_id="a",
        key_prefix=prefix,
        seed=0,
        order_min_engines=1,
        functions=functions,
    )
    try:
        spec = EngineSpec("e1", "", frozenset({"m"}), 20, 16, 4, 4096)
        await store.set_views([EngineView(spec, EngineLoad())])
        await store.set_group("m", frozenset({"e1"}), 1.0)
        await drop_keys(prefix)
        got = await store.try_admit(AdmissionAsk("a", group="m", need=Footprint(4, 1, 64)))
        assert isinstance(got, Lease) and got.engine == "e1"
        assert await store.loads() == {"e1": EngineLoad(4, 1)}
        assert await store.release(got)

        # Lost again at once (here: giving them again does nothing): as candidates.
        async def nothing() -> None:
            return None

        store._regroup = nothing  # type: ignore[method-assign]
        await drop_keys(prefix)
        again = await store.try_admit(AdmissionAsk("b", group="m", need=Footprint(4, 1, 64)))
        assert isinstance(again, Lease) and again.engine == "e1"
        assert await store.release(again)
    finally:
        await store.close()
        await drop_keys(prefix)


async def test_a_tie_around_an_exception_is_chosen_as_among_every_engine() -> None:
    """Six engines alike at rest, one of them an exception that ranks lower (a larger
    footprint there): the tie is the other five, in name order, and the seeded choice among
    them must land where the expanded ask's does, on either side of the exception."""
    specs = [EngineSpec(f"e{i}", "", frozenset({"m"}), 20, 16, 4, 4096) for i in range(6)]
    views = {s.name: EngineView(s, EngineLoad()) for s in specs}
    scored, grouped, book, prefixes = await _grouped_and_scored(
        DEFAULT_SCORERS, 0.0, views, {"m": frozenset(views)}, seed=3
    )
    try:
        chosen = set()
        for i in range(40):
            need = Footprint(2, 1, 64)
            ask = AdmissionAsk(
                f"a{i}", group="m", need=need, exceptions=(("e2", Footprint(5, 1, 64)),)
            )
            want = await scored.try_admit(book.expand(ask))
            got = await grouped.try_admit(ask)
            assert got == want
            assert isinstance(got, Lease)
            chosen.add(got.engine)
            assert await scored.release(got) and await grouped.release(got)
        assert chosen == {"e0", "e1", "e3", "e4", "e5"}
    finally:
        await _close((scored, grouped), prefixes)


@pytest.mark.parametrize("kinds", [1, 2])
@pytest.mark.parametrize("scorers", [DEFAULT_SCORERS, ("most_free_blocks",)])
async def test_ties_wider_than_one_read_of_the_order(scorers: tuple[str, ...], kinds: int) -> None:
    """70 engines of one or two kinds, many ranked as one (more than the walk reads at once,
    32): the parts and the exceptions' places in them are found by range reads, and every
    choice is the expanded ask's."""
    rng = random.Random(5)
    specs = [
        EngineSpec(f"e{i:02}", "", frozenset({"m"}), 41, 16, 4 + i % kinds, 4096) for i in range(70)
    ]
    views = {s.name: EngineView(s, EngineLoad()) for s in specs}
    names = sorted(views)
    scored, grouped, book, prefixes = await _grouped_and_scored(
        scorers, 0.0, views, {"m": frozenset(views)}, seed=11
    )
    try:
        leases: list[Lease] = []
        for i in range(300):
            if rng.random() < 0.7 or not leases:
                need = Footprint(rng.choice((1, 2, 4)), 1, 64)
                exceptions = tuple(
                    (
                        n,
                        Footprint(
                            need.blocks + rng.choice((0, 3)), 1, 64, cached=rng.choice((0, 1))
                        ),
                    )
                    for n in rng.sample(names, rng.choice((0, 1, 3)))
                )
                ask = AdmissionAsk(f"a{i}", group="m", need=need, exceptions=exceptions)
                want = await scored.try_admit(book.expand(ask))
                got = await grouped.try_admit(ask)
                assert got == want, (i, ask)
                if isinstance(got, Lease):
                    leases.append(got)
            else:
                lease = leases.pop(rng.randrange(len(leases)))
                assert await scored.release(lease) and await grouped.release(lease)
            assert await grouped.loads() == await scored.loads()
        for lease in leases:
            assert await scored.release(lease) and await grouped.release(lease)
    finally:
        await _close((scored, grouped), prefixes)


async def test_a_group_smaller_than_order_min_engines_goes_as_candidates() -> None:
    """Below `order_min_engines` nothing of the group is kept on Redis (keeping the order
    costs more than scoring a few engines): its asks are expanded in the client."""
    prefix = new_prefix()
    store = RedisStore(
        redis_url(), DEFAULT_SCORERS, replica_id="a", key_prefix=prefix, seed=0, order_min_engines=3
    )
    client = aioredis.from_url(redis_url())
    try:
        specs = [EngineSpec(f"e{i}", "", frozenset({"m"}), 20 + i, 16, 4, 4096) for i in range(3)]
        await store.set_views([EngineView(s, EngineLoad()) for s in specs])
        await store.set_group("two", frozenset({"e0", "e1"}), 1.0)
        got = await store.try_admit(AdmissionAsk("a", group="two", need=Footprint(4, 1, 64)))
        assert isinstance(got, Lease) and got.engine == "e1"
        for key in ("views", "grp", "eg", "gord"):
            assert not await client.exists(f"{{{prefix}}}:{key}"), key
        await store.set_group("three", frozenset({"e0", "e1", "e2"}), 1.0)
        assert await client.hget(f"{{{prefix}}}:grp", "three:n") == b"3"
        assert await client.hlen(f"{{{prefix}}}:views") == 3
        again = await store.try_admit(AdmissionAsk("b", group="three", need=Footprint(4, 1, 64)))
        assert isinstance(again, Lease) and again.engine == "e2"
        for lease in (got, again):
            assert await store.release(lease)
    finally:
        await client.aclose()
        await store.close()
        await drop_keys(prefix)


async def test_a_group_no_replica_asked_on_for_a_key_ttl_is_dropped_by_a_renewal() -> None:
    """Every grouped ask and `set_group` stamps its group (gused); a renewal drops a group
    unstamped for a key TTL: its places, kinds, sums, order and engine memberships go, the
    other groups stay, and a replica asking on it later gives it again (`_regroup`)."""
    prefix = new_prefix()

    def replica(name: str) -> RedisStore:
        return RedisStore(
            redis_url(),
            DEFAULT_SCORERS,
            replica_id=name,
            key_prefix=prefix,
            seed=0,
            order_min_engines=1,
        )

    one, other = replica("one"), replica("other")
    client = aioredis.from_url(redis_url())

    def key(name: str) -> str:
        return f"{{{prefix}}}:{name}"

    try:
        specs = [EngineSpec(f"e{i}", "", frozenset({"m"}), 20 + i, 16, 4, 4096) for i in range(4)]
        views = [EngineView(s, EngineLoad()) for s in specs]
        retry = frozenset({"e0", "e1", "e2"})
        for store in (one, other):
            await store.set_views(views)
            await store.set_group("live", frozenset(s.name for s in specs), 1.0)
            await store.set_group("retry", retry, 1.0)
        need = Footprint(4, 1, 64)
        held = await one.try_admit(AdmissionAsk("a", group="live", need=need))
        assert isinstance(held, Lease) and held.engine == "e3"

        sec, _ = await client.time()
        await client.zadd(key("gused"), {"retry": sec - one.key_ttl_s - 1})
        await one.renew([held])
        fields = [f.decode() for f in await client.hkeys(key("grp"))]
        assert fields and not [f for f in fields if f.startswith("retry")], fields
        assert all(f.startswith("live") for f in fields), fields
        members = [m.decode() for m in await client.zrange(key("gord"), 0, -1)]
        assert len(members) == 4 and all(m.startswith("live\0") for m in members), members
        groups = {k.decode(): v.decode() for k, v in (await client.hgetall(key("eg"))).items()}
        assert groups == {s.name: "live" for s in specs}
        assert await client.zrange(key("gused"), 0, -1) == [b"live"]
        # A grouped ask stamps its group anew: it stays.
        await client.zadd(key("gused"), {"live": sec - one.key_ttl_s - 1})
        more = await one.try_admit(AdmissionAsk("c", group="live", need=need))
        assert isinstance(more, Lease)
        await one.renew([held, more])
        assert await client.hget(key("grp"), "live:n") == b"4"
        assert await one.release(more)

        assert await one.release(held)  # a load change moves nothing of the dropped group
        assert not [f for f in await client.hkeys(key("grp")) if f.startswith(b"retry")]
        got = await other.try_admit(AdmissionAsk("b", group="retry", need=need))
        assert isinstance(got, Lease) and got.engine == "e2"  # given again, then decided
        assert await client.hget(key("grp"), "retry:n") == b"3"
        assert await other.release(got)
    finally:
        await client.aclose()
        for store in (one, other):
            await store.close()
        await drop_keys(prefix)


async def _refused_above_share_reads(engines: int) -> int:
    """The order reads (`ZRANGEBYLEX`) of one grouped ask refused above its share, where each
    of `engines` engines has free blocks for it but not the headroom it needs besides."""
    prefix = new_prefix()
    store = _store(DEFAULT_SCORERS, 0.2, prefix)
    client = aioredis.from_url(redis_url())
    tiny, other = TenantPolicy("tiny", weight=0.001), TenantPolicy("other")

    def ask(name: str, tenant: TenantPolicy, blocks: int) -> AdmissionAsk:
        return AdmissionAsk(
            name, tenant=tenant, group="all", need=Footprint(blocks, 1, 16 * blocks)
        )

    try:
        specs = [
            EngineSpec(f"e{i:02}", "", frozenset({"m"}), 101, 16, 16, 4096) for i in range(engines)
        ]
        await store.set_views([EngineView(s, EngineLoad()) for s in specs])
        await store.set_group("all", frozenset(s.name for s in specs), 1.0)
        held = [await store.try_admit(ask("t", tiny, 4)), await store.try_admit(ask("o", other, 1))]
        assert all(isinstance(lease, Lease) for lease in held), held
        # 80 of each engine's 100 blocks taken by load the gateway does not hold: 20 free or
        # less, above the ask's 8 but below the 8 + 20 % of 100 it needs above its share.
        await store.set_views([EngineView(s, EngineLoad(), foreign_blocks=80) for s in specs])
        before = await client.info("commandstats")
        got = await store.try_admit(ask("x", tiny, 8))
        after = await client.info("commandstats")
        assert got == Refusal("no_capacity"), got
        for lease in held:
            assert await store.release(lease)
        return int(after["cmdstat_zrangebylex"]["calls"] - before["cmdstat_zrangebylex"]["calls"])
    finally:
        await client.aclose()
        await store.close()
        await drop_keys(prefix)


async def test_the_walk_stops_at_the_headroom_floor_whatever_the_engines() -> None:
    """An ask above its share needs `headroom` of an engine's capacity left free besides its
    blocks, so the walk down the group's order stops at the first engine with less free
    than that (admit.lua's floor) instead of reading on: with 64 engines none of which can
    take it, the refusal reads the order no more than with 16 (one read of 32 members)."""
    assert await _refused_above_share_reads(64) == await _refused_above_share_reads(16)
