"""Block hashes and the prefix index: what the gateway expects each engine to have cached."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.prefix import PrefixHolds, PrefixIndex, block_hashes, hit_cap, leading


def test_hashes_chain_from_the_start_and_cover_full_blocks_only() -> None:
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # 40 tokens: two full blocks, a partial third has no hash
    b = block_hashes([*range(32), 99, 98], 16)
    assert b == a  # same first 32 tokens: same two hashes
    c = block_hashes([1000, *range(1, 40)], 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later hash
    assert block_hashes(list(range(40)), 16, extra=b"salt")[0] != a[0]
    assert len(set(a)) == 2


def test_a_hit_never_covers_the_last_prompt_token() -> None:
    assert hit_cap(32, 16) == 1  # two full blocks, but the 32nd token is computed again
    assert hit_cap(33, 16) == 2
    assert hit_cap(1, 16) == 0


def test_leading_stops_at_the_first_miss() -> None:
    assert leading([b"a", b"b", b"c"], {b"a", b"c"}) == 1
    assert leading([b"a", b"b"], {b"a", b"b", b"x"}) == 2
    assert leading([], set()) == 0


def test_index_is_lru_per_engine_bounded_by_its_capacity() -> None:
    index = PrefixIndex()
    index.set_capacity("e", 3)
    index.record("e", [b"1", b"2"])
    index.record("e", [b"3"])
    index.record("e", [b"1"])  # used again: the most recent now
    index.record("e", [b"4"])  # over capacity: the least recently used (b"2") goes
    assert index.cached("e", [b"1"]) == 1 and index.cached("e", [b"2"]) == 0
    assert index.cached("e", [b"3", b"4"]) == 1 + 1
    assert index.cached("other", [b"1"]) == 0
    index.forget("e")
    assert index.cached("e", [b"1"]) == 0 and len(index) == 0


def test_removed_hashes_leave_the_index_and_the_rest_keep_their_order() -> None:
    index = PrefixIndex()
    index.record("e", [b"1", b"2", b"3"])
    assert index.remove("e", [b"2", b"9"]) == 1  # b"9" was never recorded
    assert index.hashes("e") == [b"1", b"3"] and len(index) == 2
    assert index.cached("e", [b"1", b"2", b"3"]) == 1  # a hit stops where a block is gone
    assert index.remove("other", [b"1"]) == 0 and len(index) == 2


@given(st.lists(st.lists(st.binary(min_size=1, max_size=2), max_size=8), max_size=60))
def test_the_index_never_exceeds_its_bounds(prompts: list[list[bytes]]) -> None:
    index = PrefixIndex(max_entries=10)
    index.set_capacity("a", 6)
    for i, hashes in enumerate(prompts):
        index.record("ab"[i % 2], hashes)
        assert len(index) <= 10
        assert index.held("a") <= 6
        assert len(index) == index.held("a") + index.held("b")


def test_holds_credit_only_what_a_live_lease_holds_and_count_shared_blocks_once() -> None:
    holds = PrefixHolds()
    system = block_hashes(list(range(64)), 16)  # four blocks of a shared system prompt
    first = [*system, *block_hashes([*range(64), *range(500, 532)], 16)[4:]]  # + 2 own
    assert holds.leading("e", system) == 0  # nothing held: no credit
    assert holds.hold("e", first) == 6 and holds.shared("e") == 6
    assert holds.leading("e", system) == 4 and holds.leading("f", system) == 0
    second = [*system, *block_hashes([*range(64), *range(900, 916)], 16)[4:]]
    assert holds.leading("e", second) == 4  # its fifth block is its own
    assert holds.hold("e", second) == 1 and holds.shared("e") == 7
    assert holds.drop("e", first) == 2  # its own two go; the system prompt stays held
    assert holds.shared("e") == 5 and holds.leading("e", system) == 4
    assert holds.drop("e", second) == 5 and holds.shared("e") == 0
    with pytest.raises(ValueError, match="not held"):
        holds.drop("e", system)


# Prompts as paths in a small tree of blocks: shared prefixes of every length.
_prompts = st.lists(st.integers(0, 2), min_size=0, max_size=5).map(
    lambda path: block_hashes([t for i, b in enumerate(path) for t in (i, b) * 8], 16)
)


@given(st.lists(st.tuples(st.booleans(), _prompts, st.integers(0, 30)), max_size=60))
def test_the_ledger_with_holds_equals_private_blocks_plus_distinct_held(
    steps: list[tuple[bool, list[bytes], int]],
) -> None:
    """Admissions cost `T − leading`, releases give back `T − k` plus what `drop` frees: the
    ledger is always the live leases' private blocks plus each held block once."""
    holds, live, ledger = PrefixHolds(), [], 0
    for admit, hashes, extra in steps:
        if admit or not live:
            total = len(hashes) + extra  # its prompt's full blocks and the rest
            credit = holds.leading("e", hashes)
            assert credit == _reference_leading(live, hashes)
            new = holds.hold("e", hashes)
            assert new == len(hashes) - credit
            ledger += total - credit
            live.append((hashes, total))
        else:
            hashes, total = live.pop(0)
            ledger -= total - len(hashes) + holds.drop("e", hashes)
        distinct = {h for held, _ in live for h in held}
        assert holds.shared("e") == len(distinct)
        assert ledger == sum(total - len(h) for h, total in live) + len(distinct)
    for hashes, _ in live:
        holds.drop("e", hashes)
    assert holds.shared("e") == 0


def _reference_leading(live: list[tuple[list[bytes], int]], hashes: list[bytes]) -> int:
    held = {h for h_list, _ in live for h in h_list}
    return leading(hashes, held)
