"""vLLM's KV events read into the prefix index: the batches parsed in both layouts, stored
blocks hashed as the gateway hashes the same prompt, removals, resets, and what is skipped.

Payloads here are what msgpack gives for vLLM's structs (maps in 0.32, tagged arrays
before); tests/engines/test_kv_events.py encodes them with vLLM's own struct definitions."""

from typing import Any

import pytest

from gateway.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFeed,
    EventFormatError,
    parse_batch,
)
from gateway.core.prefix import PrefixIndex, block_hashes, extra_for

BS = 4
PROMPT = list(range(100, 112))  # 3 full blocks of 4


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def stored(hashes: list[Any], parent: Any, tokens: list[int], **more: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return {**event, **more}


def feed(limit: int = 100) -> tuple[EventFeed, PrefixIndex]:
    index = PrefixIndex()
    return EventFeed(index, "e", model="m", block_size=BS, limit=limit), index


def batch(n: int, *events: Any) -> EventBatch:
    return parse_batch(seq(n), [1.5, list(events), 0])


def ours(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    return block_hashes(tokens, BS, extra_for("m", salt))


def test_a_batch_parses_in_the_map_layout_of_vllm_0_32() -> None:
    got = parse_batch(
        seq(7),
        [
            1.5,
            [
                stored([11, 12], None, PROMPT[:8], extra_keys=[["s"], None]),
                {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ],
    )
    assert got.seq == 7 and got.ts == 1.5 and got.rank == 0
    first = got.events[0]
    assert isinstance(first, BlockStored)
    assert first.block_hashes == (11, 12) and first.parent is None and not first.lora
    assert first.token_ids == tuple(PROMPT[:8]) and first.block_size == BS
    assert first.extra_keys == (("s",), None) and first.medium == "GPU" and first.group == 0
    assert got.events[1] == BlockRemoved((b"\x01" * 32,), "GPU")
    assert got.events[2] == AllBlocksCleared()


def test_a_batch_parses_in_the_tagged_array_layout_of_earlier_releases() -> None:
    # array_like=True, omit_defaults=True: fields in order, trailing defaults left out.
    got = parse_batch(
        seq(0),
        [
            2.0,
            [
                ["BlockStored", [11], 10, PROMPT[:4], BS, 3],
                ["BlockRemoved", [11]],
                ["AllBlocksCleared"],
            ],
        ],
    )
    assert got.rank is None
    assert got.events[0] == BlockStored((11,), 10, tuple(PROMPT[:4]), BS, lora=True)
    assert got.events[1] == BlockRemoved((11,))
    assert got.events[2] == AllBlocksCleared()


@pytest.mark.parametrize(
    ("frame", "payload"),
    [
        (b"\x00" * 4, [1.0, []]),  # the sequence frame is 8 bytes
        (seq(0), {"ts": 1.0}),
        (seq(0), [1.0]),
        (seq(0), ["x", []]),
        (seq(0), [1.0, [{"type": "Unknown"}]]),
        (seq(0), [1.0, [["Unknown", 1]]]),
        (seq(0), [1.0, [7]]),
        (seq(0), [1.0, [{"type": "BlockRemoved", "block_hashes": ["not a hash"]}]]),
        (seq(0), [1.0, [stored([1], None, ["x", "y", "z", "w"])]]),
        (seq(0), [1.0, [stored([1], None, PROMPT[:4], block_size=0)]]),
        (seq(0), [1.0, [stored([1], "parent", PROMPT[:4])]]),
        (seq(0), [1.0, [stored([1], None, PROMPT[:4], medium=5)]]),
        (seq(0), [1.0, [stored([1], None, PROMPT[:4], extra_keys="s")]]),
        (seq(0), [1.0, [], "rank"]),
    ],
)
def test_what_is_not_an_event_batch_is_refused(frame: bytes, payload: Any) -> None:
    with pytest.raises(EventFormatError):
        parse_batch(frame, payload)


def test_stored_blocks_are_recorded_as_the_gateway_hashes_the_same_prompt() -> None:
    f, index = feed()
    # The prompt's first two blocks in one event, the third (its parent the second) later.
    f.apply(batch(0, stored([11, 12], None, PROMPT[:8])))
    assert index.cached("e", ours(PROMPT)) == 2
    f.apply(batch(1, stored([13], 12, PROMPT[8:12])))
    assert index.hashes("e") == ours(PROMPT) and len(f) == 3
    assert f.counts.stored == 3 and f.counts.skipped == 0 and f.counts.batches == 2


def test_the_first_blocks_salt_chains_like_the_requests_cache_salt() -> None:
    f, index = feed()
    f.apply(batch(0, stored([21, 22], None, PROMPT[:8], extra_keys=[["tenant-a"], None])))
    assert index.cached("e", ours(PROMPT[:8], b"tenant-a")) == 2
    assert index.cached("e", ours(PROMPT[:8])) == 0


@pytest.mark.parametrize(
    "event",
    [
        stored([1, 2], None, PROMPT[:8], lora_id=1, lora_name="sql"),  # an adapter's blocks
        stored([1, 2], None, PROMPT[:8], lora_name="sql"),
        stored([1, 2], None, PROMPT[:8], medium="CPU"),  # an offloading tier
        stored([1, 2], None, PROMPT[:8], group_idx=1),  # another KV cache group
        stored([1, 2], None, PROMPT[:8], block_size=8, token_ids=PROMPT[:16]),
        stored([1, 2], None, PROMPT[:7]),  # tokens that are not the blocks' (a partial block)
        stored([1, 2], 99, PROMPT[:8]),  # a parent the gateway never saw
        stored([1, 2], None, PROMPT[:8], extra_keys=[[["mm-hash", 0]], None]),  # media
        stored([1, 2], None, PROMPT[:8], extra_keys=[["s", b"embeds"], None]),
    ],
)
def test_blocks_the_gateway_cannot_hash_as_its_own_are_skipped_and_counted(
    event: dict[str, Any],
) -> None:
    f, index = feed()
    f.apply(batch(0, event))
    assert index.held("e") == 0 and len(f) == 0
    assert f.counts.skipped == 2 and f.counts.stored == 0


def test_a_chain_stops_at_the_first_block_it_cannot_hash() -> None:
    f, index = feed()
    f.apply(batch(0, stored([1, 2, 3], None, PROMPT, extra_keys=[None, [["mm", 4]], None])))
    assert index.hashes("e") == ours(PROMPT)[:1]
    assert f.counts.stored == 1 and f.counts.skipped == 2
    f.apply(batch(1, stored([4], 3, PROMPT[:4])))  # its parent was skipped
    assert f.counts.skipped == 3


def test_removed_blocks_leave_the_index_and_a_twice_stored_hash_when_both_are_gone() -> None:
    f, index = feed()
    f.apply(batch(0, stored([11, 12], None, PROMPT[:8])))
    f.apply(batch(1, stored([11], None, PROMPT[:4])))  # a second copy of block 11
    f.apply(batch(2, {"type": "BlockRemoved", "block_hashes": [12, 11, 404], "medium": "GPU"}))
    assert index.hashes("e") == ours(PROMPT)[:1]  # one copy of 11 is still cached
    f.apply(batch(3, {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}))
    assert index.held("e") == 0 and len(f) == 0 and f.counts.removed == 2
    f.apply(
        batch(
            4,
            stored([11], None, PROMPT[:4]),
            {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU"},
        )
    )
    assert index.held("e") == 1  # another medium's removal is not the engine's cache


def test_all_blocks_cleared_a_gap_or_a_restarted_sequence_forgets_the_engine() -> None:
    f, index = feed()
    index.record("other", [b"x"])
    f.apply(batch(0, stored([11], None, PROMPT[:4]), {"type": "AllBlocksCleared"}))
    assert index.held("e") == 0 and f.counts.resets == 1
    f.apply(batch(1, stored([11], None, PROMPT[:4])))
    f.apply(batch(3, stored([13], 11, PROMPT[4:8])))  # batch 2 was lost: 13's parent unknown
    assert index.held("e") == 0 and f.counts.resets == 2 and f.counts.skipped == 1
    f.apply(batch(4, stored([11], None, PROMPT[:4])))
    f.apply(batch(0, stored([31], None, PROMPT[4:8])))  # numbered from 0 again: a new engine
    assert index.hashes("e") == ours(PROMPT[4:8]) and f.counts.resets == 3
    assert index.held("other") == 1 and f.counts.last_seq == 0


def test_the_map_of_vllm_hashes_is_bounded_oldest_first() -> None:
    f, index = feed(limit=2)
    f.apply(batch(0, stored([11, 12, 13], None, PROMPT)))
    assert len(f) == 2 and index.held("e") == 3  # the index is bounded by its own rules
    f.apply(batch(1, stored([14], 11, PROMPT[4:8])))  # 11 is no longer mapped
    assert f.counts.skipped == 1
