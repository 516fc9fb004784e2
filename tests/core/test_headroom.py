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
    assert not room.over_share(held=40, need=11, average=50, **kw)  # usually within it
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
