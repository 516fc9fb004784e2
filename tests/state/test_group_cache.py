"""Asks in the engine-set form (`AdmissionAsk.engines`, what the scheduler sends): each store
keeps groups of the engine sets it is asked on (`gateway/state/groups.py`), at most
`MAX_GROUPS`, dropped once no ask used them for `GROUP_IDLE_S`, and decides every such ask
exactly as the same ask with its engines as candidates, whether it keeps a group of them
or not.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.routing import Router
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint
from gateway.state.base import AdmissionAsk, Lease
from gateway.state.engines import EngineBook
from gateway.state.groups import GROUP_IDLE_S, MAX_GROUPS, GroupCache, engine_group
from gateway.state.memory import InMemoryStore
from gateway.state.redis import RedisStore
from tests.redis_server import redis_url
from tests.state.conftest import drop_keys, new_prefix, redis_store
from tests.state.test_engine_groups import GROUPS, SCORERS, SPECS, Clock, drive, op, walk


class EngineSets:
    """`store` asked as the scheduler asks it: an ask naming one of `GROUPS` goes in the
    engine-set form (that group's engines), so the store names its own groups."""

    def __init__(self, store: Any) -> None:
        self.store = store

    async def try_admit(self, ask: AdmissionAsk) -> Any:
        if ask.group is not None:
            ask = replace(ask, group=None, engines=GROUPS[ask.group])
        return await self.store.try_admit(ask)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def the_cache(store: Any) -> GroupCache:
    """The store's group cache (the fail-open wrapper's is its Redis store's)."""
    return getattr(store, "shared", store).groups


def test_the_cache_names_up_to_max_groups_sets_and_forgets_the_idle_least_recent_first() -> None:
    cache = GroupCache()
    sets = [frozenset({f"e{i}"}) for i in range(MAX_GROUPS + 1)]
    assert [cache.use(s, 0.0) for s in sets[:-1]] == [engine_group(s) for s in sets[:-1]]
    assert cache.use(sets[-1], 0.0) is None  # one set too many: candidates
    assert cache.use(sets[0], 1.0) == engine_group(sets[0])  # now the most recent
    assert cache.idle(GROUP_IDLE_S - 0.5) is None
    gone = []
    while (group := cache.idle(GROUP_IDLE_S)) is not None:
        gone.append(group)
    assert gone == [engine_group(s) for s in sets[1:-1]]  # sets[0] used at 1.0: it stays
    assert len(cache) == 1 and sets[0] in cache and sets[-1] not in cache
    assert cache.use(sets[-1], GROUP_IDLE_S) == engine_group(sets[-1])  # room again


def test_a_group_name_is_the_same_on_every_replica_and_fits_a_redis_key() -> None:
    a, b = frozenset({"http://e1", "http://e2"}), frozenset({"http://e2", "http://e1"})
    assert engine_group(a) == engine_group(b) != engine_group(frozenset({"http://e1"}))
    assert len(engine_group(a)) == 18


async def test_asks_are_grouped_up_to_max_groups_engine_sets_then_decided_as_candidates(
    store: Any,
) -> None:
    """A store keeps at most `max_groups` engine sets as groups (each costs a move per
    change of an engine's load); an ask on another set is decided as one candidate per
    engine. Both forms get leases, on the engines they name (in-process, Redis, and Redis
    behind the fail-open wrapper)."""
    the_cache(store).max_groups = 1
    specs = [EngineSpec(n, f"http://{n}", frozenset({"m"}), 101, 16, 8, 4096) for n in "ab"]
    await store.set_views([EngineView(s, EngineLoad()) for s in specs])
    need = Footprint(4, 1, 64)

    def ask(lease_id: str, engines: str, footprint: Footprint = need) -> AdmissionAsk:
        return AdmissionAsk(lease_id, engines=frozenset(engines), need=footprint)

    both = await store.try_admit(ask("both", "ab"))
    assert frozenset("ab") in the_cache(store)
    only_b = await store.try_admit(ask("only-b", "b", Footprint(8, 1, 128)))
    assert frozenset("b") not in the_cache(store) and len(the_cache(store)) == 1
    again = await store.try_admit(ask("again", "ab"))
    assert isinstance(both, Lease) and both.engine in "ab"
    assert isinstance(only_b, Lease) and only_b.engine == "b"
    # b holds 8 or 12 of its 100 blocks, a 4 or none: the grouped ask takes a either way.
    assert isinstance(again, Lease) and again.engine == "a"
    for lease in (both, only_b, again):
        assert await store.release(lease)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def clocked(request: pytest.FixtureRequest) -> Any:
    """A store of each kind and the clock it reads (Redis: the scripts' time too)."""
    clock = Clock()
    if request.param == "memory":
        yield InMemoryStore(Router(), random.Random(0), clock=clock), clock
        return
    prefix = new_prefix()
    store = redis_store(prefix, clock=clock)
    try:
        yield store, clock
    finally:
        await store.close()
        await drop_keys(prefix)


async def test_an_engine_set_no_ask_used_for_group_idle_s_is_dropped_from_the_store(
    clocked: tuple[Any, Clock],
) -> None:
    """A group kept of an engine set (a retry's, say, that excluded an engine) costs every
    change of its engines' load a move in the store: once no ask used it for
    `GROUP_IDLE_S` it is dropped, and named again when an ask wants it again."""
    store, clock = clocked
    start = clock.now
    specs = [EngineSpec(n, f"http://{n}", frozenset({"m"}), 101, 16, 8, 4096) for n in "ab"]
    await store.set_views([EngineView(s, EngineLoad()) for s in specs])
    need = Footprint(4, 1, 64)
    both = engine_group(frozenset("ab"))

    async def admit(engines: str) -> None:
        ask = AdmissionAsk(f"x-{clock.now}", engines=frozenset(engines), need=need)
        lease = await store.try_admit(ask)
        assert isinstance(lease, Lease)
        assert await store.release(lease)

    await admit("ab")
    clock.now = start + GROUP_IDLE_S / 2
    await admit("b")
    clock.now = start + GROUP_IDLE_S  # "ab" unused for GROUP_IDLE_S: dropped; "b" stays
    await admit("b")
    assert frozenset("ab") not in store.groups and frozenset("b") in store.groups
    with pytest.raises(KeyError):  # the store forgot it
        await store.try_admit(AdmissionAsk("probe", group=both, need=need))
    clock.now = start + 3 * GROUP_IDLE_S  # asked for again: named again, and "b" goes
    await admit("ab")
    assert frozenset("ab") in store.groups and frozenset("b") not in store.groups
    lease = await store.try_admit(AdmissionAsk("probe", group=both, need=need))
    assert isinstance(lease, Lease)
    assert await store.release(lease)


@pytest.mark.parametrize("scorers", SCORERS)
@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(op, max_size=80),
    headroom=st.sampled_from((0.0, 0.2, 0.5)),
    max_groups=st.sampled_from((1, MAX_GROUPS)),
    idle_s=st.sampled_from((5.0, GROUP_IDLE_S)),
)
async def test_an_engine_set_ask_is_decided_as_its_candidates_are(
    scorers: tuple[str, ...], ops: list[tuple], headroom: float, max_groups: int, idle_s: float
) -> None:
    """As `test_engine_groups`, the grouped store asked on engine sets: groups kept, one set
    too many, groups dropped when idle (the clock steps) and named again; every answer, the
    loads and the totals agree with the store given candidates."""
    views = {s.name: EngineView(s, EngineLoad(), staged_seqs=1) for s in SPECS}
    clock = Clock()
    kwargs: dict[str, Any] = dict(
        clock=clock, headroom=headroom, active_window_s=10.0, burst_blocks=16
    )
    scored = InMemoryStore(Router(scorers), random.Random(7), **kwargs)
    grouped = InMemoryStore(Router(scorers), random.Random(7), **kwargs)
    grouped.groups = GroupCache(max_groups, idle_s)
    await grouped.set_views(list(views.values()))
    book = EngineBook()
    book.set_views(views.values())
    for name, engines in GROUPS.items():
        book.set_group(name, engines, 1.0)
    await drive(scored, EngineSets(grouped), book, views, ops, clock=clock)


