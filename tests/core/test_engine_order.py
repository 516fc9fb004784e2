"""The engine order (gateway/core/engine_order.py) against sorting every engine."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.engine_order import EngineOrder

NAMES = ("a", "b", "c", "d", "e", "f")
moves = st.lists(
    st.tuples(
        st.sampled_from(NAMES),
        st.integers(-3, 12),
        st.integers(0, 4),
        st.booleans(),
        st.integers(0, 2),
    ),
    max_size=60,
)


@given(moves)
def test_the_order_is_most_free_then_fewest_running_then_kind_then_name(ops: list) -> None:
    order = EngineOrder()
    state: dict[str, tuple[int, int, int]] = {}
    for name, free, running, open_, kind in ops:
        order.set(name, free, running, open_, kind)
        if open_:
            state[name] = (free, running, kind)
        else:
            state.pop(name, None)
        want = sorted(state.items(), key=lambda kv: (-kv[1][0], kv[1][1], kv[1][2], kv[0]))
        assert list(order) == [(n, f, r) for n, (f, r, _) in want]
        assert len(order) == len(state)


@given(moves, st.frozensets(st.sampled_from(NAMES)), st.integers(-3, 12), st.booleans())
def test_first_is_the_best_that_passes_and_tied_its_rank(
    ops: list, failing: frozenset, floor: int, by_running: bool
) -> None:
    order = EngineOrder()
    kinds = {}
    for name, free, running, open_, kind in ops:
        order.set(name, free, running, open_, kind)
        kinds[name] = kind
    visited: list[str] = []

    def passes(name: str) -> bool:
        visited.append(name)
        return name not in failing

    got = order.first(passes, floor)
    ok = [(n, f, r) for n, f, r in order if n not in failing and f >= floor]
    if not ok:
        assert got is None
        return
    assert got == ok[0][0]
    # Only the engines ranked above it were visited, and only those with `floor` free.
    assert visited == [n for n, f, r in order if f >= floor][: len(visited)]
    assert visited[-1] == got
    rank = (ok[0][1], ok[0][2]) if by_running else (ok[0][1],)
    want = sorted(n for n, f, r in order if ((f, r) if by_running else (f,)) == rank)
    parts = order.tied(got, by_running=by_running)
    assert sorted(n for part in parts for n in part) == want
    for part in parts:  # each part: one kind, one running count, in name order
        assert part == sorted(part)
        assert len({(kinds[n], dict((m, r) for m, f, r in order)[n]) for n in part}) == 1
    assert len(parts) == len({(kinds[n], dict((m, r) for m, f, r in order)[n]) for n in want})


def test_a_verdict_of_none_stops_the_walk() -> None:
    order = EngineOrder()
    for name, free in (("a", 9), ("b", 8), ("c", 7)):
        order.set(name, free, 0)
    assert order.first(lambda n: None if n == "b" else n == "c", 0) is None
    assert order.first(lambda n: n == "c", 0) == "c"
    order.discard("c")
    assert order.first(lambda n: n == "c", 0) is None
