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
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint
from gateway.state.base import AdmissionAsk, Lease
from gateway.state.engines import EngineBook
from gateway.state.redis import RedisStore
from tests.redis_server import redis_url
from tests.state.conftest import assert_clean, drop_keys, new_prefix
from tests.state.test_engine_groups import GROUPS, SCORERS, SPECS, drive, untimed_op, walk

pytestmark = pytest.mark.redis


def _store(scorers: tuple[str, ...], headroom: float, prefix: str) -> RedisStore:
    return RedisStore(
        redis_url(),
        scorers,
        replica_id="a",
        key_prefix=prefix,
        seed=7,
        headroom=headroom,
        active_window_s=3600.0,  # slow decay: each store reads its own Redis clock
        burst_blocks=16,
    )


async def _grouped_and_scored(
    scorers: tuple[str, ...], headroom: float, views: dict[str, EngineView]
) -> tuple[RedisStore, RedisStore, EngineBook, list[str]]:
    prefixes = [new_prefix(), new_prefix()]
    scored, grouped = (_store(scorers, headroom, p) for p in prefixes)
    book = EngineBook()
    book.set_views(views.values())
    await grouped.set_views(list(views.values()))
    for name, engines in GROUPS.items():
        book.set_group(name, engines, 1.0)
        await grouped.set_group(name, engines, 1.0)
    return scored, grouped, book, prefixes


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
        for store in (scored, grouped):
            await store.close()
        for p in prefixes:
            await drop_keys(p)


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


async def test_a_group_redis_lost_is_given_again() -> None:
    """The group's keys expired (here: deleted): the ask is answered after the replica gives
    its views and groups again."""
    prefix = new_prefix()
    store = RedisStore(redis_url(), DEFAULT_SCORERS, replica_id="a", key_prefix=prefix, seed=0)
    try:
        spec = EngineSpec("e1", "", frozenset({"m"}), 20, 16, 4, 4096)
        await store.set_views([EngineView(spec, EngineLoad())])
        await store.set_group("m", frozenset({"e1"}), 1.0)
        await drop_keys(prefix)
        got = await store.try_admit(AdmissionAsk("a", group="m", need=Footprint(4, 1, 64)))
        assert isinstance(got, Lease) and got.engine == "e1"
        assert await store.loads() == {"e1": EngineLoad(4, 1)}
        assert await store.release(got)
    finally:
        await store.close()
        await drop_keys(prefix)


async def test_a_tie_around_an_exception_is_chosen_as_among_every_engine() -> None:
    """Six engines alike at rest, one of them an exception that ranks lower (a larger
    footprint there): the tie is the other five, in name order, and the seeded choice among
    them must land where the expanded ask's does, on either side of the exception."""
    specs = [EngineSpec(f"e{i}", "", frozenset({"m"}), 20, 16, 4, 4096) for i in range(6)]
    views = {s.name: EngineView(s, EngineLoad()) for s in specs}
    prefixes = [new_prefix(), new_prefix()]
    scored, grouped = (
        RedisStore(redis_url(), DEFAULT_SCORERS, replica_id="a", key_prefix=p, seed=3)
        for p in prefixes
    )
    book = EngineBook()
    book.set_views(views.values())
    book.set_group("m", frozenset(views), 1.0)
    await grouped.set_views(list(views.values()))
    await grouped.set_group("m", frozenset(views), 1.0)
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
        for store in (scored, grouped):
            await store.close()
        for p in prefixes:
            await drop_keys(p)
