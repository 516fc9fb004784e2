"""The footprints' prefixes: hashed as vLLM shares blocks, capped as vLLM reads them, and what
each engine is expected to cache, forgotten when the engine starts a new epoch."""

from dataclasses import replace

import pytest

from gateway.core.kv_events import BlockStored, EventBatch
from gateway.core.prefix import PrefixIndex, block_hashes
from gateway.core.types import EngineSpec, Footprint
from gateway.engines.pool import EnginePool
from gateway.prefixes import PrefixCache

SPECS = [
    EngineSpec("a", "http://a", frozenset({"m"}), 101, 16, 8, 2048, prefix_caching=True),
    # another block size
    EngineSpec("b", "http://b", frozenset({"m"}), 101, 32, 8, 2048, prefix_caching=True),
]
NEEDS = {"a": Footprint(10, 1, 160, 4), "b": Footprint(5, 1, 160, 2)}
IDS = list(range(64))  # 4 full blocks of 16, 2 of 32


def cache(credit: bool = True, index: bool = True) -> tuple[PrefixCache, EnginePool]:
    pool = EnginePool(list(SPECS))
    return PrefixCache(pool, credit=credit, index=PrefixIndex() if index else None), pool


def test_prefixes_are_capped_where_vllm_stops_reading_and_hashed_per_block_size() -> None:
    prefixes, _ = cache()
    got = prefixes.footprints(NEEDS, IDS, model="m", salt=b"")
    # 64 tokens: the last is always computed, so 3 of 4 blocks of 16 and 1 of 2 of 32.
    assert len(got.needs["a"].prefix) == 3 and len(got.needs["b"].prefix) == 1
    assert len(got.blocks["a"]) == 4 and len(got.blocks["b"]) == 2  # what the engine caches
    assert got.needs["a"].blocks == 10 and got.needs["a"].cached == 0  # nothing known yet
    assert got.needs["a"].prefix == tuple(block_hashes(IDS, 16, b"m\0"))[:3]


def test_an_engine_that_does_not_cache_gets_no_prefix_no_hit_and_no_index_entry() -> None:
    pool = EnginePool([SPECS[0], replace(SPECS[1], prefix_caching=False)])
    prefixes = PrefixCache(pool, credit=True, index=PrefixIndex())
    first = prefixes.footprints(NEEDS, IDS, model="m", salt=b"")
    for name in ("a", "b"):
        prefixes.sent(name, first.blocks.get(name, ()))
    got = prefixes.footprints(NEEDS, IDS, model="m", salt=b"")
    assert got.needs["a"].prefix and got.needs["a"].cached == 3  # "a" caches
    assert got.needs["b"] == NEEDS["b"] and "b" not in got.blocks  # "b" shares nothing
    assert prefixes.status("b") == {"blocks": 0, "kv_events": None}


def test_no_prefix_without_ids_or_with_a_request_that_reads_no_cache() -> None:
    prefixes, _ = cache()
    for ids, salt in ((None, b""), (IDS, None), ([], b"")):
        got = prefixes.footprints(NEEDS, ids, model="m", salt=salt)
        assert got.needs == NEEDS and not got.blocks


def test_the_salt_and_the_model_keep_prefixes_apart() -> None:
    prefixes, _ = cache()
    plain = prefixes.footprints(NEEDS, IDS, model="m", salt=b"").needs["a"].prefix
    salted = prefixes.footprints(NEEDS, IDS, model="m", salt=b"s").needs["a"].prefix
    lora = prefixes.footprints(NEEDS, IDS, model="m-lora", salt=b"").needs["a"].prefix
    assert len({plain[0], salted[0], lora[0]}) == 3


def test_what_was_sent_is_expected_cached_there_until_the_engine_restarts() -> None:
    prefixes, pool = cache()
    first = prefixes.footprints(NEEDS, IDS, model="m", salt=b"")
    prefixes.sent("a", first.blocks["a"])
    again = prefixes.footprints(NEEDS, IDS, model="m", salt=b"")
    assert again.needs["a"].cached == 3 and again.needs["b"].cached == 0
    assert again.needs["a"].blocks == 10  # cached is for routing: nothing is credited here
    pool.started("a", 1.0)
    pool.started("a", 2.0)  # a new process: its cache is empty
    assert prefixes.footprints(NEEDS, IDS, model="m", salt=b"").needs["a"].cached == 0


def test_credit_off_keeps_the_index_for_routing_and_no_index_keeps_the_credit() -> None:
    no_credit, _ = cache(credit=False)
    no_credit.sent("a", tuple(block_hashes(IDS, 16, b"m\0")))
    got = no_credit.footprints(NEEDS, IDS, model="m", salt=b"").needs["a"]
    assert got.prefix == () and got.cached == 3
    no_index, _ = cache(index=False)
    got = no_index.footprints(NEEDS, IDS, model="m", salt=b"").needs["a"]
    assert len(got.prefix) == 3 and got.cached == 0


def stored(seq: int, hashes: tuple[int, ...], tokens: list[int]) -> EventBatch:
    return EventBatch(seq, 0.0, (BlockStored(hashes, None, tuple(tokens), 16, lora=False),))


def test_a_followed_engine_is_expected_to_cache_what_its_events_report_not_what_was_sent() -> None:
    prefixes, pool = cache()
    prefixes.follow("a", "m")
    sent = prefixes.footprints(NEEDS, IDS, model="m", salt=b"")
    prefixes.sent("a", sent.blocks["a"])
    prefixes.sent("b", sent.blocks["b"])  # not followed: what was sent counts
    assert prefixes.footprints(NEEDS, IDS, model="m", salt=b"").needs["a"].cached == 0
    prefixes.events("a", stored(0, (1, 2), IDS[:32]))
    prefixes.events("b", stored(0, (1, 2), IDS[:32]))  # not followed: ignored
    again = prefixes.footprints(NEEDS, IDS, model="m", salt=b"").needs
    assert again["a"].cached == 2 and again["b"].cached == 1
    status = prefixes.status("a")
    assert status is not None and status["blocks"] == 2
    assert status["kv_events"]["stored"] == 2 and status["kv_events"]["last_seq"] == 0
    assert prefixes.status("b") == {"blocks": 2, "kv_events": None}
    # A new epoch forgets the index and the events' sequence: numbering from 0 again is no gap.
    pool.started("a", 1.0)
    pool.started("a", 2.0)
    prefixes.events("a", stored(0, (7,), IDS[:16]))
    assert prefixes.footprints(NEEDS, IDS, model="m", salt=b"").needs["a"].cached == 1
    assert prefixes.status("a")["kv_events"]["resets"] == 0  # type: ignore[index]
    prefixes.lost("a")  # an unreadable message: what it caches is unknown
    assert prefixes.status("a") == {
        "blocks": 0,
        "kv_events": {
            "batches": 2,
            "stored": 3,
            "removed": 0,
            "skipped": 0,
            "resets": 1,
            "last_seq": None,
        },
    }


def test_no_index_no_following() -> None:
    prefixes, _ = cache(index=False)
    with pytest.raises(ValueError, match="no prefix index"):
        prefixes.follow("a", "m")
    assert prefixes.status("a") is None
