"""The exact mode's I/O edge: messages encoded exactly as vLLM's publisher encodes them
decoded, and a real ZMQ PUB socket followed by the subscriber."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import zmq

from gateway.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFormatError,
)
from gateway.engines.kv_events import KvEventSubscriber, decode_message
from gateway.harness import free_port

# vLLM 0.32's structs (vllm/distributed/kv_events.py), fields and options as there.


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredV(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemovedV(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksClearedV(KVCacheEvent, tag="AllBlocksCleared"):
    pass


# The earlier layout (vLLM 0.9-0.10): events are tagged arrays.
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


TOKENS = list(range(256))


def message(seq: int, *events: Any, topic: bytes = b"kv-events") -> list[bytes]:
    """What vLLM's ZmqEventPublisher sends: (topic, seq as 8 bytes big-endian, payload)."""
    payload = msgspec.msgpack.Encoder().encode(VllmEventBatch(ts=1.5, events=list(events)))
    return [topic, seq.to_bytes(8, "big"), payload]


def test_a_message_as_vllm_encodes_it_decodes() -> None:
    frames = message(
        3,
        BlockStoredV(
            block_hashes=[2**64 - 1, 5],
            parent_block_hash=None,
            token_ids=TOKENS,
            block_size=128,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[("salt",), None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemovedV(block_hashes=[b"\x07" * 32], medium="GPU", group_idx=0),
        AllBlocksClearedV(),
    )
    got = decode_message(frames)
    assert got.seq == 3 and got.ts == 1.5 and got.rank is None
    assert got.events == (
        BlockStored(
            (2**64 - 1, 5),
            None,
            tuple(TOKENS),
            128,
            lora=False,
            medium="GPU",
            group=0,
            extra_keys=(("salt",), None),
        ),
        BlockRemoved((b"\x07" * 32,), "GPU", 0),
        AllBlocksCleared(),
    )


def test_the_earlier_array_layout_decodes_too() -> None:
    payload = msgspec.msgpack.encode(
        VllmEventBatch(ts=2.0, events=[LegacyStored([9], 8, TOKENS[:16], 16, None)])
    )
    got = decode_message([b"", (0).to_bytes(8, "big"), payload])
    assert got.events == (BlockStored((9,), 8, tuple(TOKENS[:16]), 16, lora=False),)


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv-events", (0).to_bytes(8, "big")],
        [b"kv-events", (0).to_bytes(8, "big"), b"\xc1"],  # 0xc1: never used in msgpack
        [b"kv-events", (0).to_bytes(8, "big"), msgspec.msgpack.encode({"ts": 1})],
    ],
)
def test_a_message_that_is_not_vllms_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(EventFormatError, match=r"frames|msgpack|payload"):
        decode_message(frames)


async def test_the_subscriber_follows_a_real_publisher_and_reports_what_it_cannot_read() -> None:
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    got: list[tuple[str, EventBatch]] = []
    lost: list[str] = []
    sub = KvEventSubscriber(
        {"e1": f"tcp://127.0.0.1:{port}"},
        on_batch=lambda e, b: got.append((e, b)),
        on_lost=lost.append,
    )
    sub.start()
    try:
        # A PUB socket drops what it sends before a subscriber has joined: send until one
        # message arrives, then the ones that count.
        for _ in range(100):
            pub.send_multipart(message(0))
            await asyncio.sleep(0.02)
            if got:
                break
        assert got, "the subscriber never received a message"
        got.clear()
        pub.send_multipart([b"kv-events", (1).to_bytes(8, "big"), b"\xc1"])
        pub.send_multipart(message(2, AllBlocksClearedV()))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if got:
                break
        assert lost == ["e1"]
        assert [(e, b.seq, b.events) for e, b in got] == [("e1", 2, (AllBlocksCleared(),))]
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.term()
    assert sub._ctx is None and not sub._tasks  # stopped: nothing left running


@pytest.mark.timeout(10)
async def test_a_subscriber_stopped_before_its_tasks_ran_closes_everything() -> None:
    sub = KvEventSubscriber(
        {"e1": f"tcp://127.0.0.1:{free_port()}"}, on_batch=lambda e, b: None, on_lost=print
    )
    sub.start()
    await sub.stop()  # the tasks never ran: their sockets are closed with the context
    assert sub._ctx is None and not sub._tasks
