"""The indexed line (issue 14) decides exactly as the line that scanned every entry did.

Random sequences of pushes, charges, services, leaves, surcharges and expiries go to both
`gateway.core.fairqueue.FairQueue` and the pre-issue-14 copy in `fairqueue_reference`;
after every step their lines, tags, virtual times, counts and blocking answers agree.
"""

from __future__ import annotations

from dataclasses import astuple
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.fairqueue import FairQueue
from tests.core.fairqueue_reference import FairQueue as Reference

TENANTS = ("a", "b", "c")
ENGINES = ("e1", "e2")
ENGINE_SETS = st.frozensets(st.sampled_from(ENGINES), min_size=1)

op = st.one_of(
    st.tuples(
        st.just("push"),
        st.sampled_from(TENANTS),
        st.sampled_from((0, 1)),
        st.sampled_from((0.5, 1.0, 3.0)),
        ENGINE_SETS,
        st.integers(0, 40),
        st.integers(1, 30),
    ),
    st.tuples(
        st.just("charge"), st.sampled_from(TENANTS), st.sampled_from((0, 1)), st.integers(0, 40)
    ),
    st.tuples(st.just("surcharge"), st.sampled_from(TENANTS), st.integers(1, 40)),
    st.tuples(st.just("serve"), st.integers(0, 30)),
    st.tuples(st.just("leave"), st.integers(0, 30)),
    st.tuples(st.just("expire"), st.integers(0, 3)),
)


def fields(got: Any) -> Any:
    """The entries' values (the two modules' `Waiting` are different classes)."""
    if isinstance(got, list):
        return [astuple(e) for e in got]
    return None if got is None else astuple(got)


def same(new: FairQueue, old: Reference, now: float) -> None:
    assert fields(new.in_order()) == fields(old.in_order())
    assert len(new) == len(old)
    for p in (0, 1):
        assert new.virtual_now(p) == old.virtual_now(p)
        for t in TENANTS:
            assert new.last_finish(t, p) == old.last_finish(t, p)
            assert new.count(t) == old.count(t)
            for w in (0.5, 1.0):
                key = new.newcomer_key(t, p, w)
                assert key == old.newcomer_key(t, p, w)
                for engines in ({"e1"}, {"e2"}, {"e1", "e2"}):
                    assert new.blocked(key, frozenset(engines)) == old.blocked(
                        key, frozenset(engines)
                    )
                    heavy = lambda e: e.blocks > 20  # noqa: E731
                    assert new.blocked(key, frozenset(engines), passable=heavy) == old.blocked(
                        key, frozenset(engines), passable=heavy
                    )
    for e in old.in_order():
        for engines in ({"e1"}, {"e1", "e2"}):
            assert new.blocked(e.key, frozenset(engines), own_id=e.id) == old.blocked(
                e.key, frozenset(engines), own_id=e.id
            )
    assert new.blocks_ahead(frozenset(ENGINES)) == old.blocks_ahead(frozenset(ENGINES))


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40), st.sampled_from((0.0, 16.0, 256.0)))
def test_the_indexed_line_decides_as_the_scanning_one(ops: list[tuple], burst: float) -> None:
    new, old = FairQueue(burst, prune=False), Reference(burst)  # pruning: test_fairqueue_prune
    now, pushed = 0.0, 0
    for o in ops:
        if o[0] == "push":
            _, tenant, prio, weight, engines, blocks, wait = o
            args = dict(tenant=tenant, priority=prio, weight=weight, engines=engines, blocks=blocks)
            got = new.push(f"q{pushed}", **args, expires_at=now + wait)
            assert fields(got) == fields(old.push(f"q{pushed}", **args, expires_at=now + wait))
            pushed += 1
        elif o[0] == "charge":
            new.charge(o[1], o[2], 1.0, o[3])
            old.charge(o[1], o[2], 1.0, o[3])
        elif o[0] == "surcharge":
            new.surcharge(o[1], 0, 1.0, o[2])
            old.surcharge(o[1], 0, 1.0, o[2])
        elif o[0] in ("serve", "leave"):
            entry_id = f"q{o[1]}"
            assert fields(getattr(new, o[0])(entry_id)) == fields(getattr(old, o[0])(entry_id))
        else:
            now += o[1] * 7.0
            assert fields(new.expire(now)) == fields(old.expire(now))
        same(new, old, now)
