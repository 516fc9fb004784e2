"""The active tenants' maintained sum of unused shares compares with any number of free
blocks exactly as the per-tenant sum of `headroom.unused_share` (the rule before issue 14).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import headroom as room
from gateway.state import redis as lua
from gateway.state.active import ActiveTenants

tenant = st.tuples(st.sampled_from((0.25, 0.5, 1.0, 1.5, 3.0, 0.1, 0.7)), st.integers(0, 60))


def reference(tenants: list[tuple[float, int]], own: int, total: float, pool: int) -> float:
    return sum(
        room.unused_share(held=h, weight=w, total=total, capacity=pool)
        for i, (w, h) in enumerate(tenants)
        if i != own
    )


@settings(max_examples=500, deadline=None)
@given(st.lists(tenant, min_size=1, max_size=12), st.integers(1, 400), st.data())
def test_unused_shares_compare_as_the_per_tenant_sum(tenants, pool, data) -> None:
    active = ActiveTenants(10.0)
    for i, (w, h) in enumerate(tenants):
        active.set(f"t{i}", room.Activity(w, 0.0), held=h, queued=0)
    own = data.draw(st.integers(0, len(tenants) - 1))
    total = tenants[own][0] + sum(w for i, (w, _) in enumerate(tenants) if i != own)
    unused = active.unused(f"t{own}", pool=pool, total=total)
    want = reference(tenants, own, total, pool)
    for free in {0, pool, int(want), int(want) + 1, int(want) - 1, round(want)}:
        assert (free >= unused.against(free)) == (free >= want)


def test_a_sum_on_a_whole_number_is_decided_term_by_term() -> None:
    """Three shares of 100 / 3 add up to a little over 100 in floats: 100 free blocks do
    not cover them, as before."""
    active = ActiveTenants(10.0)
    for name in ("me", "a", "b", "c"):
        active.set(name, room.Activity(1.0, 0.0), held=0, queued=0)
    unused = active.unused("me", pool=133, total=4.0)
    want = reference([(1.0, 0)] * 4, 0, 4.0, 133)
    assert (unused.against(99) <= 99) == (want <= 99)
    assert (unused.against(100) <= 100) == (want <= 100)
    unused = active.unused("me", pool=100, total=3.0)
    assert unused.against(100) == reference([(1.0, 0)] * 3, -1, 3.0, 100)


def test_a_decision_counts_at_most_claim_visits_burst_claims() -> None:
    """Twenty holders each claim one more request of 30 beyond their unused shares (held 60
    of a share of 75, recent usage 0): a decision counts the first `CLAIM_VISITS` of them,
    the lowest claim keys first, whatever the others (issue 14: bounded per decision)."""
    active = ActiveTenants(10.0)
    names = [f"t{i:02d}" for i in range(20)]
    for name in names:
        active.set(name, room.Activity(1.0, 0.0, 0.0, 0.0, need=30), held=60, queued=0)
    active.set("me", room.Activity(1.0, 0.0), held=0, queued=0)
    pool, total = 75 * 21, 21.0
    claim, excess = room.burst_claim(
        held=60, average=0.0, need=30, weight=1.0, total=total, capacity=pool
    )
    assert (claim, excess) == (30.0, 15.0)
    got = active.claims("me", pool=pool, total=total, limit=10**9, now=0.0)
    assert got == (room.CLAIM_VISITS * excess, room.CLAIM_VISITS * claim)
    assert len(names) > room.CLAIM_VISITS


def test_the_lua_scripts_visit_as_many_claims_as_the_core() -> None:
    source = (Path(lua.__file__).parent / "lua" / "common.lua").read_text()
    assert f"local CLAIM_VISITS = {room.CLAIM_VISITS}\n" in source


def scanned_claims(
    records: dict[str, tuple[room.Activity, int]],
    name: str,
    pool: int,
    total: float,
    limit: float,
    now: float,
    window: float,
) -> tuple[float, float]:
    """The other holders' burst claims, every tenant visited: in the order of their claim
    keys (then names), the first `CLAIM_VISITS` whose key may hold at this share, stopping
    once the excess is above `limit`."""
    keyed = sorted(
        ((min(r.average, h) + r.need) / r.weight, other)
        for other, (r, h) in records.items()
        if other != name and h > 0 and r.need > 0
    )
    excess = claims = 0.0
    for key, other in keyed[: room.CLAIM_VISITS]:
        if key > pool / total * (1 + 1e-9):
            break
        record, held = records[other]
        average = room.average_at(record, held=held, now=now, window=window)
        claim, more = room.burst_claim(
            held=held,
            average=average,
            need=record.need,
            weight=record.weight,
            total=total,
            capacity=pool,
        )
        excess, claims = excess + more, claims + claim
        if excess > limit:
            break
    return excess, claims


held_st = st.sampled_from((0, 0, 3, 8, 20, 45, 60))
queued_st = st.sampled_from((0, 0, 1, 2))
step = st.one_of(
    st.tuples(  # seen (admitted or queued): a new record
        st.just("seen"),
        st.integers(0, 7),
        st.sampled_from((0.25, 0.5, 1.0, 1.5, 3.0, 0.1, 0.7)),
        held_st,  # held after
        queued_st,  # queued after
        st.integers(0, 30),  # its request's blocks
    ),
    st.tuples(st.just("changed"), st.integers(0, 7), held_st, queued_st),
    st.tuples(st.just("queued"), st.integers(0, 7), queued_st),  # its entries alone
    st.tuples(st.just("tick"), st.sampled_from((0.5, 4.0, 11.0))),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=40), st.integers(1, 400), st.data())
def test_the_aggregates_answer_as_visiting_every_tenant(steps, pool, data) -> None:
    """What `ActiveTenants` keeps as tenants are seen, change and age out answers as visiting
    every tenant would (the in-process store before issue 14): the tenants forgotten at each
    `prune` are exactly the inactive ones, the others' weights are the correctly rounded sum
    of theirs, the unused shares compare as the per-tenant sum, the burst claims are summed
    as `scanned_claims`. (Until issue 39 a copy of that store was the reference.)"""
    window, now = 10.0, 100.0
    active = ActiveTenants(window)
    records: dict[str, tuple[room.Activity, int]] = {}  # name -> record, held
    held: dict[str, int] = {}
    queued: dict[str, int] = {}
    for s in steps:
        if s[0] == "tick":
            now += s[1]
        elif s[0] == "queued":
            queued[f"t{s[1]}"] = s[2]
            active.update(f"t{s[1]}", held=held.get(f"t{s[1]}", 0), queued=s[2])
        else:
            name = f"t{s[1]}"
            old = records.get(name)
            before = held.get(name, 0)
            if s[0] == "seen":
                _, _, weight, held[name], queued[name], need = s
                seen = old[0] if old else None
                record = room.observe(
                    seen, weight=weight, held=before, now=now, window=window, need=need
                )
            else:
                _, _, held[name], queued[name] = s
                if old is None:  # not remembered: only its counts change
                    active.update(name, held=held[name], queued=queued[name])
                    continue
                record = room.observe(old[0], weight=None, held=before, now=now, window=window)
            records[name] = (record, held[name])
            active.set(name, record, held=held[name], queued=queued[name])
        active.prune(now)
        for name, (record, h) in list(records.items()):
            if not room.is_active(record, held=h, queued=queued[name], now=now, window=window):
                del records[name]
        assert {f"t{i}" for i in range(8) if active.get(f"t{i}")} == set(records)
        assert len(active) == len(records)
        if not records:
            continue
        name = data.draw(st.sampled_from(sorted(records)))
        others = [r.weight for other, (r, _) in records.items() if other != name]
        assert active.others_weight(name) == float(sum(map(Fraction, others), Fraction(0)))
        total = records[name][0].weight + active.others_weight(name)
        unused = active.unused(name, pool=pool, total=total)
        want = sum(
            room.unused_share(held=h, weight=r.weight, total=total, capacity=pool)
            for other, (r, h) in records.items()
            if other != name
        )
        for free in {0, pool, int(want), int(want) + 1, int(want) - 1, round(want)}:
            assert (free >= unused.against(free)) == (free >= want)
        for limit in (0, pool // 3, pool):
            got = active.claims(name, pool=pool, total=total, limit=limit, now=now)
            assert got == scanned_claims(records, name, pool, total, limit, now, window)
