"""The fair order of the waiting line: priority first, weighted fair sharing, arrival."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.fairqueue import BURST_BLOCKS, NEWCOMER_SEQ, FairQueue, check_burst, check_policy

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
    q = FairQueue(0)
    entries = [push(q, "a", blocks=b) for b in (3, 1, 2)]
    assert [e.id for e in q.in_order()] == [e.id for e in entries]
    assert [e.start for e in entries] == [0, 3, 4]
    assert [e.finish for e in entries] == [3, 4, 6]


def test_two_tenants_interleave_by_blocks():
    q = FairQueue(0)
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
    assert not q.blocked(q.newcomer_key("high", 5, 1.0), frozenset({"a"}))
    high = push(q, "high", blocks=100, priority=5)
    assert q.in_order()[0] == high
    # ...but by a queued entry of its own class; and the low entries are behind it.
    assert q.blocked(q.newcomer_key("other", 5, 1.0), frozenset({"a"}))
    assert q.blocked(low[0].key, frozenset({"a"}), own_id=low[0].id)


def test_blocked_only_by_entries_ahead_that_compete():
    q = FairQueue()
    first = push(q, "t", engines=("a", "b"))
    second = push(q, "t", engines=("b",))
    assert not q.blocked(first.key, frozenset({"a", "b"}), own_id=first.id)  # passes itself
    assert q.blocked(second.key, frozenset({"b"}), own_id=second.id)
    assert not q.blocked(q.newcomer_key("u", 0, 1.0), frozenset({"c"}))  # other engines move
    assert q.blocked(q.newcomer_key("u", 0, 1.0), frozenset({"b", "c"}))
    assert q.blocks_ahead(frozenset({"a"})) == 1 and q.blocks_ahead(frozenset({"b"})) == 2


def test_newcomer_stands_behind_equal_start_tags():
    q = FairQueue()
    e = push(q, "a")
    key = q.newcomer_key("b", 0, 1.0)
    assert key == (0, e.start, NEWCOMER_SEQ) and key > e.key


def test_leaving_leaves_no_trace_but_serving_does():
    q = FairQueue()
    gone = push(q, "a", blocks=10)
    assert q.leave(gone.id) == gone and q.leave(gone.id) is None
    assert q.start_tag("a", 0, 1.0) == 0  # abandoned: costs nothing
    served = push(q, "a", blocks=10)
    q.serve(served.id)
    assert q.start_tag("a", 0, 1.0) == 10  # served: the tenant's history
    assert q.virtual_now(0) == 0  # nothing queued: the largest start served
    assert q.start_tag("b", 0, 1.0) == 0


def test_direct_admissions_are_charged():
    q = FairQueue()
    q.charge("burst", 0, 1.0, 8)
    assert q.start_tag("burst", 0, 1.0) == 8
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
    burst=st.sampled_from([0, 8, 64, 256]),
)
def test_a_flood_does_not_push_others_back(quiet_blocks, floods, noisy_block, burst):
    """A quiet tenant with one request at a time: however many entries the noisy tenant
    adds, at most (the quiet tenant's previous request + one noisy entry + the noisy
    tenant's own burst credit) of noisy blocks are served before it — the same bound as if
    the noisy tenant sent at its share. The flood's size does not appear in it."""
    q = FairQueue(burst)
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
        assert noisy_before <= previous + noisy_block + burst
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


# ---- the burst credit ------------------------------------------------------------------


def backlog(q, tenant, blocks, count):
    return [push(q, tenant, blocks) for _ in range(count)]


def test_burst_credit_puts_an_idle_tenant_ahead_by_at_most_b():
    q = FairQueue(burst_blocks=16)
    backlog(q, "noisy", 10, 30)
    for _ in range(10):
        serve_head(q)  # V = 100: the noisy head starts at 100
    assert q.virtual_now(0) == 100
    quiet = [push(q, "quiet", 10) for _ in range(4)]
    # Starts 84, 94 (credited, before V), then 104, 114: chained like anyone's.
    assert [e.start for e in quiet] == [84, 94, 104, 114]
    order = [e.tenant for e in q.in_order()][:7]
    assert order == ["quiet", "quiet", "noisy", "quiet", "noisy", "quiet", "noisy"]
    # V does not go back: the next idle tenant also gets only B of credit.
    assert q.virtual_now(0) == 100
    assert push(q, "late", 1).start == 84


def test_burst_credit_is_scaled_by_weight_and_capped_by_what_was_not_used():
    q = FairQueue(burst_blocks=16)
    backlog(q, "noisy", 10, 20)
    for _ in range(10):
        serve_head(q)
    assert push(q, "heavy", 4, weight=4.0).start == 100 - 16 / 4  # still 16 blocks ahead
    # A tenant that used almost its share gets only what it did not use.
    q2 = FairQueue(burst_blocks=16)
    q2.charge("busy", 0, 1.0, 95)
    backlog(q2, "noisy", 10, 20)  # V = 0: both start at 0; busy's F is 95
    for _ in range(10):
        serve_head(q2)  # noisy's head now starts at 100
    assert q2.start_tag("busy", 0, 1.0) == 95  # 5 blocks of credit, not 16


def test_a_backlogged_tenant_gets_no_credit():
    q = FairQueue(burst_blocks=1000)
    a = backlog(q, "a", 5, 3)
    assert [e.start for e in a] == [0, 5, 10]
    for _ in range(2):
        serve_head(q)
    assert push(q, "a", 5).start == 15  # chained to its own last finish


def test_burst_blocks_must_be_finite_and_non_negative():
    assert FairQueue().burst_blocks == BURST_BLOCKS
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            check_burst(bad)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["push", "push", "push", "serve", "serve", "leave"]),
            st.sampled_from(["a", "b", "c"]),
            blocks_st,
        ),
        min_size=1,
        max_size=150,
    ),
    burst=st.sampled_from([0, 1, 16, 100]),
    weights=st.tuples(*[st.sampled_from([0.5, 1.0, 2.0, 3.0])] * 3),
)
def test_burst_credit_bound_over_any_window(ops, burst, weights):
    """Served in head order (one engine), with arbitrary arrivals, services and abandoned
    entries: V never goes back; every queued entry starts at or after V − B/weight; and
    over ANY stretch of services a tenant gets at most weight·ΔV + B + one entry of blocks,
    i.e. never more than B blocks above its share (plus one entry, as in plain SFQ)."""
    q = FairQueue(burst)
    weight = dict(zip("abc", weights, strict=True))
    v_before: list[float] = []  # V just before each service
    served: list[tuple[str, int]] = []
    last_v = 0.0
    for op, tenant, blocks in ops:
        if op == "push":
            push(q, tenant, blocks, weight=weight[tenant])
        elif op == "leave":
            mine = [e for e in q.in_order() if e.tenant == tenant]
            if mine:
                q.leave(mine[len(mine) // 2].id)
        elif len(q):
            v_before.append(q.virtual_now(0))
            head = serve_head(q)
            served.append((head.tenant, head.blocks))
        v = q.virtual_now(0)
        assert v >= last_v
        last_v = v
        for e in q.in_order():
            assert e.start >= v - burst / weight[e.tenant] - 1e-9
    for i in range(len(served)):
        got = {"a": 0.0, "b": 0.0, "c": 0.0}
        for k in range(i, len(served)):
            tenant, blocks = served[k]
            got[tenant] += blocks
            share = weight[tenant] * (v_before[k] - v_before[i])
            assert got[tenant] <= share + burst + 32 + 1e-6


def test_surcharge_moves_the_finish_tag_without_burst_credit():
    line = FairQueue(burst_blocks=64)
    line.charge("t", 0, 2.0, 4)  # finish 0 + 4/2 = 2 (the credit only moves starts back)
    assert line.last_finish("t", 0) == 2
    line.surcharge("t", 0, 2.0, 6)  # from max(V, F) = 2, 6 more blocks at weight 2
    assert line.last_finish("t", 0) == 5
    line.surcharge("u", 0, 1.0, 3)  # a tenant with no history starts at V
    assert line.last_finish("u", 0) == line.virtual_now(0) + 3


def test_start_tags_equal_but_for_rounding_go_by_arrival():
    """Weight 1.5: a's second start tag is 5/1.5 = 3.3333333333333335, b's 1/1.5 + 4/1.5 =
    3.333333333333333 — equal in exact arithmetic, apart in the last bit. The line orders
    start tags to six decimals, as the Redis line's text keys do, so the tie goes by arrival
    (a first) in both stores; by the float b went first here and a on Redis."""
    q = FairQueue(burst_blocks=0)
    a1 = push(q, "a", 5, weight=1.5)
    b1 = push(q, "b", 1, weight=1.5)
    b2 = push(q, "b", 4, weight=1.5)
    a2 = push(q, "a", 1, weight=1.5)
    b3 = push(q, "b", 1, weight=1.5)
    assert a2.start != b3.start and a2.start == pytest.approx(b3.start)  # the last bit
    assert [e.id for e in q.in_order()] == [a1.id, b1.id, b2.id, a2.id, b3.id]
