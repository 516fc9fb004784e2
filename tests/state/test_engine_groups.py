"""Grouped asks (issue 14, docs/engine-index.md): the in-process store decides a grouped ask
from its engine order exactly as it decides the same ask with every engine as a candidate.

Random sequences of admissions (grouped: common footprints, exceptions with other
footprints or cached blocks, prompts sharing a prefix, staged or not), views changing
(health, foreign load, staged slots), releases, extensions, enqueues and clock steps go to
two stores: one is given each ask expanded into candidates (`EngineBook.candidates`, the
form every store took before), the other the grouped ask. Every answer, the loads and the
totals must agree, whatever the router's scorers (those the order cannot rank as are
expanded inside the store), the headroom rule and the tenants' shares.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.routing import Router
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
from gateway.state import memory
from gateway.state.base import AdmissionAsk, Lease, QueueEntry, Refusal
from gateway.state.engines import EngineBook
from gateway.state.memory import InMemoryStore
from tests.state import lockstep

# Equal capacities (ties), a larger and a smaller one (the headroom rule's band).
SPECS = (
    EngineSpec("e1", "http://e1", frozenset({"m"}), 14, 16, 4, 4096),
    EngineSpec("e2", "http://e2", frozenset({"m"}), 14, 16, 4, 4096),
    EngineSpec("e3", "http://e3", frozenset({"m"}), 30, 16, 6, 4096),
    EngineSpec("e4", "http://e4", frozenset({"m"}), 8, 16, 2, 4096),
    EngineSpec("e5", "http://e5", frozenset({"m"}), 14, 16, 3, 4096),
)
NAMES = tuple(s.name for s in SPECS)
GROUPS = {"all": frozenset(NAMES), "some": frozenset({"e1", "e3", "e4"})}
POLICIES = (
    TenantPolicy("a", weight=1.0),
    TenantPolicy("b", weight=2.0),
    TenantPolicy("c", weight=0.5, max_queued=3),
    TenantPolicy("d", weight=1.0, priority=1),
)
PREFIXES = ((), (b"p1",), (b"p1", b"p2"), (b"p1", b"p2", b"p3"), (b"q1", b"q2"))
SCORERS = (
    ("most_free_after", "fewest_running"),
    ("most_free_blocks", "fewest_running"),
    ("most_free_after",),
    ("most_free_blocks",),
    ("fewest_running", "most_free_blocks"),  # not an order's ranking: expanded
    ("lowest_kv_fraction",),
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


admit = st.tuples(
    st.just("admit"),
    st.integers(0, 3),  # tenant
    st.sampled_from(("all", "some")),
    st.sampled_from((1, 2, 3, 4, 5, 6, 8)),  # blocks
    st.sampled_from((1, 1, 1, 2, 3)),  # seqs
    st.integers(0, len(PREFIXES) - 1),
    st.lists(  # exceptions: engine, blocks (0: the common need's), cached
        st.tuples(st.integers(0, 4), st.sampled_from((0, 2, 5, 9)), st.integers(0, 3)),
        max_size=2,
    ),
    st.booleans(),  # staged
    st.booleans(),  # queued
    st.sampled_from((None, 10, 30)),  # tenant_max_blocks
    st.sampled_from((1.0, 1.0, 1.0, 0.9)),  # kv ceiling (0.9: not the group's, expanded)
)
view = st.tuples(
    st.just("view"),
    st.integers(0, 4),
    st.booleans(),  # healthy
    st.integers(0, 10),  # foreign blocks
    st.integers(0, 2),  # foreign seqs
    st.integers(0, 2),  # staged seqs
)
untimed_op = st.one_of(  # every operation but the clock's steps (Redis keeps its own clock)
    admit,
    admit,
    admit,
    admit,
    view,
    st.tuples(st.just("enqueue"), st.integers(0, 3), st.integers(1, 12), st.integers(1, 20)),
    st.tuples(st.just("dequeue"), st.integers(0, 30)),
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("extend"), st.integers(0, 30), st.integers(1, 5)),
)
op = st.one_of(untimed_op, st.tuples(st.just("tick"), st.sampled_from((0.5, 0.5, 3.0, 11.0))))


async def _stores(
    scorers: tuple[str, ...], headroom: float, views: dict[str, EngineView]
) -> tuple[InMemoryStore, InMemoryStore, EngineBook]:
    clock = Clock()
    kwargs = dict(clock=clock, headroom=headroom, active_window_s=10.0, burst_blocks=16)
    scored = InMemoryStore(Router(scorers), random.Random(7), **kwargs)  # type: ignore[arg-type]
    grouped = InMemoryStore(Router(scorers), random.Random(7), **kwargs)  # type: ignore[arg-type]
    book = EngineBook()
    for store in (grouped, book):
        if isinstance(store, EngineBook):
            store.set_views(views.values())
        else:
            await store.set_views(list(views.values()))
        for name, engines in GROUPS.items():
            if isinstance(store, EngineBook):
                store.set_group(name, engines, 1.0)
            else:
                await store.set_group(name, engines, 1.0)
    return scored, grouped, book


@pytest.mark.parametrize("scorers", SCORERS)
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=80), headroom=st.sampled_from((0.0, 0.2, 0.5)))
async def test_a_grouped_ask_is_decided_as_its_candidates_are(
    scorers: tuple[str, ...], ops: list[tuple], headroom: float
) -> None:
    views = {s.name: EngineView(s, EngineLoad(), staged_seqs=1) for s in SPECS}
    scored, grouped, book = await _stores(scorers, headroom, views)
    await drive(scored, grouped, book, views, ops, clock=scored._clock)


def same_behind(got: object, want: object, tolerance: float = 0.0) -> None:
    """Both refusals wait behind the same entry (`expires_in_s` within `tolerance`: each
    Redis store reads its own clock), or neither waits."""
    a, b = getattr(got, "behind", None), getattr(want, "behind", None)
    if a is None or b is None:
        assert a == b
        return
    assert (a.entry_id, a.may_pass) == (b.entry_id, b.may_pass)
    assert a.expires_in_s == pytest.approx(b.expires_in_s, abs=tolerance)


async def drive(
    scored: Any,
    grouped: Any,
    book: EngineBook,
    views: dict[str, EngineView],
    ops: list[tuple[Any, ...]],
    *,
    clock: Any,
    tolerance: float = 0.0,
) -> None:
    """Apply `ops` (the `op` strategy's) to both stores: `scored` gets each ask expanded
    into candidates (`book`), `grouped` the grouped ask; every answer, the loads and the
    totals must agree."""
    leases: dict[str, Lease] = {}
    ids = 0
    for o in ops:
        if o[0] == "admit":
            _, t, group, blocks, seqs, p, exc, staged, queued, share, ceiling = o
            prefix = PREFIXES[p]
            need = Footprint(blocks + len(prefix), seqs, 64, len(prefix), prefix)
            exceptions = tuple(
                (NAMES[i], Footprint(b or need.blocks, seqs, 64, len(prefix), prefix, cached=c))
                for i, b, c in {i: (i, b, c) for i, b, c in exc}.values()
            )
            lease_id = f"r{ids % 31}" if queued else f"n{ids}"
            ids += 1
            if lease_id in leases:
                continue
            ask = AdmissionAsk(
                lease_id,
                kv_ceiling=ceiling,
                tenant=POLICIES[t],
                queued=queued,
                tenant_max_blocks=share,
                group=group,
                need=need,
                exceptions=exceptions,
                staged=staged,
            )
            want = await scored.try_admit(book.expand(ask))
            got = await grouped.try_admit(ask)
            assert got == want, ask
            same_behind(got, want, tolerance)
            if isinstance(got, Lease):
                leases[got.id] = got
        elif o[0] == "view":
            _, i, healthy, foreign, fseqs, staged_seqs = o
            views[NAMES[i]] = EngineView(
                SPECS[i], EngineLoad(), healthy, foreign, fseqs, staged_seqs
            )
            book.set_views([views[NAMES[i]]])
            await grouped.set_views([views[NAMES[i]]])
        else:
            ids = await lockstep.step(
                grouped,
                scored,
                o,
                leases=leases,
                next_id=ids,
                policies=POLICIES,
                engines=GROUPS["all"],
                clock=clock,
            )
        assert await grouped.loads() == await scored.loads()
        assert await grouped.totals() == await scored.totals()


async def test_an_unknown_group_is_a_programming_error() -> None:
    store = InMemoryStore(Router())
    ask = AdmissionAsk("x", group="nowhere", need=Footprint(1, 1, 16))
    with pytest.raises(KeyError, match="never set"):
        await store.try_admit(ask)


async def test_a_grouped_ask_goes_to_the_engine_with_most_free_blocks_without_scoring_all() -> None:
    """At 200 engines the order hands the router one engine (the one with most free
    blocks), not 200."""
    specs = [EngineSpec(f"e{i:03}", "", frozenset({"m"}), 100 + i, 16, 8, 4096) for i in range(200)]
    router = Router()
    offered: list[int] = []
    pick = router.pick

    def counting(candidates, kv_ceiling, chooser):  # type: ignore[no-untyped-def]
        offered.append(len(candidates))
        return pick(candidates, kv_ceiling, chooser)

    router.pick = counting  # type: ignore[method-assign]
    store = InMemoryStore(router, random.Random(0))
    await store.set_views([EngineView(s, EngineLoad()) for s in specs])
    await store.set_group("m", frozenset(s.name for s in specs), 1.0)
    got = await store.try_admit(AdmissionAsk("a", group="m", need=Footprint(10, 1, 160)))
    assert isinstance(got, Lease) and got.engine == "e199"
    got = await store.try_admit(AdmissionAsk("b", group="m", need=Footprint(20, 1, 320)))
    assert isinstance(got, Lease) and got.engine == "e198"  # e199 has 289 free now
    assert offered == []  # the order chose: no engine was scored by the router


@pytest.mark.parametrize("seed", range(10))
async def test_grouped_asks_where_the_headroom_rule_holds_engines_back(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines kept near full by four active tenants, one of them far above its share: the
    rule refuses engines often (counted), and the two stores still agree on every answer."""
    refused = 0
    allows = memory._Headroom.allows

    def counting(self: memory._Headroom, c: object) -> bool:
        nonlocal refused
        ok = allows(self, c)  # type: ignore[arg-type]
        refused += not ok
        return ok

    monkeypatch.setattr(memory._Headroom, "allows", counting)
    views = {s.name: EngineView(s, EngineLoad(), staged_seqs=1) for s in SPECS}
    scored, grouped, book = await _stores(SCORERS[seed % 2], 0.3, views)
    await walk(scored, grouped, book, views, random.Random(seed), 1500, clock=scored._clock)
    assert refused > 20  # the rule held engines back (counted in both stores)


async def walk(
    scored: Any,
    grouped: Any,
    book: EngineBook,
    views: dict[str, EngineView],
    rng: random.Random,
    steps: int,
    *,
    clock: Any = None,
) -> list[Lease]:
    """A seeded walk for both stores (as `drive`): mostly tenant c (far above its share),
    prefixes held, exceptions expected cached, releases keeping the engines near full,
    views changing, and with a `clock` its steps. Returns the leases still held."""
    leases: list[Lease] = []
    for i in range(steps):
        r = rng.random()
        if r < 0.6:
            t = 2 if rng.random() < 0.6 else rng.randrange(4)  # c: far above its share
            blocks = rng.choice((1, 2, 3, 4, 6))
            prefix = PREFIXES[rng.randrange(len(PREFIXES))]
            seqs = rng.choice((1, 1, 1, 2))
            need = Footprint(blocks + len(prefix), seqs, 64, len(prefix), prefix)
            exc = rng.sample(NAMES, rng.choice((0, 0, 1, 2)))
            ask = AdmissionAsk(
                f"n{i}",
                tenant=POLICIES[t],
                group=rng.choice(("all", "all", "some")),
                need=need,
                exceptions=tuple((n, replace(need, cached=rng.randrange(1, 3))) for n in exc),
                staged=rng.random() < 0.8,
            )
            want = await scored.try_admit(book.expand(ask))
            got = await grouped.try_admit(ask)
            assert got == want, (i, ask)
            if isinstance(got, Lease):
                leases.append(got)
        elif r < 0.95 and leases:
            lease = leases.pop(rng.randrange(len(leases)))
            assert await grouped.release(lease, 0) == await scored.release(lease, 0)
        elif r < 0.98:
            name = rng.choice(NAMES)
            spec = SPECS[NAMES.index(name)]
            views[name] = EngineView(spec, EngineLoad(), rng.random() > 0.1, rng.randrange(4))
            book.set_views([views[name]])
            await grouped.set_views([views[name]])
        elif clock is not None:
            clock.now += 0.2
        assert await grouped.loads() == await scored.loads()
    return leases


@pytest.mark.parametrize(
    "case",
    ["no engine with a view", "every engine an exception", "a credited need"],
)
async def test_grouped_asks_the_order_cannot_decide_are_decided_as_their_candidates(
    case: str,
) -> None:
    """Asks a scheduler does not build, sent to the store directly: a group none of whose
    engines has a view (a KV share refusal would be wrong: there are no candidates), one
    whose every engine is an exception (the headroom rule's largest footprint is not
    `need`'s), a `need` that arrives credited. Each is decided as its candidates."""
    views = {s.name: EngineView(s, EngineLoad()) for s in SPECS}
    scored, grouped, book = await _stores(SCORERS[0], 0.2, views)
    book.set_group("bare", frozenset({"x"}), 1.0)
    await grouped.set_group("bare", frozenset({"x"}), 1.0)
    for store, form in ((scored, book.expand), (grouped, lambda a: a)):
        # Another tenant holds blocks and waits in line; this one holds a few.
        held = AdmissionAsk("held", tenant=POLICIES[1], group="all", need=Footprint(4, 1, 64))
        assert isinstance(await store.try_admit(form(held)), Lease)
        entry = QueueEntry("queued", POLICIES[1], GROUPS["all"], 40, 60.0)
        assert await store.enqueue(entry, 8) == "queued"
        mine = AdmissionAsk("mine", tenant=POLICIES[0], group="all", need=Footprint(4, 1, 64))
        assert isinstance(await store.try_admit(form(mine)), Lease)
    need = Footprint(30, 1, 64)
    if case == "no engine with a view":
        ask = AdmissionAsk("a", tenant=POLICIES[0], tenant_max_blocks=0, group="bare", need=need)
    elif case == "every engine an exception":
        small = Footprint(2, 1, 64)
        ask = AdmissionAsk(
            "a",
            tenant=POLICIES[0],
            group="some",
            need=need,
            exceptions=tuple((n, small) for n in sorted(GROUPS["some"])),
        )
    else:
        credited = Footprint(6, 1, 64, 2, (b"z1", b"z2"), credit=1)
        ask = AdmissionAsk("a", tenant=POLICIES[0], group="all", need=credited)
        for store in (scored, grouped):
            await store.dequeue("queued")  # nothing ahead: the ask reaches the engines
    want = await scored.try_admit(book.expand(ask))
    got = await grouped.try_admit(ask)
    assert got == want
    if isinstance(got, Refusal):
        assert got.behind == want.behind  # type: ignore[union-attr]
