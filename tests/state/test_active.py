"""The active tenants' maintained sum of unused shares compares with any number of free
blocks exactly as the per-tenant sum of `headroom.unused_share` (the rule before issue 14).
"""

from __future__ import annotations

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
