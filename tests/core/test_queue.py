import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.queue import DispatchPass, FifoQueue, Waiter


def w(i, engines=("a",), blocks=1, deadline=100.0):
    return Waiter(str(i), frozenset(engines), blocks, enqueued_at=float(i), deadline=deadline)


def test_fifo_order_and_bound():
    q = FifoQueue(2)
    q.push(w(1))
    q.push(w(2))
    assert not q.has_room()
    with pytest.raises(OverflowError):
        q.push(w(3))
    assert [x.id for x in q.in_order()] == ["1", "2"]
    assert q.remove("1").id == "1" and q.remove("1") is None
    assert [x.id for x in q.in_order()] == ["2"]


def test_expired_removed():
    q = FifoQueue(10)
    q.push(w(1, deadline=5))
    q.push(w(2, deadline=50))
    assert [x.id for x in q.expired(10)] == ["1"]
    assert len(q) == 1


def test_blocks_ahead_counts_competitors_only():
    q = FifoQueue(10)
    q.push(w(1, ("a",), 5))
    q.push(w(2, ("b",), 7))
    q.push(w(3, ("a", "b"), 11))
    assert q.blocks_ahead(frozenset({"a"})) == 16
    assert q.blocks_ahead(frozenset({"c"})) == 0


def test_no_overtaking_on_claimed_engines():
    d = DispatchPass()
    first, second, other = w(1, ("a", "b")), w(2, ("a",)), w(3, ("c",))
    d.stuck(first)
    assert d.usable(second) == frozenset()  # may not overtake on a
    assert d.usable(other) == frozenset({"c"})  # other engines still move


@given(st.lists(st.integers(0, 1000), unique=True, max_size=50), st.data())
def test_queue_keeps_arrival_order_under_removals(ids, data):
    q = FifoQueue(len(ids))
    for i in ids:
        q.push(w(i))
    removed = set(data.draw(st.lists(st.sampled_from(ids), max_size=len(ids))) if ids else [])
    for i in removed:
        q.remove(str(i))
    assert [x.id for x in q.in_order()] == [str(i) for i in ids if i not in removed]