@pytest.mark.redis
@pytest.mark.parametrize("seed", range(3))
async def test_engine_set_asks_on_redis_are_decided_as_their_candidates_are(seed: int) -> None:
    """Seeded walks (`test_engine_groups.walk`) on the real Redis: one store asked on
    engine sets (its groups kept ordered there; with one group at most for seed 0, the
    other set's asks go as candidates), one given the candidates; every answer agrees."""
    views = {s.name: EngineView(s, EngineLoad(), staged_seqs=1) for s in SPECS}
    prefixes = [new_prefix(), new_prefix()]

    def made(prefix: str) -> RedisStore:
        return RedisStore(
            redis_url(),
            SCORERS[seed % 2],
            replica_id="a",
            key_prefix=prefix,
            seed=7,
            headroom=0.3,
            active_window_s=3600.0,
            burst_blocks=16,
            order_min_engines=1,
        )

    scored, grouped = made(prefixes[0]), made(prefixes[1])
    if seed == 0:
        grouped.groups.max_groups = 1
    book = EngineBook()
    book.set_views(views.values())
    for name, engines in GROUPS.items():
        book.set_group(name, engines, 1.0)
    try:
        await grouped.set_views(list(views.values()))
        leases = await walk(scored, EngineSets(grouped), book, views, random.Random(seed), 300)
        kept = set(grouped.engines.groups)
        assert kept <= {engine_group(engines) for engines in GROUPS.values()}
        assert len(kept) == (1 if seed == 0 else len(GROUPS))
        for lease in leases:
            assert await grouped.release(lease, 0) == await scored.release(lease, 0)
        assert await grouped.totals() == await scored.totals()
    finally:
        for s in (scored, grouped):
            await s.close()
        for p in prefixes:
            await drop_keys(p)
