"""Block hashes and the prefix index: what the gateway expects each engine to have cached."""

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.prefix import PrefixIndex, block_hashes, hit_cap, leading


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


@given(st.lists(st.lists(st.binary(min_size=1, max_size=2), max_size=8), max_size=60))
def test_the_index_never_exceeds_its_bounds(prompts: list[list[bytes]]) -> None:
    index = PrefixIndex(max_entries=10)
    index.set_capacity("a", 6)
    for i, hashes in enumerate(prompts):
        index.record("ab"[i % 2], hashes)
        assert len(index) <= 10
        assert index.held("a") <= 6
        assert len(index) == index.held("a") + index.held("b")
