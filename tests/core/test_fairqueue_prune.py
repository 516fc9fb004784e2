"""Forgetting served tags that can no longer matter (issue 14) changes no decision while
each tenant keeps its weight, and keeps the line's memory to the tenants that still count."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.fairqueue import FairQueue

WEIGHTS = {"a": 0.5, "b": 1.0, "c": 3.0}  # one weight per tenant, as a config gives
ENGINES = st.frozensets(st.sampled_from(("e1", "e2")), min_size=1)

op = st.one_of(
    st.tuples(
        st.just("push"),
        st.sampled_from(sorted(WEIGHTS)),
        st.sampled_from((0, 1)),
        ENGINES,
        st.integers(0, 40),
    ),
    st.tuples(
        st.just("charge"),
        st.sampled_from(sorted(WEIGHTS)),
        st.sampled_from((0, 1)),
        st.integers(0, 40),
    ),
    st.tuples(st.just("surcharge"), st.sampled_from(sorted(WEIGHTS)), st.integers(1, 40)),
    st.tuples(st.just("serve"), st.integers(0, 30)),
    st.tuples(st.just("leave"), st.integers(0, 30)),
)


def same(pruned: FairQueue, full: FairQueue) -> None:
    assert [(e.id, e.key) for e in pruned.in_order()] == [(e.id, e.key) for e in full.in_order()]
    for p in (0, 1):
        assert pruned.virtual_now(p) == full.virtual_now(p)
        for t, w in WEIGHTS.items():
            assert pruned.newcomer_key(t, p, w) == full.newcomer_key(t, p, w)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60), st.sampled_from((0.0, 16.0, 256.0)))
def test_forgetting_tags_changes_no_order(ops: list[tuple], burst: float) -> None:
    pruned, full = FairQueue(burst), FairQueue(burst, prune=False)
    pushed = 0
    for o in ops:
        for q in (pruned, full):
            if o[0] == "push":
                _, t, prio, engines, blocks = o
                q.push(
                    f"q{pushed}",
                    tenant=t,
                    priority=prio,
                    weight=WEIGHTS[t],
                    engines=engines,
                    blocks=blocks,
                    expires_at=1e9,
                )
            elif o[0] == "charge":
                q.charge(o[1], o[2], WEIGHTS[o[1]], o[3])
            elif o[0] == "surcharge":
                q.surcharge(o[1], 0, WEIGHTS[o[1]], o[2])
            else:
                getattr(q, o[0])(f"q{o[1]}")
        pushed += o[0] == "push"
        same(pruned, full)


def _serve_many(q: FairQueue) -> None:
    """A thousand one-request tenants served one after another, beside a steady tenant whose
    line of requests (always two waiting) moves the virtual time on."""
    q.push("s-1", tenant="steady", priority=0, weight=1.0, engines={"e"}, blocks=8, expires_at=1e9)
    for i in range(1000):
        q.push(
            f"s{i}",
            tenant="steady",
            priority=0,
            weight=1.0,
            engines={"e"},
            blocks=8,
            expires_at=1e9,
        )
        q.serve(f"s{i - 1}")
        q.push(
            f"x{i}", tenant=f"t{i}", priority=0, weight=1.0, engines={"e"}, blocks=8, expires_at=1e9
        )
        q.serve(f"x{i}")


def test_tenants_gone_are_forgotten() -> None:
    pruned, full = FairQueue(16.0), FairQueue(16.0, prune=False)
    _serve_many(pruned)
    _serve_many(full)
    assert full.served_tags() == 1001
    assert pruned.served_tags() <= 10  # those within B / weight of V still count
    same(pruned, full)
