"""The fair order of the waiting line: priority first, weighted fair sharing, arrival."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.fairqueue import NEWCOMER_SEQ, FairQueue, check_policy

_ids = itertools.count()


def push(q, tenant, blocks=1, *, priority=0, weight=1.0, engines=("a",), expires_at=1e9):
    return q.push(
        f"{tenant}-{next(_ids)}",
        tenant=tenant,
        priority=priority,
        weight=weight,
        engines=engines,
        blocks=blocks,
        expires_at=expires_at,
    )


def serve_head(q):
    head = q.in_order()[0]
    assert q.serve(head.id) == head
    return head


def test_single_tenant_is_fifo():
    q = FairQueue()
    entries = [push(q, "a", blocks=b) for b in (3, 1, 2)]
    assert [e.id for e in q.in_order()] == [e.id for e in entries]
    assert [e.start for e in entries] == [0, 3, 4]
    assert [e.finish for e in entries] == [3, 4, 6]


def test_two_tenants_interleave_by_blocks():
    q = FairQueue()
    a = [push(q, "a", blocks=2) for _ in range(3)]  # starts 0, 2, 4
    b = [push(q, "b", blocks=1) for _ in range(4)]  # starts 0, 1, 2, 3
    order = [e.id for e in q.in_order()]
    assert order == [a[0].id, b[0].id, b[1].id, a[1].id, b[2].id, b[3].id, a[2].id]


def test_weight_scales_the_charge():
    q = FairQueue()
    heavy = [push(q, "h", blocks=4, weight=4.0) for _ in range(4)]  # starts 0, 1, 2, 3
    light = [push(q, "l", blocks=4) for _ in range(2)]  # starts 0, 4
    assert [e.start for e in heavy] == [0, 1, 2, 3]
    assert [e.start for e in light] == [0, 4]
    assert [e.id for e in q.in_order()][:2] == [heavy[0].id, light[0].id]


def test_priority_classes_are_strict():
    q = FairQueue()
    low = [push(q, "low", blocks=1, priority=0) for _ in range(3)]
    # A newcomer of a higher class is blocked by nobody of a lower class...
    assert not q.blocked(q.newcomer_key("high", 5), frozenset({"a"}))
    high = push(q, "high", blocks=100, priority=5)
    assert q.in_order()[0] == high
    # ...but by a queued entry of its own class; and the low entries are behind it.
    assert q.blocked(q.newcomer_key("other", 5), frozenset({"a"}))
    assert q.blocked(low[0].key, frozenset({"a"}), own_id=low[0].id)


def test_blocked_only_by_entries_ahead_that_compete():
    q = FairQueue()
    first = push(q, "t", engines=("a", "b"))
    second = push(q, "t", engines=("b",))
    assert not q.blocked(first.key, frozenset({"a", "b"}), own_id=first.id)  # passes itself
    assert q.blocked(second.key, frozenset({"b"}), own_id=second.id)
    assert not q.blocked(q.newcomer_key("u", 0), frozenset({"c"}))  # other engines move
    assert q.blocked(q.newcomer_key("u", 0), frozenset({"b", "c"}))
    assert q.blocks_ahead(frozenset({"a"})) == 1 and q.blocks_ahead(frozenset({"b"})) == 2


def test_newcomer_stands_behind_equal_start_tags():
    q = FairQueue()
    e = push(q, "a")
    key = q.newcomer_key("b", 0)
    assert key == (0, e.start, NEWCOMER_SEQ) and key > e.key


def test_leaving_leaves_no_trace_but_serving_does():
    q = FairQueue()
    gone = push(q, "a", blocks=10)
    assert q.leave(gone.id) == gone and q.leave(gone.id) is None
    assert q.start_tag("a", 0) == 0  # abandoned: costs nothing
    served = push(q, "a", blocks=10)
    q.serve(served.id)
    assert q.start_tag("a", 0) == 10  # served: the tenant's history
    assert q.virtual_now(0) == 0  # nothing queued: the largest start served
    assert q.start_tag("b", 0) == 0


def test_direct_admissions_are_charged():
    q = FairQueue()
    q.charge("burst", 0, 1.0, 8)
    assert q.start_tag("burst", 0) == 8
    other = push(q, "calm", blocks=1)
    mine = push(q, "burst", blocks=1)
    assert [e.id for e in q.in_order()] == [other.id, mine.id]


def test_expire_removes_by_time_and_push_is_idempotent():
    q = FairQueue()
    old = push(q, "a", expires_at=5)
    keep = push(q, "a", expires_at=50)
    assert (
        q.push(old.id, tenant="x", priority=3, weight=1, engines=(), blocks=9, expires_at=0) == old
    )
    assert q.expire(10) == [old]
    assert [e.id for e in q.in_order()] == [keep.id]
    assert len(q) == 1 and q.count("a") == 1 and old.id not in q


@pytest.mark.parametrize(
    ("priority", "weight"), [(10**9, 1.0), (-(10**9), 1.0), (0, 0.0), (0, -1.0)]
)
def test_policy_limits(priority, weight):
    with pytest.raises(ValueError):
        check_policy(priority, weight)


# ---- invariants ------------------------------------------------------------------------

blocks_st = st.integers(min_value=1, max_value=32)


@settings(max_examples=200, deadline=None)
@given(
    a_blocks=st.lists(blocks_st, min_size=50, max_size=120),
    b_blocks=st.lists(blocks_st, min_size=50, max_size=120),
    weight_a=st.sampled_from([1.0, 2.0, 3.0, 0.5]),
)
def test_backlogged_tenants_share_by_weight(a_blocks, b_blocks, weight_a):
    """While both wait, served blocks / weight differ by at most one largest entry each."""
    q = FairQueue()
    for b in a_blocks:
        push(q, "a", b, weight=weight_a)
    for b in b_blocks:
        push(q, "b", b)
    served = {"a": 0.0, "b": 0.0}
    bound = 32 / weight_a + 32 / 1.0
    while q.count("a") and q.count("b"):
        head = serve_head(q)
        served[head.tenant] += head.blocks
        assert abs(served["a"] / weight_a - served["b"]) <= bound


@settings(max_examples=200, deadline=None)
@given(
    quiet_blocks=st.lists(blocks_st, min_size=1, max_size=30),
    floods=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=30),
    noisy_block=blocks_st,
)
def test_a_flood_does_not_push_others_back(quiet_blocks, floods, noisy_block):
    """A quiet tenant with one request at a time: however many entries the noisy tenant
    adds, at most (the quiet tenant's previous request + one noisy entry) of noisy blocks
    are served before it — the same bound as if the noisy tenant sent at its share."""
    q = FairQueue()
    previous = 0
    for qb, flood in zip(quiet_blocks, floods, strict=False):
        for _ in range(flood):
            push(q, "noisy", noisy_block)
        mine = push(q, "quiet", qb)
        noisy_before = 0
        while True:
            head = serve_head(q)
            if head.id == mine.id:
                break
            noisy_before += head.blocks
        assert noisy_before <= previous + noisy_block
        previous = qb


@settings(max_examples=100, deadline=None)
@given(
    entries=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(-2, 2), blocks_st), min_size=1, max_size=40
    )
)
def test_priority_strictly_first(entries):
    q = FairQueue()
    for tenant, prio, b in entries:
        push(q, f"{tenant}{prio}", b, priority=prio)
    order = q.in_order()
    assert [e.priority for e in order] == sorted((e.priority for e in order), reverse=True)
    # Within a tenant, arrival order is kept.
    for tenant in {e.tenant for e in order}:
        seqs = [e.seq for e in order if e.tenant == tenant]
        assert seqs == sorted(seqs)


@settings(max_examples=30, deadline=None)
@given(seed_blocks=st.lists(blocks_st, min_size=20, max_size=20))
def test_equal_weights_equal_shares_over_a_long_run(seed_blocks):
    """Two tenants keep 20 entries waiting each over 2000 services: equal block shares."""
    q = FairQueue()
    cycle = {"a": itertools.cycle(seed_blocks), "b": itertools.cycle(reversed(seed_blocks))}
    for tenant in "ab":
        for _ in range(20):
            push(q, tenant, next(cycle[tenant]))
    served = {"a": 0, "b": 0}
    for _ in range(2000):
        head = serve_head(q)
        served[head.tenant] += head.blocks
        push(q, head.tenant, next(cycle[head.tenant]))
    assert abs(served["a"] - served["b"]) <= 64
    assert abs(served["a"] / (served["a"] + served["b"]) - 0.5) < 0.01


def test_leaving_closes_the_gap_in_the_tenants_run():
    q = FairQueue()
    a = [push(q, "a", blocks=b) for b in (2, 3, 4)]  # starts 0, 2, 5
    other = push(q, "b", blocks=1)  # start 0
    q.leave(a[1].id)
    # As if a[1] had never come: a[2] starts where a[1] did; b is untouched.
    assert q.get(a[2].id).start == 2 and q.get(a[2].id).finish == 6
    assert q.get(other.id) == other
    # Expiry closes gaps the same way.
    late = push(q, "a", blocks=1, expires_at=5)
    after = push(q, "a", blocks=1)
    assert (late.start, after.start) == (6, 7)
    assert q.expire(10) == [late]
    assert q.get(after.id).start == 6


@settings(max_examples=100, deadline=None)
@given(
    blocks=st.lists(blocks_st, min_size=2, max_size=15),
    gone=st.data(),
)
def test_an_abandoned_entry_leaves_no_trace(blocks, gone):
    """Leaving equals never having joined, for a backlogged tenant."""
    skip = gone.draw(st.integers(0, len(blocks) - 1))
    q, ref = FairQueue(), FairQueue()
    entries = [push(q, "a", b) for b in blocks]
    kept = [push(ref, "a", b) for i, b in enumerate(blocks) if i != skip]
    q.leave(entries[skip].id)
    assert [e.start for e in q.in_order()] == [e.start for e in kept]
