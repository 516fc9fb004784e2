"""The indexed line (issue 14) answers as a scan of its entries would.

Random sequences of pushes, charges, services, leaves, surcharges and expiries go to
`gateway.core.fairqueue.FairQueue`; after every step each of its indexed answers — the
entries in line order, the counts, the blocking entry for any key, set of engines, own id
and passable entries, the blocks ahead, a tenant's next entry — is the one a scan of the
entries finds, and V is the first start tag queued in its class unless that would take it
back (it never goes back). The tag arithmetic itself is checked against the Redis scripts'
(tests/state/test_lua_differential.py compares the two lines' tags after every step) and by
the properties of tests/core/test_fairqueue.py. (Until issue 39 this compared the line with a
copy of the pre-issue-14 one.)
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.fairqueue import NEWCOMER_SEQ, FairQueue, Key, Waiting, place

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


def scanned_blocker(
    line: list[Waiting],
    key: Key,
    engines: frozenset[str],
    own_id: str | None = None,
    passable: Callable[[Waiting], bool] | None = None,
) -> Waiting | None:
    """The nearest entry before `key` that competes for `engines`, is not `own_id` and not
    passable, by scanning the whole line."""
    ahead = [
        e
        for e in line
        if e.key < key
        and e.engines & engines
        and e.id != own_id
        and (passable is None or not passable(e))
    ]
    return max(ahead, key=lambda e: e.key, default=None)


def answers_as_scanned(q: FairQueue, v_before: dict[int, float]) -> None:
    line = list(q._entries.values())  # the entries, not the index
    assert q.in_order() == sorted(line, key=lambda e: e.key)
    assert len(q) == len(line)
    for e in line:
        assert e.id in q and q.get(e.id) == e
    heavy = lambda e: e.blocks > 20  # noqa: E731
    for p in (0, 1):
        queued = [e.start for e in q.in_order() if e.priority == p]
        v = q.virtual_now(p)
        assert v >= v_before[p]  # V never goes back
        if queued:
            assert v == max(v_before[p], queued[0])
        v_before[p] = v
        for t in TENANTS:
            mine = [e for e in line if e.tenant == t]
            assert q.count(t) == len(mine)
            finishes = [e.finish for e in mine if e.priority == p]
            assert q.last_finish(t, p) >= max(finishes, default=0.0)
            for w in (0.5, 1.0):
                key = q.newcomer_key(t, p, w)
                assert key == (-p, place(q.start_tag(t, p, w)), NEWCOMER_SEQ)
                for engines in ({"e1"}, {"e2"}, {"e1", "e2"}):
                    es = frozenset(engines)
                    assert q.blocker(key, es) == scanned_blocker(line, key, es)
                    got = q.blocker(key, es, passable=heavy)
                    assert got == scanned_blocker(line, key, es, passable=heavy)
                    assert q.blocked(key, es) == (scanned_blocker(line, key, es) is not None)
    for e in line:
        for engines in ({"e1"}, {"e1", "e2"}):
            es = frozenset(engines)
            assert q.blocker(e.key, es, own_id=e.id) == scanned_blocker(line, e.key, es, e.id)
        later = [x for x in line if (x.tenant, x.priority) == (e.tenant, e.priority)]
        nxt = min((x for x in later if x.key > e.key), key=lambda x: x.key, default=None)
        assert q.next_of_tenant(e) == nxt
    everything = frozenset(ENGINES)
    assert q.blocks_ahead(everything) == sum(e.blocks for e in line)
    assert q.blocks_ahead(frozenset({"e2"})) == sum(e.blocks for e in line if "e2" in e.engines)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40), st.sampled_from((0.0, 16.0, 256.0)), st.booleans())
def test_the_indexed_line_answers_as_a_scan(ops: list[tuple], burst: float, prune: bool) -> None:
    q = FairQueue(burst, prune=prune)
    now, pushed = 0.0, 0
    v_before = {0: 0.0, 1: 0.0}
    for o in ops:
        if o[0] == "push":
            _, tenant, prio, weight, engines, blocks, wait = o
            args = dict(tenant=tenant, priority=prio, weight=weight, engines=engines, blocks=blocks)
            got = q.push(f"q{pushed}", **args, expires_at=now + wait)
            assert got == q.get(f"q{pushed}")
            pushed += 1
        elif o[0] == "charge":
            q.charge(o[1], o[2], 1.0, o[3])
        elif o[0] == "surcharge":
            q.surcharge(o[1], 0, 1.0, o[2])
        elif o[0] in ("serve", "leave"):
            entry_id = f"q{o[1]}"
            was = q.get(entry_id)
            assert getattr(q, o[0])(entry_id) == was
            assert entry_id not in q
        else:
            now += o[1] * 7.0
            due = sorted((e for e in q.in_order() if e.expires_at <= now), key=lambda e: e.key)
            assert [e.id for e in q.expire(now)] == [e.id for e in due]
        answers_as_scanned(q, v_before)
