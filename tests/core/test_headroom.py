"""The headroom rule: pure arithmetic, and a Hypothesis property of the rule on one engine."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import headroom as room


def test_settings_are_checked():
    room.check_headroom(0, 0)
    room.check_headroom(room.HEADROOM, room.ACTIVE_WINDOW_S)
    for bad in ((-0.1, 1), (1, 1), (0.2, -1), (0.2, math.inf)):
        with pytest.raises(ValueError):
            room.check_headroom(*bad)


def test_recent_usage_moves_towards_what_is_held():
    first = room.observe(None, weight=1, held=0, now=100.0, window=10)
    assert first == room.Activity(1, 100.0, 0.0, 100.0)
    # Holding 60 for one window: 60 · (1 − 1/e).
    avg = room.average_at(first, held=60, now=110.0, window=10)
    assert avg == pytest.approx(60 * (1 - math.exp(-1)))
    released = room.observe(first, weight=None, held=60, now=110.0, window=10)
    assert released.last_seen == 100.0 and released.average == avg and released.stamp == 110.0
    assert room.average_at(None, held=7, now=0, window=0) == 7  # no window: what it holds


def test_over_share():
    kw = {"weight": 1.0, "total": 2.0, "capacity": 100}
    assert not room.over_share(held=40, need=10, average=80, **kw)  # 50: at its share
    assert room.over_share(held=40, need=11, average=80, **kw)
    assert not room.over_share(held=40, need=11, average=39, **kw)  # usually within it
    assert room.over_share(held=40, need=11, average=40, **kw)  # no room for this one
    assert not room.over_share(held=0, need=100, average=80, **kw)  # holds nothing


def test_allows():
    kw = {"weight": 1.0, "pool_capacity": 100, "engine_capacity": 100, "headroom": 0.2}
    over = {"held": 60, "need": 10, "average": 60.0}
    assert room.allows(others=1.0, free_after=20, **over, **kw)
    assert not room.allows(others=1.0, free_after=19, **over, **kw)
    assert room.allows(others=0.0, free_after=0, **over, **kw)  # alone: never limited
    assert room.allows(others=1.0, free_after=0, **over, **{**kw, "headroom": 0.0})
    assert room.allows(others=1.0, free_after=0, held=30, need=20, average=60.0, **kw)


@settings(max_examples=300, deadline=None)
@given(
    headroom=st.sampled_from([0.1, 0.2, 0.3]),
    quiet_weight=st.sampled_from([0.5, 1.0, 2.0]),
    steps=st.lists(
        st.tuples(st.sampled_from(["noisy", "quiet", "release"]), st.integers(1, 16)),
        max_size=200,
    ),
)
def test_a_tenant_above_its_share_never_takes_the_headroom(headroom, quiet_weight, steps):
    """One engine of 100 blocks, a flooding tenant (always asking, its recent usage above
    its share) and a quiet one. Admissions by the rule; after any admission of the flooder
    that took it above its share, at least `headroom` of the engine is free; and the quiet
    tenant, while it stays within its share and asks at most what the flooder left, always
    gets in."""
    capacity, weights = 100, {"noisy": 1.0, "quiet": quiet_weight}
    held = {"noisy": 0, "quiet": 0}
    leases: list[tuple[str, int]] = []
    for kind, need in steps:
        if kind == "release":
            if leases:
                tenant, blocks = leases.pop(need % len(leases))
                held[tenant] -= blocks
            continue
        tenant, other = kind, "quiet" if kind == "noisy" else "noisy"
        free_after = capacity - sum(held.values()) - need
        average = capacity if tenant == "noisy" else 0.0  # the flooder's usage, the quiet one's
        total = weights[tenant] + weights[other]
        over = room.over_share(
            held=held[tenant],
            need=need,
            average=average,
            weight=weights[tenant],
            total=total,
            capacity=capacity,
        )
        ok = free_after >= 0 and room.allows(
            held=held[tenant],
            need=need,
            average=average,
            weight=weights[tenant],
            others=weights[other],
            pool_capacity=capacity,
            free_after=free_after,
            engine_capacity=capacity,
            headroom=headroom,
        )
        if tenant == "quiet":
            assert not over  # its recent usage is low: it is never the one limited
            share = quiet_weight / total * capacity
            noisy_share = capacity - share
            if held["quiet"] + need <= share and held["noisy"] <= noisy_share:
                assert ok  # the flooder within its share leaves the quiet one its share
        if ok:
            held[tenant] += need
            leases.append((tenant, need))
            if tenant == "noisy" and over:
                assert capacity - sum(held.values()) >= headroom * capacity


def test_the_pool_keeps_the_others_unused_share():
    kw = {"weight": 1.0, "others": 1.0, "pool_capacity": 242, "engine_capacity": 242}
    over = {"held": 116, "need": 58, "average": 174.0, "headroom": 0.2}
    # The flooder at 2 x 58 asks a third: 68 blocks would stay free, more than 20 %, but
    # the quiet tenant (holding nothing) lacks its whole share of 121.
    unused = room.unused_share(held=0, weight=1.0, total=2.0, capacity=242)
    assert unused == 121
    assert room.allows(free_after=68, **over, **kw)  # the fixed headroom alone: allowed
    assert not room.allows(free_after=68, pool_free_after=68, others_unused=unused, **over, **kw)
    assert room.allows(free_after=121, pool_free_after=121, others_unused=unused, **over, **kw)
    assert room.unused_share(held=130, weight=1.0, total=2.0, capacity=242) == 0
    within = {"held": 58, "need": 58, "average": 60.0, "headroom": 0.2}
    assert room.allows(free_after=0, pool_free_after=0, others_unused=unused, **within, **kw)


@settings(max_examples=300, deadline=None)
@given(
    quiet_weight=st.sampled_from([0.5, 1.0, 2.0]),
    sizes=st.sampled_from([(1, 16), (20, 40), (58, 58)]),
    steps=st.lists(
        st.tuples(st.sampled_from(["noisy", "quiet", "release"]), st.integers(0, 10**6)),
        max_size=200,
    ),
)
def test_a_tenant_within_its_share_gets_in_at_once(quiet_weight, sizes, steps):
    """The sharing incentive: with both tenants active, whatever the flooder did before, a
    quiet request that keeps the quiet tenant within its share always fits at once (as on
    a static partition of the engine cut to its weight)."""
    capacity, weights = 242, {"noisy": 1.0, "quiet": quiet_weight}
    total = sum(weights.values())
    held = {"noisy": 0, "quiet": 0}
    leases: list[tuple[str, int]] = []
    for kind, draw in steps:
        if kind == "release":
            if leases:
                tenant, blocks = leases.pop(draw % len(leases))
                held[tenant] -= blocks
            continue
        need = sizes[0] + draw % (sizes[1] - sizes[0] + 1)
        tenant, other = kind, "quiet" if kind == "noisy" else "noisy"
        free_after = capacity - sum(held.values()) - need
        unused = room.unused_share(
            held=held[other], weight=weights[other], total=total, capacity=capacity
        )
        ok = free_after >= 0 and room.allows(
            held=held[tenant],
            need=need,
            average=capacity if tenant == "noisy" else 0.0,
            weight=weights[tenant],
            others=weights[other],
            pool_capacity=capacity,
            free_after=free_after,
            engine_capacity=capacity,
            headroom=0.2,
            pool_free_after=free_after,
            others_unused=unused,
        )
        if tenant == "quiet" and (held["quiet"] + need) * total <= quiet_weight * capacity:
            assert ok
        if ok:
            held[tenant] += need
            leases.append((tenant, need))


def test_the_line_keeps_its_last_places_for_tenants_within_their_share():
    kw = {"max_length": 100, "weight": 1.0, "others": 1.0, "headroom": 0.2}
    assert room.line_allows(queued=49, length=95, **kw)  # its 50th: within its share
    assert room.line_allows(queued=60, length=79, **kw)  # the 80th place: still open
    assert not room.line_allows(queued=60, length=80, **kw)  # the last 20 are the others'
    assert room.line_allows(queued=90, length=90, **{**kw, "others": 0.0})  # alone
    assert room.line_allows(queued=90, length=90, **{**kw, "headroom": 0.0})
